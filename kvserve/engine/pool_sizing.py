"""Start-up, second part: how many KV blocks the pool gets.

A known budget (--kv-cache-memory, or the CPU default preflight.py computed) is divided into
blocks. On CUDA without one, the budget is measured the way vLLM does it: one forward pass of
the largest step through the model runner, with a throw-away pool, and one step sampling as many
rows as a step can, give the peak memory the model, its activations and the sampler need; the
pool gets what is left of --gpu-memory-utilization once that peak, the CUDA graphs' pool, a
decode's scratch and what the profiling added outside torch's allocator are set aside.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.cache.block_pool import leading_block_ids
from kvserve.cache.kv_cache import KVCache, KVCacheSpec, KVFormat
from kvserve.cache.sizing import blocks_for_tokens, blocks_in_budget, bytes_per_block
from kvserve.engine.args import EngineArgs
from kvserve.engine.decode_graphs import DecodeGraphs, graphs_unavailable, max_capture_size
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.preflight import CapacityError, SequenceHold, fit_max_model_len, lowered_max_model_len_warning
from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.model.attention import AttentionBackend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.sampling_params import SamplingParams
from kvserve.units import GiB

logger = logging.getLogger("kvserve")


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int
    max_model_len: int  # lowered from the preflight's when a measured budget holds less


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a CUDA device's memory: the driver's total and free bytes, and what this
    process's torch allocator holds."""

    total: int
    free: int
    reserved: int

    @classmethod
    def read(cls, device: torch.device) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, torch.cuda.memory_reserved(device))

    @property
    def outside_torch(self) -> int:
        """In use, not through torch's allocator: CUDA contexts, kernel modules (Triton's, cuBLAS's),
        other processes."""
        return self.total - self.free - self.reserved

    def outside_torch_grown_since(self, earlier: DeviceMemory) -> int:
        """What came to be used outside torch's allocator since `earlier` (memory given back: 0)."""
        return max(0, self.outside_torch - earlier.outside_torch)


def budget_after_profile(utilization: float, start: DeviceMemory, end: DeviceMemory, peak: int,
                         set_aside: dict[str, int]) -> int:
    """The KV pool's bytes: --gpu-memory-utilization of the device, less the profiled `peak` (weights,
    activations, sampler), the `set_aside` reserves and what grew outside torch's allocator between
    `start` and `end` (vLLM's accounting). Like vLLM, refuses a target larger than what other
    processes and the CUDA context leave at start."""
    target = int(start.total * utilization)
    if start.total - start.outside_torch < target:
        raise CapacityError(
            f"--gpu-memory-utilization {utilization} asks for {target / GiB:.2f} GiB of this GPU's "
            f"{start.total / GiB:.2f} GiB, but other processes and the CUDA context hold "
            f"{start.outside_torch / GiB:.2f} GiB of it; lower --gpu-memory-utilization or free the GPU")
    grown = end.outside_torch_grown_since(start)
    budget = target - peak - sum(set_aside.values()) - grown
    if budget <= 0:
        reserves = {**set_aside, "outside torch": grown}
        kept = ", ".join(f"{name} {size / GiB:.2f} GiB" for name, size in reserves.items())
        raise CapacityError(f"no memory left for the KV cache: the model and activations peak at "
                            f"{peak / GiB:.2f} GiB of a {utilization:.0%} target of {start.total / GiB:.2f} GiB "
                            f"({kept} set aside beside them); raise --gpu-memory-utilization or lower "
                            f"--max-num-batched-tokens")
    return budget


def size_kv_pool(args: EngineArgs, model: LlamaForCausalLM, kv_spec: KVCacheSpec, kv_format: KVFormat,
                 backend: AttentionBackend, max_model_len: int, budget: int | None,
                 hold: SequenceHold = SequenceHold()) -> PoolSize:
    """Blocks for `budget` bytes (None: what the CUDA profiling pass leaves). A measured budget
    is checked here like preflight checks a known one: max-model-len is lowered to fit when the
    user gave none, else too small a budget raises CapacityError. Logs the pool's size."""
    per_block = bytes_per_block(kv_spec, kv_format)
    bs = kv_spec.block_size
    if budget is None:
        budget = profile_cuda_budget(args, model, kv_spec, kv_format, backend, max_model_len)
        fitted = fit_max_model_len(budget, per_block, bs, max_model_len, args.max_model_len is not None, hold)
        if fitted < max_model_len:
            logger.warning(lowered_max_model_len_warning(fitted, max_model_len, budget))
            max_model_len = fitted
    num_blocks = blocks_in_budget(budget, per_block)
    per_token = per_block / bs
    logger.info("Available KV cache memory: %.2f GiB (%s, %.0f bytes per token)",
                num_blocks * per_block / GiB, kv_format.name, per_token)
    logger.info("KV cache size: %s tokens (%d blocks of %d)", f"{num_blocks * bs:,}", num_blocks, bs)
    per_sequence = hold.blocks(max_model_len, bs)
    if per_sequence < blocks_for_tokens(max_model_len, bs):
        logger.info("Maximum concurrency for %s tokens per request: %.2fx (a sequence holds at most %s tokens: "
                    "its sliding window and a step)", f"{max_model_len:,}", num_blocks / per_sequence,
                    f"{per_sequence * bs:,}")
    else:
        logger.info("Maximum concurrency for %s tokens per request: %.2fx", f"{max_model_len:,}",
                    num_blocks * bs / max_model_len)
    return PoolSize(num_blocks, max_model_len)


def widest_sampling_step(args: EngineArgs) -> tuple[list[ScheduledRequest], dict[str, list[int]]]:
    """A step of one-token requests, as many as a step can sample (--max-num-seqs, at most
    --max-num-batched-tokens), each asking for everything the sampler does per row on the device
    (penalties, top-k, top-p, min-p, logprobs): the sampler's peak memory, [rows, vocab] several
    times over, which a one-row profiling step does not reach (vLLM's profile run samples
    --max-num-seqs rows too). They share one block: the pool is thrown away."""
    top_logprobs = 20 if args.max_logprobs < 0 else min(args.max_logprobs, 20)
    params = SamplingParams(max_tokens=1, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=0.5, logprobs=top_logprobs or None)
    rows = min(args.max_num_seqs, args.max_num_batched_tokens)
    requests = [Request(f"profile-sampling-{i}", [0], params) for i in range(rows)]
    block = leading_block_ids(1)
    return [ScheduledRequest(r, 1) for r in requests], {r.request_id: block for r in requests}


def profile_cuda_budget(args: EngineArgs, model: LlamaForCausalLM, kv_spec: KVCacheSpec, kv_format: KVFormat,
                        backend: AttentionBackend, max_model_len: int) -> int:
    """vLLM's recipe: run one forward pass of the largest step with a throw-away pool, and a step
    that samples as many rows as a step can (`widest_sampling_step`), take the peak memory they
    needed, and give the KV pool what is left of the utilisation target.
    With CUDA graphs, the largest graph's forward is run eagerly too (decode_graphs.py: the same
    fixed-shape metadata, the same split buffers): what it allocates is what the graphs' memory
    pool will keep, so it is set aside as well."""
    device = backend.device
    tokens = min(args.max_num_batched_tokens, max_model_len)
    batch = max_capture_size(args) if graphs_unavailable(args, backend) is None else 0
    torch.cuda.empty_cache()
    start = DeviceMemory.read(device)
    scratch = KVCache(kv_spec, kv_format, blocks_for_tokens(tokens, kv_spec.block_size), device)
    torch.cuda.reset_peak_memory_stats(device)
    probe = Request("profile", [0] * tokens, SamplingParams(max_tokens=1))
    runner = ModelRunner(model, scratch, backend)
    runner.execute([ScheduledRequest(probe, tokens)], {"profile": leading_block_ids(scratch.num_blocks)})
    runner.execute(*widest_sampling_step(args))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch.nbytes
    graph_reserve = 0
    if batch:
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        graphs = DecodeGraphs(model, scratch, backend, batch, max_model_len)
        graphs.profile()
        torch.cuda.synchronize(device)
        graph_reserve = torch.cuda.max_memory_allocated(device) - before + graphs.kept_outputs_bytes()
        del graphs  # it holds the scratch pool
        logger.info("CUDA graphs: %.2f GiB set aside for their memory pool (what the %d-sequence graph's "
                    "forward allocates, and the smaller graphs' outputs)", graph_reserve / GiB, batch)
    del scratch, runner
    torch.cuda.empty_cache()
    # An eager decode of up to --max-num-seqs long contexts allocates split partial sums the prefill
    # step above did not. Under --deterministic a prefill's rows all decode: the profiled one's
    # partial sums, at contexts up to its length, are in its peak; a later chunk's, at contexts up to
    # --max-model-len, may take more (up to the launch cap), so they are reserved again, in full.
    rows = max(args.max_num_seqs, tokens if args.deterministic else 0)
    decode_scratch = backend.decode_scratch_bytes(rows, model.config.num_heads, max_model_len)
    end = DeviceMemory.read(device)
    budget = budget_after_profile(args.gpu_memory_utilization, start, end, peak,
                                  {"CUDA graphs": graph_reserve, "decode scratch": decode_scratch})
    logger.info("CUDA memory: weights and activations peak at %.2f GiB; %.2f GiB set aside for a decode's "
                "scratch, %.2f GiB grew outside torch's allocator while profiling", peak / GiB,
                decode_scratch / GiB, end.outside_torch_grown_since(start) / GiB)
    return budget
