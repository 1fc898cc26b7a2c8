"""The torch backend: the step's metadata for attention in torch ops (torch_ops.py).

From the runner's `StepSequence` data it decides how decodes are grouped and padded (runs of
similar lengths, `split_by_length`), where padding points (the null block), and what sequences
under KV eviction need (keys rotated when read, observed attention rows). The CPU paged backend
(cpu_paged.py) builds the same metadata and reads decodes in place instead.
"""
from __future__ import annotations

import numpy as np
import torch

from kvserve.cache.block_pool import NULL_BLOCK_ID
from kvserve.model.attention.base import AttentionBackend
from kvserve.model.attention.metadata import (AttentionGroup, AttentionMetadata, ObservedAttention, PrefillChunk,
                                              StepSequence, attended_sequences)
from kvserve.model.attention.torch_ops import paged_attention

# A decode group's fixed cost (its gather, matmuls, softmax and mask in every layer) is about
# that of attending to this many more padded context tokens on CPU (estimated from a profile of
# the default model: BENCHMARKS.md, "Offline throughput").
GROUP_COST_TOKENS = 1024


def split_by_length(num_blocks: list[int], block_size: int) -> list[tuple[int, int]]:
    """Cut decodes sorted by context length (longest first, in blocks) into [start, end) runs
    padded separately, minimising padded context tokens + GROUP_COST_TOKENS per run (dynamic
    programming over the sorted lengths: a run's cost is its first length times its size)."""
    n = len(num_blocks)
    if n == 0:
        return []
    padded = np.asarray(num_blocks, dtype=np.float64) * block_size
    best = np.zeros(n + 1)  # best[j]: cheapest cut of the first j decodes
    cut = np.zeros(n + 1, dtype=np.int64)  # start of the last run in that cut
    for j in range(1, n + 1):
        starts = np.arange(j)
        costs = best[:j] + GROUP_COST_TOKENS + padded[:j] * (j - starts)
        cut[j] = int(np.argmin(costs))
        best[j] = costs[cut[j]]
    runs, end = [], n
    while end > 0:
        runs.append((int(cut[end]), end))
        end = int(cut[end])
    return runs[::-1]


def padded_block_tables(members: list[StepSequence], block_size: int) -> np.ndarray:
    """[sequences, most blocks] int64: each sequence's blocks holding its seq_len tokens, padded
    with the null block."""
    needed = [-(-s.seq_len // block_size) for s in members]
    tables = np.full((len(members), max(needed)), NULL_BLOCK_ID, dtype=np.int64)
    for i, (s, n) in enumerate(zip(members, needed)):
        tables[i, :n] = s.block_table[:n]
    return tables


class TorchBackend(AttentionBackend):
    """Attention in torch ops (torch_ops.py): each step's context gathered from the pool into padded
    tensors, then matmuls and softmax, or SDPA. Runs anywhere, reads every KV format, and is the
    reference the other backends are tested against."""

    name = "torch"

    @classmethod
    def unsupported(cls, config):
        if config.deterministic:
            return ("--deterministic needs one reduction order per query row, and torch ops' padded matmuls and SDPA "
                    "change theirs with the batch: the cpu_paged (CPU) or triton backend has it")
        return None

    @property
    def description(self) -> str:
        return "torch ops (gathered blocks)"

    def attend(self, query, key, value, pool, kv_format, meta, window):
        return paged_attention(query, key, value, pool, kv_format, meta, window)

    def decode_in_place(self, pool: dict[str, torch.Tensor], query: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, window: int | None) -> torch.Tensor:
        """Decode attention read in place (pool, queries [B, H, d], block tables [B, W], seq_lens,
        window): only backends with `reads_decodes_in_place` have it."""
        raise NotImplementedError(f"the {self.name} backend gathers decodes")

    # ------------------------------------------------------------------ metadata
    def build(self, sequences: list[StepSequence], slot_mapping: torch.Tensor) -> AttentionMetadata:
        """The step's metadata; `sequences` in packed order (`packing_order`). Sequences whose
        eviction policy observes attention get zeroed [rows, seq_len] float32 tensors, listed in
        `AttentionMetadata.observed_attention` for the caller to collect after the forward pass.
        Under --deterministic every query row is a decode (`rows_as_decodes`), which only the
        backends reading decodes in place serve."""
        sequences = attended_sequences(sequences, self.config.deterministic)
        decode = [s for s in sequences if s.is_decode and not s.keys_before_rope]
        evicting_decode = [s for s in sequences if s.is_decode and s.keys_before_rope]
        observed: list[tuple[str, torch.Tensor]] = []
        chunks = []
        for seq in sequences:
            if seq.is_decode or not self._gathers_chunk(seq):
                continue
            chunk = PrefillChunk(seq.row_start, seq.num_queries, seq.seq_len, self._tensor(seq.block_table))
            if seq.keys_before_rope:
                chunk.key_rope = self._key_rope(seq.seq_len)
            if seq.observed_rows is not None:
                first, num_rows, summed = seq.observed_rows
                rows = torch.zeros(num_rows, seq.seq_len, dtype=torch.float32, device=self.device)
                chunk.observed_attention = ObservedAttention(rows, first, summed)
                observed.append((seq.request_id, rows))
            chunks.append(chunk)
        rows = [r for s in sequences if s.keys_before_rope for r in range(s.row_start, s.row_start + s.num_queries)]
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            decodes=[self._decode_group(decode[a:b]) for a, b in self._decode_runs(decode)],
            prefills=chunks,
            evicting_decode=self._evicting_decode_group(evicting_decode, observed),
            unrotated_key_rows=self._tensor(rows) if rows else None,
            decode_in_place=self.decode_in_place if self.reads_decodes_in_place else None,
            observed_attention=observed,
            backend=self,
        )

    def _gathers_chunk(self, seq: StepSequence) -> bool:
        """Whether this prefill chunk is attended by torch ops (here: every chunk)."""
        return True

    def _decode_runs(self, decode: list[StepSequence]) -> list[tuple[int, int]]:
        """[start, end) runs of the decodes that attend together: one run when the pool is read in
        place (nothing is padded), else runs of similar lengths (split_by_length)."""
        if self.reads_decodes_in_place:
            return [(0, len(decode))] if decode else []
        return split_by_length([-(-s.seq_len // self.block_size) for s in decode], self.block_size)

    def _decode_group(self, members: list[StepSequence]) -> AttentionGroup | None:
        """Pad the decodes' block tables to a common length with the null block."""
        if not members:
            return None
        block_ids = padded_block_tables(members, self.block_size)
        return AttentionGroup(block_ids=self._tensor(block_ids.reshape(-1)),
                              seq_lens=self._tensor([s.seq_len for s in members]),
                              context_len=block_ids.shape[1] * self.block_size,
                              max_seq_len=max(s.seq_len for s in members))

    def _evicting_decode_group(self, members: list[StepSequence],
                               observed: list[tuple[str, torch.Tensor]]) -> AttentionGroup | None:
        """The decode group of sequences under eviction: keys rotated by cache index when gathered,
        and their attention observed (one row each, the decode's query) when a policy asks."""
        group = self._decode_group(members)
        if group is None:
            return None
        group.key_rope = self._key_rope(group.context_len)
        scored = [i for i, s in enumerate(members) if s.observed_rows is not None]
        if scored:
            group.observed_attention = torch.zeros(len(members), group.context_len, dtype=torch.float32,
                                                   device=self.device)
            observed.extend((members[i].request_id, group.observed_attention[i: i + 1, : members[i].seq_len])
                            for i in scored)
        return group

    def _key_rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [length, head_dim] of positions 0..length-1, as
        positions.rope_gathered_keys takes them. Past the table's end (a padded block beyond
        max-model-len) the last row repeats: those keys are masked anyway."""
        cos, signed_sin = self.rope.cos, self.rope.signed_sin
        index = torch.arange(length, device=cos.device).clamp_(max=cos.shape[0] - 1)
        return cos[index], signed_sin[index]
