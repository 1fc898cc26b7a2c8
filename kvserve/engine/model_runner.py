"""Turns the scheduler's plain-data decision into tensors, runs the model, samples.

Input preparation is numpy over each request's token range; the forward pass itself sees one
packed batch of all scheduled tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.cache.kv_cache import KVCache
from kvserve.engine.sampler import SampleResult, Sampler
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.model.attention import AttentionGroup, AttentionMetadata, PrefillChunk
from kvserve.model.llama import LlamaForCausalLM


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    sampled: list[ScheduledRequest]  # requests that get a token this step, in logits-row order


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.device = device
        self.sampler = Sampler(model.config.vocab_size, device)

    def prepare(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]],
                all_logits: bool = False) -> ModelInputs:
        """Pack the step's tokens. `all_logits` asks for logits at every position (scoring)."""
        bs = self.block_size
        # Decodes first, then prefill chunks: each attention group then owns one run of rows.
        scheduled = sorted(scheduled, key=lambda item: item.num_new_tokens > 1)
        token_chunks, position_chunks, slot_chunks = [], [], []
        decode, prefill = [], []
        logits_rows, sampled = [], []
        offset = 0
        for item in scheduled:
            r, n = item.request, item.num_new_tokens
            start = r.num_computed_tokens
            positions = np.arange(start, start + n)
            table = np.asarray(block_tables[r.request_id], dtype=np.int64)
            token_chunks.append(r.token_ids[start:start + n])
            position_chunks.append(positions)
            slot_chunks.append(table[positions // bs] * bs + positions % bs)
            (decode if n == 1 else prefill).append((offset, n, start + n, table))
            if all_logits:
                logits_rows.extend(range(offset, offset + n))
            elif item.samples:
                logits_rows.append(offset + n - 1)
                sampled.append(item)
            offset += n

        def tensor(array, dtype=torch.long) -> torch.Tensor:
            return torch.as_tensor(array, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=tensor(np.concatenate(slot_chunks)),
            decode=self._decode_group(decode, tensor),
            prefills=[PrefillChunk(offset, n, seq_len, tensor(table)) for offset, n, seq_len, table in prefill],
        )
        return ModelInputs(
            input_ids=tensor(np.fromiter((t for chunk in token_chunks for t in chunk), dtype=np.int64)),
            positions=tensor(np.concatenate(position_chunks)),
            meta=meta,
            logits_rows=tensor(logits_rows),
            sampled=sampled,
        )

    def _decode_group(self, members: list[tuple[int, int, int, np.ndarray]], tensor) -> AttentionGroup | None:
        """Pad the decodes' block tables to a common length."""
        if not members:
            return None
        max_blocks = max(len(table) for *_, table in members)
        block_ids = np.zeros((len(members), max_blocks), dtype=np.int64)
        for i, (*_, table) in enumerate(members):
            block_ids[i, : len(table)] = table
        return AttentionGroup(block_ids=tensor(block_ids.reshape(-1)),
                              seq_lens=tensor([seq_len for _, _, seq_len, _ in members]),
                              context_len=max_blocks * self.block_size)

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, inputs.logits_rows)

    def execute(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]]
                ) -> tuple[list[ScheduledRequest], SampleResult]:
        inputs = self.prepare(scheduled, block_tables)
        logits = self.forward(inputs)
        if not inputs.sampled:
            return [], SampleResult([], [])
        return inputs.sampled, self.sampler(logits, [item.request for item in inputs.sampled])
