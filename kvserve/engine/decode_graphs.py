"""Decode steps replayed from CUDA graphs (vLLM's design, kvserve's code).

A decode step of a 1B model on a big GPU is mostly launch gaps: hundreds of small kernels with
Python between them. Here a step whose every sequence decodes one token (no prefill chunk, no KV
eviction, no prompt logprobs) and that holds at most `max_batch` sequences is padded to the next
captured batch size, its inputs copied into persistent device buffers, and the graph captured for
that size replays the decoder stack (every layer and the final norm) as one launch; the LM head
then runs on the real rows only, so the graphs keep hidden states ([size, hidden]), not logits
([size, vocab], which for every captured size at once would fill gigabytes of the graphs' pool).

- Persistent inputs: token ids, positions, pool slots, sequence lengths and each sequence's row
  of the device-resident block tables (engine/device_block_tables.py: a step uploads only the
  entries its sequences' tables gained), the rows of one device matrix sized for `max_batch`,
  filled from one pinned host matrix with one non-blocking copy a step. The graph gathers
  the step's tables from their rows itself. The step's one device-to-host copy stays the sampled
  token ids (the sampler's); the next step rewrites the pinned buffers only once the copies out
  of them are done (an event).
- Padding rows decode token 0 at position 0 into slot 0, over a context of one token whose block
  table (row 0 of the device tables, all zeros) holds block 0: the pool's null block, never
  handed out, so they write and read nothing a request owns.
- The attention backend builds fixed-shape metadata over these buffers (`graph_metadata`): the
  Triton decode kernel with as many splits as the longest context allowed needs (at most 64); a
  split past a sequence's end contributes nothing, so its result is the eager kernel's.
- Graphs are captured largest first into one memory pool; the capture time and the pool's size are
  logged. engine/pool_sizing.py sets that pool aside beforehand by running the largest graph's
  forward eagerly on a scratch pool (`DecodeGraphs.profile`, from `profile_cuda_budget`).

Until `capture()` has run (never, without CUDA), `run` executes the same padded step eagerly over
the same buffers: tests run it on CPU under Triton's interpreter (everything but the capture itself).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvserve.cache.kv_cache import KVCache
from kvserve.engine.device_block_tables import DeviceBlockTables
from kvserve.model.attention import AttentionBackend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.units import GiB

logger = logging.getLogger("kvserve")

DEFAULT_MAX_CAPTURE_SIZE = 512  # vLLM's default largest captured batch


def graphs_unavailable(args, backend: AttentionBackend) -> str | None:
    """Why a CUDA engine with these options runs every step eagerly, or None."""
    if args.enforce_eager:
        return "--enforce-eager"
    if args.tensor_parallel_size > 1:
        return "tensor parallelism (its all-reduces are not captured yet)"
    if args.kv_cache_dtype == "int4_kivi":
        return "int4_kivi's key writes decide on the host how a block's channel ranges grow"
    if not backend.captures_decodes:
        return f"the {backend.name} attention backend sizes its decode metadata on the host"
    return None


def max_capture_size(args) -> int:
    return min(args.max_num_seqs, args.max_cudagraph_capture_size or DEFAULT_MAX_CAPTURE_SIZE)


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, up to `max_batch` (included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


@dataclass
class GraphStep:
    """One decode step's inputs, per sequence: plain numbers, its request id and block table."""

    request_ids: list[str]
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]
    # (row, request id) of sequences whose input token the step in flight sampled (async scheduling)
    pending_rows: list[tuple[int, str]] = field(default_factory=list)


class DecodeGraphs:
    FIELDS = ("input_ids", "positions", "slots", "seq_lens", "table_rows")

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend, max_batch: int,
                 max_model_len: int):
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.device = backend.device
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.block_size = kv_cache.spec.block_size
        self.width = -(-max_model_len // self.block_size)
        self.max_context = self.width * self.block_size
        long = dict(dtype=torch.long, device=self.device)
        # One row per input, so that a step's inputs go to the device in one copy.
        self.inputs = torch.zeros(len(self.FIELDS), self.max_batch, **long)
        self.buffers = {name: self.inputs[i] for i, name in enumerate(self.FIELDS)}
        self.tables = DeviceBlockTables(self.max_batch, self.width, self.device)
        self.rows = torch.arange(self.max_batch, **long)
        # Host side: the same matrix pinned, written in numpy, copied without blocking.
        self.staging = torch.zeros(self.inputs.shape, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.host_matrix = self.staging.numpy()
        self.host = dict(zip(self.FIELDS, self.host_matrix))
        self.copied: torch.cuda.Event | None = None  # when the last step's copy out of `staging` ended
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each graph's output

    def size_for(self, batch: int) -> int | None:
        """The captured size a batch of `batch` decodes pads to, or None (too large)."""
        return next((s for s in self.sizes if s >= batch), None)

    # ------------------------------------------------------------------ the padded forward
    def _forward(self, size: int) -> torch.Tensor:
        """The final-normed hidden states [size, hidden] of the padded step in the buffers."""
        b = {name: buffer[:size] for name, buffer in self.buffers.items()}
        block_tables = self.tables.table[b["table_rows"]]
        meta = self.backend.graph_metadata(b["slots"], block_tables, b["seq_lens"], self.max_context)
        return self.model.final_hidden(b["input_ids"], b["positions"], self.kv_cache, meta, self.rows[:size])

    def kept_outputs_bytes(self) -> int:
        """What the graphs' pool holds beyond the largest graph's forward: every smaller graph's
        output ([size, hidden] each), kept for its replays."""
        weight = self.model.embed_tokens.weight
        return sum(self.sizes[:-1]) * self.model.config.hidden_size * weight.element_size()

    @torch.inference_mode()
    def profile(self) -> None:
        """The largest graph's forward, run eagerly over an all-padding step (what a capture
        allocates, for the profiling pass to measure)."""
        self._fill(GraphStep([], [], [], [], []), self.max_batch)
        self._forward(self.max_batch)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, largest first, sharing one memory pool; logs time and pool size."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self._fill(GraphStep([], [], [], [], []), self.max_batch)  # every row padding: a valid step
        pool = None
        for size in reversed(self.sizes):
            # Warm-up outside the capture, on a side stream as torch's docs ask: Triton compiles its
            # kernels and cuBLAS sets up its workspaces here, not inside the graph.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("CUDA graphs: %d decode batch sizes (1 to %d) captured in %.1f s; their memory pool holds "
                    "%.2f GiB", len(self.sizes), self.max_batch, time.perf_counter() - start, used / GiB)

    # ------------------------------------------------------------------ a step
    def _fill(self, step: GraphStep, size: int) -> None:
        """The step's inputs into the persistent buffers, rows past it padding."""
        batch = len(step.token_ids)
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the pinned matrix
        host = self.host
        self.host_matrix[:, batch:size] = 0
        host["seq_lens"][batch:size] = 1
        host["input_ids"][:batch] = step.token_ids
        host["positions"][:batch] = step.positions
        host["slots"][:batch] = step.slots
        host["seq_lens"][:batch] = host["positions"][:batch] + 1
        host["table_rows"][:batch] = self.tables.rows(step.request_ids, step.block_tables)
        # The whole matrix (5 x max_batch longs) in one contiguous copy; entries past `size` go unread.
        self.inputs.copy_(self.staging, non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()

    @torch.inference_mode()
    def run(self, step: GraphStep, pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Float32 logits [len(step.token_ids), vocab] of the step's sequences. `pending`: (rows,
        tokens) on the device, input tokens not on the host yet (async scheduling)."""
        batch = len(step.token_ids)
        size = self.size_for(batch)
        self._fill(step, size)
        if pending is not None:
            self.buffers["input_ids"][pending[0]] = pending[1]
        if size in self.graphs:
            self.graphs[size].replay()
            hidden = self.hidden[size]
        else:
            hidden = self._forward(size)
        return self.model.compute_logits(hidden[:batch])
