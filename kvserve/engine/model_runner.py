"""Turns the scheduler's plain-data decision into tensors, runs the model, samples.

Input preparation is numpy over each request's token range; the forward pass itself sees one
packed batch of all scheduled tokens.

A request under KV eviction (kvserve/cache/eviction) takes positions from its cache index
(`num_computed_tokens - num_evicted_tokens`), stores keys before RoPE and attends in groups of
its own; the attention rows its policy observes are handed to the evictor after the forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.cache.eviction.config import EvictionConfig
from kvserve.cache.eviction.evictor import Evictor
from kvserve.cache.kv_cache import KVCache
from kvserve.engine.sampler import SampleResult, Sampler
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.model.attention import AttentionGroup, AttentionMetadata, ObservedAttention, PrefillChunk
from kvserve.model.llama import LlamaForCausalLM


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    sampled: list[ScheduledRequest]  # requests that get a token this step, in logits-row order
    # Evicting requests whose policy observes attention: (request id, config, the [rows, seq_len]
    # attention rows its policy asked for, filled by the forward pass).
    observed_attention: list[tuple[str, EvictionConfig, torch.Tensor]] = field(default_factory=list)


# A decode group's fixed cost (its gather, matmuls, softmax and mask in every layer) is about
# that of attending to this many more padded context tokens on CPU (estimated from a profile of
# the default model: ~2.4 ms of per-op overhead a group vs ~2 us per context token over 30 layers).
GROUP_COST_TOKENS = 1024


def split_by_length(num_blocks: list[int], block_size: int = 16) -> list[tuple[int, int]]:
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


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device,
                 evictor: Evictor | None = None):
        self.model = model
        self.evictor = evictor
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.device = device
        self.sampler = Sampler(model.config.vocab_size, device)

    def prepare(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]],
                all_logits: bool = False) -> ModelInputs:
        """Pack the step's tokens. `all_logits` asks for logits at every position (scoring)."""
        bs = self.block_size
        # Decodes first, then prefill chunks: each attention group then owns one run of rows.
        # Within each, requests under eviction come last (their decodes form a group of their own).
        # Decodes go longest context first, so that groups of similar lengths are runs of rows.
        scheduled = sorted(scheduled, key=lambda item: (item.num_new_tokens > 1, item.request.eviction is not None,
                                                        -item.request.num_computed_tokens if item.num_new_tokens == 1 else 0))
        token_chunks, position_chunks, slot_chunks = [], [], []
        decode, evicting_decode, prefill, evicting_rows = [], [], [], []
        logits_rows, sampled = [], []
        offset = 0
        for item in scheduled:
            r, n = item.request, item.num_new_tokens
            start = r.num_computed_tokens
            cache_start = start - r.num_evicted_tokens  # == start without eviction
            positions = np.arange(cache_start, cache_start + n)
            table = np.asarray(block_tables[r.request_id], dtype=np.int64)
            token_chunks.append(r.token_ids[start:start + n])
            position_chunks.append(positions)
            slot_chunks.append(table[positions // bs] * bs + positions % bs)
            member = (offset, n, cache_start + n, table)
            if r.eviction is not None:
                evicting_rows.extend(range(offset, offset + n))
                (evicting_decode if n == 1 else prefill).append((*member, r))
            else:
                (decode if n == 1 else prefill).append((*member, None))
            if all_logits:
                logits_rows.extend(range(offset, offset + n))
            elif item.samples:
                logits_rows.append(offset + n - 1)
                sampled.append(item)
            offset += n

        def tensor(array, dtype=torch.long) -> torch.Tensor:
            return torch.as_tensor(array, dtype=dtype).to(self.device, non_blocking=True)

        observed: list[tuple[str, EvictionConfig, torch.Tensor]] = []
        chunks = []
        for offset, n, seq_len, table, r in prefill:
            chunk = PrefillChunk(offset, n, seq_len, tensor(table))
            if r is not None:
                chunk.key_rope = self._key_rope(seq_len)
                span = self.evictor.observed_rows(r.eviction, n)
                if span is not None:
                    first, num_rows, summed = span
                    rows = torch.zeros(num_rows, seq_len, dtype=torch.float32, device=self.device)
                    chunk.observed_attention = ObservedAttention(rows, first, summed)
                    observed.append((r.request_id, r.eviction, rows))
            chunks.append(chunk)
        meta = AttentionMetadata(
            slot_mapping=tensor(np.concatenate(slot_chunks)),
            decodes=[self._decode_group(decode[a:b], tensor) for a, b in self._decode_runs(decode)],
            prefills=chunks,
            evicting_decode=self._evicting_decode_group(evicting_decode, tensor, observed),
            unrotated_key_rows=tensor(evicting_rows) if evicting_rows else None,
        )
        return ModelInputs(
            input_ids=tensor(np.fromiter((t for chunk in token_chunks for t in chunk), dtype=np.int64)),
            positions=tensor(np.concatenate(position_chunks)),
            meta=meta,
            logits_rows=tensor(logits_rows),
            sampled=sampled,
            observed_attention=observed,
        )

    def _decode_runs(self, decode: list[tuple]) -> list[tuple[int, int]]:
        """[start, end) runs of the decodes that attend together: one run when the pool is read in
        place (nothing is padded), else runs of similar lengths (split_by_length)."""
        if self.kv_cache.format.reads_decodes_in_place:
            return [(0, len(decode))] if decode else []
        return split_by_length([-(-m[2] // self.block_size) for m in decode], self.block_size)

    def _decode_group(self, members: list[tuple], tensor) -> AttentionGroup | None:
        """Pad the decodes' block tables to a common length."""
        if not members:
            return None
        needed = [-(-m[2] // self.block_size) for m in members]
        max_blocks = max(needed)
        block_ids = np.zeros((len(members), max_blocks), dtype=np.int64)
        for i, (m, n) in enumerate(zip(members, needed)):
            block_ids[i, :n] = m[3][:n]
        return AttentionGroup(block_ids=tensor(block_ids.reshape(-1)),
                              seq_lens=tensor([m[2] for m in members]),
                              context_len=max_blocks * self.block_size,
                              max_seq_len=max(m[2] for m in members))

    def _evicting_decode_group(self, members: list[tuple], tensor,
                               observed: list[tuple[str, EvictionConfig, torch.Tensor]]) -> AttentionGroup | None:
        """The decode group of requests under eviction: keys rotated by cache index when gathered,
        and their attention observed (one row each, the decode's query) when a policy asks."""
        group = self._decode_group(members, tensor)
        if group is None:
            return None
        group.key_rope = self._key_rope(group.context_len)
        scored = [(i, m[4]) for i, m in enumerate(members) if self.evictor.observed_rows(m[4].eviction, 1)]
        if scored:
            group.observed_attention = torch.zeros(len(members), group.context_len, dtype=torch.float32,
                                                   device=self.device)
            observed.extend((r.request_id, r.eviction, group.observed_attention[i: i + 1, : members[i][2]])
                            for i, r in scored)
        return group

    def _key_rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [length, head_dim] of positions 0..length-1, as
        positions.rope_gathered_keys takes them. Past the table's end (a padded block beyond
        max-model-len) the last row repeats: those keys are masked anyway."""
        cos, signed_sin = self.model.rope.cos, self.model.rope.signed_sin
        index = torch.arange(length, device=cos.device).clamp_(max=cos.shape[0] - 1)
        return cos[index], signed_sin[index]

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        logits = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, inputs.logits_rows)
        for request_id, config, attention in inputs.observed_attention:
            self.evictor.observe(request_id, config, attention)
        return logits

    def execute(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]]
                ) -> tuple[list[ScheduledRequest], SampleResult]:
        inputs = self.prepare(scheduled, block_tables)
        logits = self.forward(inputs)
        if not inputs.sampled:
            return [], SampleResult([], [])
        return inputs.sampled, self.sampler(logits, [item.request for item in inputs.sampled])
