"""What rank 0 sends the workers, as plain picklable data (broadcast_object_list on the control group)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.cache.kv_cache import KVCacheSpec
from kvserve.model.attention import StepSequence


@dataclass
class Setup:
    """Once, after rank 0 has sized its pool and calibrated: what every rank must agree on.
    Key centres and bases are the full per-layer tensors; each rank takes its heads."""

    dtype: torch.dtype
    max_positions: int  # the RoPE table's length
    kv_spec: KVCacheSpec  # per rank
    num_blocks: int
    key_centers: list[torch.Tensor] | None = None
    key_bases: list[torch.Tensor] | None = None


@dataclass
class StepPlan:
    """One forward pass: the packed tokens, their positions and pool slots, and each sequence's
    share of the batch (from which every rank's attention backend builds the same metadata)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    sequences: list[StepSequence]


@dataclass
class MoveTokens:
    """A compaction's token copies (KV eviction), carried out on every rank's pool."""

    src_slots: list[int]
    dst_slots: list[int]


@dataclass
class Describe:
    """Every rank answers with its RankStats (a gather on the control group)."""


@dataclass
class RankStats:
    """One rank's shard, measured on its real tensors."""

    rank: int
    weight_bytes: int  # every weight tensor the rank holds (replicated ones included; quant_linear.resident_weight_bytes)
    sharded_layer_bytes: int  # the q/k/v, o, gate/up and down projections, as served (quant_linear.quantized_bytes)
    kv_pool_bytes: int
    q_heads: int
    kv_heads: int
    linears: str = "none (full-precision weights)"  # its quantized linears (QuantizationReport.describe)


@dataclass
class Heartbeat:
    """Sent while rank 0 is idle, so that a waiting worker can tell a quiet engine from a dead one."""


@dataclass
class Shutdown:
    """The workers leave their loop and exit."""
