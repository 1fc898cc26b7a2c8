"""How close decode runs to the machine's limits, measured in the same process:

- matmul peak: the best FLOP/s of a large square `torch.mm` in the model dtype;
- memory bandwidth: the best of a large tensor copy (bytes read + bytes written per second);
- decode FLOP/s at N concurrent sequences: 2 x (matmul parameters, lm_head included) per token
  plus attention (QK^T and PV: 4 x heads x head_dim x context per token per layer), divided by
  the wall time of pure-decode steps;
- single-stream decode against the weight-bandwidth ceiling: every decode step streams all
  matmul weights once, so tokens/s cannot exceed bandwidth / weight bytes per token.

Single-stream kvserve and HF alternate over a few rounds and the kvserve/HF ratio is the median
of the rounds' ratios: one measurement lasts seconds, short enough for a neighbour's burst on
a shared machine to move it a lot, and a burst then hits one round, not the result.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from kvserve.bench.hf_backend import HFGenerator, sync
from kvserve.model.config import ModelConfig
from kvserve.sampling_params import SamplingParams


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters a token multiplies through: every layer's projections and the lm_head (the
    embedding lookup is a gather, not a matmul; a tied lm_head still costs its matmul)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * d * h
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp) + cfg.vocab_size * h


def decode_flops(cfg: ModelConfig, context_len: int) -> float:
    """FLOPs of one decode token that attends to `context_len` positions."""
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context_len
    return 2.0 * matmul_params(cfg) + attention


def measure_matmul_peak(dtype: torch.dtype, device: torch.device, n: int | None = None, reps: int = 8) -> float:
    """Best FLOP/s of an n x n x n matmul (n = 2048 on CPU, 8192 on GPUs)."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best


def measure_memory_bandwidth(device: torch.device, nbytes: int = 256 * 2 ** 20, reps: int = 8) -> float:
    """Best bytes/s of copying `nbytes` (counted as nbytes read + nbytes written). On CUDA at least
    1 GiB, timed by CUDA events: at HBM speeds a 256 MiB copy is short enough that a launch and a
    synchronisation timed from the host would count for a visible share of it."""
    cuda = device.type == "cuda"
    if cuda:  # a third of what is free at most: the engine (and HF's model) hold the rest
        nbytes = max(nbytes, min(2 ** 30, torch.cuda.mem_get_info(device)[0] // 3))
    nbytes -= nbytes % 4
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
            continue
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * nbytes / best


@dataclass
class DecodeRun:
    concurrency: int
    tokens: int
    seconds: float
    flops: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds


def random_prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Ids from the middle of the vocabulary: ordinary tokens, not control tokens at either end.
    return rng.integers(vocab_size // 8, vocab_size // 2, size=(n, length)).tolist()


def kvserve_decode(llm: Any, concurrency: int, prompt_len: int, steps: int, seed: int = 0) -> DecodeRun:
    """Time the pure decode steps of `concurrency` sequences (each asks for `steps` + 1 tokens) in
    kvserve's engine: from the step after every sequence has its first token (prefill steps are not
    timed) to the step that finishes the first of them. Chunked prefill admits a large batch over
    several steps, so they finish over several steps too: that tail runs fewer than
    `concurrency` sequences and is not timed either. Where the sequences never all decode at once
    (fewer --max-num-seqs than sequences, or a prefill budget that admits them more slowly than
    they finish), every step after the last first token is timed instead."""
    engine = llm.engine
    cfg = engine.model_config
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts(cfg.vocab_size, concurrency, prompt_len, seed)]
    produced = dict.fromkeys(ids, 0)
    full, after_prefill = DecodeRun(concurrency, 0, 0.0, 0.0), DecodeRun(concurrency, 0, 0.0, 0.0)
    while engine.has_unfinished_requests():
        started = all(produced[i] >= 1 for i in ids)
        every_one = started and all(produced[i] <= steps for i in ids)
        before = dict(produced)
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        for out in outputs:
            produced[out.request_id] = len(out.outputs[0].token_ids)
        if not started:
            continue
        new = [produced[rid] - before[rid] for rid in ids]
        # the token fed this step sits at prompt_len + before - 1 and sees prompt_len + before positions
        flops = sum(n * decode_flops(cfg, prompt_len + before[rid]) for n, rid in zip(new, ids))
        for run in (full, after_prefill) if every_one else (after_prefill,):
            run.seconds += elapsed
            run.flops += flops
            run.tokens += sum(new)
    return full if full.tokens else after_prefill


def hf_single_stream(generator: HFGenerator, vocab_size: int, prompt_len: int, steps: int, seed: int = 0) -> float:
    """HF decode tokens/s at batch 1: (time for 1 + steps tokens - time for 1 token) / steps,
    which removes the prefill."""
    prompt = random_prompts(vocab_size, 1, prompt_len, seed)
    generator.generate_batch(prompt, 2)  # warm-up

    def timed(n: int) -> float:
        start = time.perf_counter()
        generator.generate_batch(prompt, n)
        return time.perf_counter() - start

    return steps / max(timed(1 + steps) - timed(1), 1e-9)


@dataclass
class EfficiencyReport:
    dtype: str
    matmul_peak_flops: float
    memory_bandwidth: float
    weight_bytes_per_token: int
    single_stream_kvserve: float  # tokens/s, median of the rounds
    single_stream_hf: float | None
    single_stream_ratio: float | None  # median over rounds of kvserve / HF measured side by side
    single_stream_rounds: list[tuple[float, float | None]]  # (kvserve, HF) tokens/s of each round
    concurrent: list[dict[str, float]]  # concurrency, tokens_per_s, flops_per_s, share_of_peak

    @property
    def bandwidth_ceiling(self) -> float:
        return self.memory_bandwidth / self.weight_bytes_per_token

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bandwidth_ceiling_tokens_per_s": self.bandwidth_ceiling}

    def format(self) -> str:
        lines = [f"Matmul peak: {self.matmul_peak_flops / 1e9:.1f} GFLOP/s ({self.dtype} torch.mm); "
                 f"memory bandwidth: {self.memory_bandwidth / 1e9:.1f} GB/s (copy)"]
        single = f"Single-stream decode: kvserve {self.single_stream_kvserve:.1f} tok/s"
        if self.single_stream_ratio:
            single += (f", hf {self.single_stream_hf:.1f} tok/s ({self.single_stream_ratio:.2f}x, median of "
                       f"{len(self.single_stream_rounds)} side-by-side rounds)")
        lines.append(single)
        lines.append(f"  weight-bandwidth ceiling {self.bandwidth_ceiling:.1f} tok/s "
                     f"({self.weight_bytes_per_token / 1e6:.1f} MB of weights per token): kvserve at "
                     f"{self.single_stream_kvserve / self.bandwidth_ceiling:.1%}")
        for c in self.concurrent:
            lines.append(f"Decode at {int(c['concurrency'])} concurrent: {c['tokens_per_s']:.1f} tok/s, "
                         f"{c['flops_per_s'] / 1e9:.1f} GFLOP/s = {c['share_of_peak']:.1%} of matmul peak")
        return "\n".join(lines)


def efficiency_report(llm: Any, hf: HFGenerator | None, concurrencies: tuple[int, ...] = (32, 128),
                      prompt_len: int = 128, steps: int = 64, seed: int = 0, rounds: int = 3) -> EfficiencyReport:
    engine = llm.engine
    cfg, dtype, device = engine.model_config, engine.dtype, engine.device
    peak = measure_matmul_peak(dtype, device)
    bandwidth = measure_memory_bandwidth(device)
    kvserve_decode(llm, 1, prompt_len, 4, seed)  # warm-up
    single_rounds = [(kvserve_decode(llm, 1, prompt_len, steps, seed + 1).tokens_per_s,
                      hf_single_stream(hf, cfg.vocab_size, prompt_len, steps, seed + 1) if hf is not None else None)
                     for _ in range(rounds)]
    single = float(np.median([k for k, _ in single_rounds]))
    single_hf = float(np.median([h for _, h in single_rounds])) if hf is not None else None
    single_ratio = float(np.median([k / h for k, h in single_rounds])) if hf is not None else None
    concurrent = []
    for n in concurrencies:
        run = kvserve_decode(llm, n, prompt_len, steps, seed + 2 + n)
        concurrent.append({"concurrency": n, "tokens_per_s": run.tokens_per_s, "flops_per_s": run.flops_per_s,
                           "share_of_peak": run.flops_per_s / peak})
    element = torch.tensor([], dtype=dtype).element_size()
    return EfficiencyReport(str(dtype).removeprefix("torch."), peak, bandwidth, matmul_params(cfg) * element,
                            single, single_hf, single_ratio, single_rounds, concurrent)
