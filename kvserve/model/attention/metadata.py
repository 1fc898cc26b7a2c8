"""What an attention backend works from: the runner's plain per-sequence data (`StepSequence`),
and the step's metadata a backend builds from it (`AttentionMetadata`: decode groups, prefill
chunks, slots, what sequences under KV eviction need).

The runner packs decodes first, then prefill chunks (`packing_order`); the metadata names each
sequence's rows of that packed batch. Every backend takes the same `StepSequence` list, so the
scheduler and the runner never know which backend runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

if TYPE_CHECKING:
    from kvserve.model.attention.base import AttentionBackend


@dataclass
class StepSequence:
    """One sequence's share of a step: packed rows [row_start, row_start + num_queries), a
    context of `seq_len` tokens once they are written, the block table holding it."""

    request_id: str
    row_start: int
    num_queries: int
    seq_len: int
    block_table: np.ndarray  # int64 block ids
    # Speculative decoding: a decode's last token and its drafts, each row attended as a decode
    # of its own (`rows_as_decodes`), so that the step stays one the decode paths serve.
    verifies_drafts: bool = False
    keys_before_rope: bool = False  # under KV eviction: keys stored unrotated, rotated when read
    # Under an eviction policy that observes attention: (first observed query row, rows
    # reported, whether they are summed into one), as Evictor.observed_rows gives it.
    observed_rows: tuple[int, int, bool] | None = None

    @property
    def is_decode(self) -> bool:
        return self.num_queries == 1


def attended_sequences(sequences: list[StepSequence], deterministic: bool) -> list[StepSequence]:
    """The sequences as a backend attends them: under --deterministic every row as a decode, else
    the rows of draft-verifying chunks (`StepSequence.verifies_drafts`) as decodes."""
    if deterministic:
        return rows_as_decodes(sequences)
    if any(s.verifies_drafts for s in sequences):
        return rows_as_decodes(sequences, only_verifying=True)
    return sequences


def rows_as_decodes(sequences: list[StepSequence], only_verifying: bool = False) -> list[StepSequence]:
    """Every query row of the step (`only_verifying`: of the chunks verifying drafts) as a decode
    of its own, in packed-row order: row i of a chunk of q queries attends to the first
    seq_len - q + i + 1 tokens of its context. Under --deterministic a token's attention is then
    the same computation whether it is prefilled in any chunk, decoded, or recomputed after a
    preemption."""
    rows = []
    for seq in sorted(sequences, key=lambda s: s.row_start):
        if only_verifying and not seq.verifies_drafts:
            rows.append(seq)
            continue
        first = seq.seq_len - seq.num_queries
        rows.extend(StepSequence(seq.request_id, seq.row_start + i, 1, first + i + 1, seq.block_table)
                    for i in range(seq.num_queries))
    return rows


def packing_order(is_decode: bool, keys_before_rope: bool, context_len: int, verifies_drafts: bool = False) -> tuple:
    """Sort key of a sequence in the packed batch: decodes first (each attention group then owns
    one run of rows), then chunks verifying drafts (attended as decodes too), then prefill
    chunks; sequences under eviction after the others, decodes longest first (so that similar
    lengths are neighbours)."""
    return (0 if is_decode else 1 if verifies_drafts else 2, keys_before_rope, -context_len if is_decode else 0)



@dataclass
class AttentionGroup:
    """The decode requests of a step (one query each), padded to a common context length. Their
    queries are the first rows of the packed batch."""

    block_ids: torch.Tensor  # [requests * blocks_per_seq] flattened, padded block tables
    seq_lens: torch.Tensor  # [requests] context length after this step's token is written
    context_len: int  # blocks_per_seq * block_size
    max_seq_len: int  # the longest of seq_lens (a group of one request: its exact length)
    # Evicting requests only: cos and signed sin [context_len, head_dim] to rotate their keys
    # (stored before RoPE) by cache index (positions.py); a [requests, context_len] float32
    # tensor that each layer adds its attention probabilities to, summed over query heads.
    key_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    observed_attention: torch.Tensor | None = None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    def mask_bias(self, window: int | None) -> torch.Tensor:
        """[requests, 1, context] float32, 0 where the query may attend and -inf elsewhere; built
        once per step for each distinct sliding window and shared by all layers."""
        if window not in self._masks:
            kv_pos = torch.arange(self.context_len, device=self.seq_lens.device)
            q_pos = (self.seq_lens - 1)[:, None]
            allowed = kv_pos < self.seq_lens[:, None]
            if window is not None:
                allowed &= kv_pos > q_pos - window
            bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
            self._masks[window] = bias.masked_fill_(~allowed, float("-inf")).unsqueeze(1)
        return self._masks[window]


@dataclass
class ObservedAttention:
    """Where a chunk reports the attention of its queries [first, num_queries) (what a KV
    eviction policy observes): every layer adds their softmax probabilities, summed over query
    heads, into `rows` [num_queries - first, context_len], one row per query, or with `summed`
    into `rows` [1, context_len], summed over those queries too."""

    rows: torch.Tensor
    first: int = 0
    summed: bool = False


@dataclass
class PrefillChunk:
    """One request's chunk of several queries: packed rows [row_start, row_start + num_queries),
    attending to a context of `context_len` tokens (earlier ones and the chunk itself)."""

    row_start: int
    num_queries: int
    context_len: int
    block_ids: torch.Tensor  # [blocks] the request's block table
    # As in AttentionGroup, for a request under eviction.
    key_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    observed_attention: ObservedAttention | None = None
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict, repr=False)
    _biases: dict[tuple[int | None, torch.dtype], torch.Tensor | None] = field(default_factory=dict, repr=False)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[queries, context] bool, or None when the chunk is plain causal self-attention."""
        if window not in self._masks:
            start = self.context_len - self.num_queries
            if start == 0 and (window is None or window >= self.context_len):
                self._masks[window] = None
            else:
                device = self.block_ids.device
                q_pos = torch.arange(start, self.context_len, device=device)[:, None]
                kv_pos = torch.arange(self.context_len, device=device)
                allowed = kv_pos <= q_pos
                if window is not None:
                    allowed &= kv_pos > q_pos - window
                self._masks[window] = allowed
        return self._masks[window]

    def bias(self, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """`mask` as an additive [queries, context] tensor in `dtype` (0 or -inf): CPU SDPA runs
        faster with it than with the bool mask."""
        key = (window, dtype)
        if key not in self._biases:
            allowed = self.mask(window)
            self._biases[key] = None if allowed is None else torch.zeros(
                allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        return self._biases[key]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] pool slot of each packed token
    decodes: list[AttentionGroup]  # consecutive runs of the first rows
    prefills: list[PrefillChunk]
    evicting_decode: AttentionGroup | None = None  # decodes of evicting requests, right after `decodes`'
    unrotated_key_rows: torch.Tensor | None = None  # packed rows whose keys are stored before RoPE
    # Reads all of `decodes` in place (pool, queries [B, H, d], block tables [B, W], seq_lens, window),
    # or None: they are gathered. Set by the backend when a kernel reads the format's layout.
    decode_in_place: Callable[..., torch.Tensor] | None = None
    # (request id, [rows, seq_len] float32): the attention rows a sequence's eviction policy
    # observes, summed over layers and heads; filled by the forward pass.
    observed_attention: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    # The backend that built this metadata: the model's attention layers hand it their q/k/v.
    backend: AttentionBackend | None = None


