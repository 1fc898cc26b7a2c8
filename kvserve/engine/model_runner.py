"""Turns the scheduler's plain-data decision into tensors, runs the model, samples.

Input preparation is numpy over each request's token range: token ids, positions, pool slots and
each sequence's share of the packed batch, from which the attention backend builds its metadata.
The forward pass sees one packed batch of all scheduled tokens.

A request under KV eviction (kvserve/cache/eviction) takes positions from its cache index
(`num_computed_tokens - num_evicted_tokens`), stores keys before RoPE and attends in groups of
its own; the attention rows its policy observes are handed to the evictor after the forward pass.

A request asking for prompt logprobs also has the final hidden state of every prompt position
in its chunk kept (except the last prompt position, which is sampled); the LM head then scores
the next prompt token from them a slice of rows at a time (kvserve/engine/logprobs.py).

With decode graphs (CUDA, kvserve/engine/decode_graphs.py), a step of plain decodes only goes
through them instead: the same tokens, positions and slots, replayed rather than launched.

A decode carrying speculative drafts (speculative.py) is packed as a chunk of its last token and
its drafts, and sampled at every one of those positions: the sampler sees one row per position,
and `wait` keeps the drafts the samples confirm.

A step is launched (`launch`: inputs and forward pass queued on the device), sampled (`sample`:
queued too) and then waited for (`wait`: the sampled ids reach the host). Under async scheduling
the engine launches the next step's forward pass before waiting for this one; a decode whose
input token this one sampled reads it from the device (`InFlightStep.tokens`), filled into its
row of the inputs by one indexed copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.cache.eviction.config import EvictionConfig
from kvserve.cache.eviction.evictor import Evictor
from kvserve.cache.eviction.moves import move_tokens
from kvserve.cache.kv_cache import KVCache
from kvserve.engine.decode_graphs import DecodeGraphs, GraphStep
from kvserve.engine.logprobs import TokenLogprobs, prompt_token_logprobs
from kvserve.engine.parallel.executor import TensorParallelExecutor
from kvserve.engine.request import Request
from kvserve.engine.sampler import LogprobsOnDevice, SampleResult, Sampler
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.engine.speculative import DraftRow, accept_drafts
from kvserve.model.attention import AttentionBackend, AttentionMetadata, StepSequence, packing_order
from kvserve.model.llama import LlamaForCausalLM
from kvserve.transfers import host_to_device


def sampled_rows(sampled: list[ScheduledRequest]) -> list[Request | DraftRow]:
    """The request of each logits row: one row per sampled request, one more per draft (the
    request with the drafts before that row appended)."""
    if not any(item.draft_token_ids for item in sampled):
        return [item.request for item in sampled]
    return [DraftRow(item.request, list(item.draft_token_ids[:j])) if j else item.request
            for item in sampled for j in range(1 + len(item.draft_token_ids))]


def pool_slot(block_table, position, block_size: int):
    """The pool slot of cache position(s) `position` (an int, or an array with `block_table` one)."""
    return block_table[position // block_size] * block_size + position % block_size


@dataclass
class PromptRows:
    """Prompt positions [start, start + len(targets)) of `request` in this step, whose next tokens
    (`targets`) get prompt logprobs; `first_row` is the first one's row in the packed batch."""

    request: Request
    start: int
    first_row: int
    targets: list[int]


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs of `request`'s prompt tokens [first_token, first_token + len(targets))."""

    request: Request
    first_token: int
    targets: list[int]
    logprobs: TokenLogprobs


@dataclass
class StepResult:
    sampled: list[ScheduledRequest]  # requests that got a token, in `result`'s order
    result: SampleResult
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)


@dataclass
class LaunchedForward:
    """A forward pass queued on the device; its logits [len(sampled), vocab] wait to be sampled."""

    scheduled: list[ScheduledRequest]
    sampled: list[ScheduledRequest]  # requests that get a token, in logits-row order
    logits: torch.Tensor
    prompt_logprobs: list[PromptLogprobsChunk]


@dataclass
class InFlightStep:
    """A sampled step. Its sampled ids stay on the device for the next step's inputs (`tokens`);
    their copy to the host, and the logprobs', starts when they are sampled, without blocking,
    and `token_list` waits for it."""

    scheduled: list[ScheduledRequest]
    sampled: list[ScheduledRequest]  # requests that get a token, in `tokens`' order
    tokens: torch.Tensor | None  # [len(sampled)] on the device; None when nothing is sampled
    logprobs: LogprobsOnDevice | None
    prompt_logprobs: list[PromptLogprobsChunk]
    _host: dict[str, torch.Tensor] = field(default_factory=dict)
    _copied: torch.cuda.Event | None = None
    _rows: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if self.tokens is None:
            return
        on_device = {"tokens": self.tokens, "logprobs": self.logprobs.packed if self.logprobs else None}
        cuda = self.tokens.device.type == "cuda"
        for name, tensor in on_device.items():
            if tensor is None:
                continue
            self._host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) if cuda else tensor
            if cuda:
                self._host[name].copy_(tensor, non_blocking=True)
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def row(self, request_id: str) -> int:
        """The index of the request's token in `tokens`."""
        if self._rows is None:
            self._rows = {item.request.request_id: i for i, item in enumerate(self.sampled)}
        return self._rows[request_id]

    def token_list(self) -> list[int]:
        if self._copied is not None:
            self._copied.synchronize()
        return self._host["tokens"].tolist()

    def logprob_list(self) -> list:
        """Per sampled request, None or (the token's logprob, its rank, its top alternatives); after
        `token_list`."""
        if self.logprobs is None:
            return [None] * self.tokens.shape[0]
        return self.logprobs.on_host(self._host["logprobs"].numpy())


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
    prompt_rows: list[PromptRows] = field(default_factory=list)
    sequences: list[StepSequence] = field(default_factory=list)  # what the metadata was built from
    # (row, request id) of decodes whose input token is still on the device (async scheduling);
    # their input_ids hold 0 until `ModelRunner.launch` copies the token in.
    pending_rows: list[tuple[int, str]] = field(default_factory=list)


class ModelRunner:
    """`parallel`: under tensor parallelism, rank 0's executor (kvserve/engine/parallel): each
    forward pass and each compaction is sent to the other ranks first, and the attention an
    eviction policy observes is summed over the ranks' heads."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 evictor: Evictor | None = None, parallel: TensorParallelExecutor | None = None):
        self.model = model
        self.parallel = parallel
        self.evictor = evictor
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = backend.device
        self.sampler = Sampler(model.config.vocab_size, self.device)
        self.graphs: DecodeGraphs | None = None  # set by the platform (CUDA graphs), else every step eager

    def prepare(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]],
                all_logits: bool = False) -> ModelInputs:
        """Pack the step's tokens. `all_logits` asks for logits at every position (scoring)."""
        bs = self.kv_cache.spec.block_size
        scheduled = sorted(scheduled, key=lambda item: packing_order(
            item.num_new_tokens == 1, item.request.eviction is not None, item.request.num_computed_tokens,
            bool(item.draft_token_ids)))
        # Decodes (packed first) as plain ints, one array each at the end; prefill chunks as arrays.
        decode_tokens, decode_positions, decode_slots = [], [], []
        token_chunks, position_chunks, slot_chunks, sequences = [], [], [], []
        logits_rows, sampled, prompt_rows, pending_rows = [], [], [], []
        offset = 0
        for item in scheduled:
            r, n = item.request, item.num_new_tokens
            start = r.num_computed_tokens
            cache_start = start - r.num_evicted_tokens  # == start without eviction
            blocks = block_tables[r.request_id]
            table = np.asarray(blocks, dtype=np.int64)
            if n == 1:
                if start < len(r.token_ids):
                    decode_tokens.append(r.token_ids[start])
                else:  # sampled by the step still in flight
                    pending_rows.append((len(decode_tokens), r.request_id))
                    decode_tokens.append(0)
                decode_positions.append(cache_start)
                decode_slots.append(pool_slot(blocks, cache_start, bs))
            else:
                positions = np.arange(cache_start, cache_start + n)
                chunk = r.token_ids[start:start + n]
                if item.draft_token_ids:  # speculative decoding: the drafts follow the last token
                    chunk = [*chunk, *item.draft_token_ids]
                token_chunks.append(np.asarray(chunk, dtype=np.int64))
                position_chunks.append(positions)
                slot_chunks.append(pool_slot(table, positions, bs))
            evicting = r.eviction is not None
            sequences.append(StepSequence(r.request_id, offset, n, cache_start + n, table, bool(item.draft_token_ids),
                                          keys_before_rope=evicting,
                                          observed_rows=self.evictor.observed_rows(r.eviction, n) if evicting else None))
            if all_logits:
                logits_rows.extend(range(offset, offset + n))
            else:
                if item.samples:
                    if item.draft_token_ids:  # sampled at each of its drafts' positions too
                        logits_rows.extend(range(offset + n - 1 - len(item.draft_token_ids), offset + n))
                    else:
                        logits_rows.append(offset + n - 1)
                    sampled.append(item)
                if r.params.prompt_logprobs is not None:
                    # Position p scores prompt token p + 1; the last prompt position is sampled instead.
                    first, end = max(start, r.prompt_logprobs_done), min(start + n, r.num_prompt_tokens - 1)
                    if end > first:
                        prompt_rows.append(PromptRows(r, first, offset + first - start,
                                                      r.token_ids[first + 1:end + 1]))
            offset += n

        def tensor(array, dtype=torch.long) -> torch.Tensor:
            return host_to_device(array, self.device, dtype)

        def packed(decodes: list[int], chunks: list[np.ndarray]) -> np.ndarray:
            return np.concatenate([np.asarray(decodes, dtype=np.int64), *chunks])

        meta = self.backend.build(sequences, tensor(packed(decode_slots, slot_chunks)))
        eviction = {item.request.request_id: item.request.eviction for item in scheduled}
        return ModelInputs(
            input_ids=tensor(packed(decode_tokens, token_chunks)),
            positions=tensor(packed(decode_positions, position_chunks)),
            meta=meta,
            logits_rows=tensor(logits_rows),
            sampled=sampled,
            observed_attention=[(rid, eviction[rid], rows) for rid, rows in meta.observed_attention],
            prompt_rows=prompt_rows,
            sequences=sequences,
            pending_rows=pending_rows,
        )

    def hidden_states(self, inputs: ModelInputs) -> torch.Tensor:
        """The final-normed hidden states [rows, hidden] of `inputs.logits_rows` (what an embedding pools)."""
        if self.parallel is None:
            return self.model.final_hidden(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta,
                                           inputs.logits_rows)
        return self._parallel_hidden(inputs, inputs.logits_rows)

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Float32 logits of `inputs.logits_rows` (prompt rows are not scored)."""
        return self.run(inputs)[0]

    def run(self, inputs: ModelInputs) -> tuple[torch.Tensor, list[PromptLogprobsChunk]]:
        """The forward pass: logits of `inputs.logits_rows`, and the prompt logprobs of
        `inputs.prompt_rows` (each request's `prompt_logprobs_done` advanced past them)."""
        rows = inputs.logits_rows
        if inputs.prompt_rows:
            extra = np.concatenate([np.arange(p.first_row, p.first_row + len(p.targets)) for p in inputs.prompt_rows])
            rows = torch.cat([rows, host_to_device(extra, self.device)])
        if self.parallel is None:
            hidden = self.model.final_hidden(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, rows)
        else:
            hidden = self._parallel_hidden(inputs, rows)
        for request_id, config, attention in inputs.observed_attention:
            self.evictor.observe(request_id, config, attention)
        num_logits = inputs.logits_rows.shape[0]
        logits = self.model.compute_logits(hidden[:num_logits])
        chunks, cursor = [], num_logits
        for p in inputs.prompt_rows:
            n = len(p.targets)
            found = prompt_token_logprobs(hidden[cursor:cursor + n], p.targets, p.request.params.prompt_logprobs,
                                          self.model.compute_logits, self.model.config.vocab_size)
            chunks.append(PromptLogprobsChunk(p.request, p.start + 1, p.targets, found))
            p.request.prompt_logprobs_done = p.start + n
            cursor += n
        return logits, chunks

    def _parallel_hidden(self, inputs: ModelInputs, rows: torch.Tensor) -> torch.Tensor:
        """final_hidden with every rank: the step plan goes out first, then all ranks run the
        forward pass together (any collective failing is fatal: parallel.lost)."""
        parallel = self.parallel
        with parallel.step(inputs.input_ids, inputs.positions, inputs.meta.slot_mapping, inputs.sequences):
            try:
                hidden = self.model.final_hidden(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, rows)
                parallel.groups.sum_observed([rows for _, _, rows in inputs.observed_attention])
            except RuntimeError as exc:
                raise parallel.lost(exc) from exc
        return hidden

    def move_tokens(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Carry out a compaction's token copies on the pool (on every rank's)."""
        if not src_slots:
            return
        if self.parallel is not None:
            self.parallel.send_moves(src_slots, dst_slots)
        move_tokens(self.kv_cache, src_slots, dst_slots)

    def graph_step(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]]) -> GraphStep | None:
        """The step as decode-graph inputs, or None when it is not one a graph replays: a prefill
        chunk, a request under KV eviction or asking prompt logprobs, or too many sequences."""
        if self.graphs is None or self.graphs.size_for(len(scheduled)) is None:
            return None
        step = GraphStep([], [], [], [], [])
        bs = self.kv_cache.spec.block_size
        for item in scheduled:
            r = item.request
            if item.num_new_tokens != 1 or not item.samples or r.eviction is not None or r.params.prompt_logprobs is not None:
                return None
            position = r.num_computed_tokens
            table = block_tables[r.request_id]
            if position < len(r.token_ids):
                step.token_ids.append(r.token_ids[position])
            else:  # sampled by the step still in flight
                step.pending_rows.append((len(step.token_ids), r.request_id))
                step.token_ids.append(0)
            step.request_ids.append(r.request_id)
            step.positions.append(position)
            step.slots.append(pool_slot(table, position, bs))
            step.block_tables.append(table)
        return step

    def execute(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]]) -> StepResult:
        """Run a step and wait for it."""
        return self.wait(self.sample(self.launch(scheduled, block_tables)))

    def launch(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]],
               previous: InFlightStep | None = None) -> LaunchedForward:
        """Queue the step's forward pass on the device. `previous`: the step in flight whose
        sampled tokens some of these decodes take as input (async scheduling)."""
        step = self.graph_step(scheduled, block_tables)
        if step is not None:
            logits = self.graphs.run(step, self._pending_tokens(step.pending_rows, previous))
            return LaunchedForward(scheduled, list(scheduled), logits, [])
        inputs = self.prepare(scheduled, block_tables)
        pending = self._pending_tokens(inputs.pending_rows, previous)
        if pending is not None:
            inputs.input_ids[pending[0]] = pending[1]
        logits, prompt_logprobs = self.run(inputs)
        return LaunchedForward(scheduled, inputs.sampled, logits, prompt_logprobs)

    def sample(self, forward: LaunchedForward) -> InFlightStep:
        """Queue the sampling of a launched forward pass; its tokens start for the host at once.
        Under async scheduling this runs once the step before is reported, so logits processors,
        grammars and penalties see every earlier token."""
        if not forward.sampled:
            return InFlightStep(forward.scheduled, [], None, None, forward.prompt_logprobs)
        tokens, logprobs = self.sampler.sample_on_device(forward.logits, sampled_rows(forward.sampled))
        return InFlightStep(forward.scheduled, forward.sampled, tokens, logprobs, forward.prompt_logprobs)

    def wait(self, step: InFlightStep) -> StepResult:
        """The sampled step's result on the host (the step's one wait for the device)."""
        if not step.sampled:
            return StepResult([], SampleResult([], []), step.prompt_logprobs)
        tokens = step.token_list()
        requests = [item.request for item in step.sampled]
        if len(tokens) > len(requests):  # speculative decoding: keep what the samples confirm
            found = accept_drafts(requests, [item.draft_token_ids for item in step.sampled], tokens,
                                  step.logprob_list())
            self.sampler.advance_grammars(requests, [[*kept, token] for kept, token in zip(found.drafts,
                                                                                           found.token_ids)])
            result = SampleResult(found.token_ids, found.logprobs, found.drafts, found.draft_logprobs)
        else:
            result = self.sampler.finish(requests, tokens, step.logprob_list())
        return StepResult(step.sampled, result, step.prompt_logprobs)

    def _pending_tokens(self, rows: list[tuple[int, str]],
                        previous: InFlightStep | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, their input tokens) on the device, for decodes whose token `previous` sampled."""
        if not rows:
            return None
        index = host_to_device([[row for row, _ in rows], [previous.row(rid) for _, rid in rows]], self.device)
        return index[0], previous.tokens[index[1]]
