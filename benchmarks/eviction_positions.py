"""Positions under KV eviction: keys stored before RoPE (kvserve's choice) vs re-rotating kept keys.

Two measurements on the default model (SmolLM2-135M), each printed as a table:

1. Error. Real keys of a 1,024-token passage of the novel (every layer, stored before RoPE by
   an evicting sequence) are taken to a position 1,024 lower in two ways and compared with the
   exact float32 result: (a) stored once, rotated once when gathered; (b) stored rotated, then
   re-rotated by -16 and stored again 64 times (one eviction event per block of 16 decoded
   tokens, 1,024 / 16 events over a key's life in a 1,024-token window). "Stored" is a round
   trip through the KV format (write + read back, its Hadamard rotation included).
2. Cost of (a). Decode time per token of one sequence whose cache holds ~1,024 tokens: without
   eviction (a 1,024-token prompt, keys stored rotated) and with streaming, budget 1,024 (a
   longer prompt, so it evicts every 16 tokens and rotates its gathered keys in every layer).

    python benchmarks/eviction_positions.py [--part errors|cost] [--json benchmarks/results/eviction-positions.json]

Timings need a quiet machine: on 2 cores, a second process running torch makes both crawl.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvserve.cache.eviction.moves import read_slots
from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVCache, KVCacheSpec
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.eval.runner import DEFAULT_TEXT
from kvserve.model.loader import load_model
from kvserve.model.rope import apply_rotary, inverse_frequencies
from kvserve.sampling_params import SamplingParams

SHIFT, EVENTS = 16, 64


def rotation_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float()[:, None], angles.sin().float()[:, None]


def stored(kv_dtype: str, keys: torch.Tensor) -> torch.Tensor:
    """A round trip of float32 keys [tokens, heads, dim] through a KV format."""
    tokens, heads, dim = keys.shape
    fmt = make_kv_format(kv_dtype, torch.float32)
    cache = KVCache(KVCacheSpec(1, heads, dim, SHIFT), fmt, -(-tokens // SHIFT), keys.device)
    slots = torch.arange(tokens)
    with torch.inference_mode():
        fmt.write(cache.layers[0], keys, torch.zeros_like(keys), slots)
        return read_slots(fmt, cache.layers[0], slots, SHIFT)[0].clone()


def real_keys(engine: LLMEngine, num_tokens: int) -> torch.Tensor:
    """float32 keys before RoPE [layers * tokens, kv_heads, dim] of the novel's opening."""
    ids = engine.tokenizer.encode(DEFAULT_TEXT.read_text())[:num_tokens]
    spec = {"policy": "streaming", "budget": engine.max_model_len}
    request_blocks = []
    record = engine.kv_manager.free
    engine.kv_manager.free = lambda r: (request_blocks.extend(engine.kv_manager.block_ids(r.request_id)), record(r))
    list(engine.score_chunks(ids, 512, kv_eviction=spec))
    engine.kv_manager.free = record
    blocks = torch.tensor(request_blocks)
    with torch.inference_mode():
        keys = [engine.kv_format.gather(pool, blocks, 1, torch.float32)[0][:, 0, :num_tokens].transpose(0, 1)
                for pool in engine.kv_cache.layers]
        return torch.cat(keys).clone()


def error_table(engine: LLMEngine, dtypes: list[str]) -> dict:
    keys = real_keys(engine, 1024)
    inv_freq, _ = inverse_frequencies(engine.model_config)
    start = torch.arange(1024, 2048).repeat(engine.model_config.num_layers)  # positions before the shift
    final = start - SHIFT * EVENTS
    exact = apply_rotary(keys, *rotation_tables(inv_freq, final))
    step_cos, step_sin = rotation_tables(inv_freq, torch.full_like(start, -SHIFT))
    results = {}
    for kv_dtype in dtypes:
        once = apply_rotary(stored(kv_dtype, keys), *rotation_tables(inv_freq, final))  # (a)
        rerotated = stored(kv_dtype, apply_rotary(keys, *rotation_tables(inv_freq, start)))  # (b)
        for _ in range(EVENTS):
            rerotated = stored(kv_dtype, apply_rotary(rerotated, step_cos, step_sin))
        results[kv_dtype] = {name: float((value - exact).norm() / exact.norm())
                             for name, value in (("before_rope", once), ("rerotated", rerotated))}
    return results


def cost_table(loaded, tokens: int) -> dict:
    """Decode ms/token of a plain and a streaming sequence at ~1,024 cached tokens. Each has its
    own engine (one checkpoint load); their steps alternate, so both see the same background
    load, and medians are reported next to means."""
    engines = {name: LLMEngine(EngineArgs(kv_cache_memory="256MiB", max_num_batched_tokens=1024),
                               loaded_model=loaded) for name in ("no_eviction", "streaming_1024")}
    ids = engines["streaming_1024"].tokenizer.encode(DEFAULT_TEXT.read_text())
    params = {"no_eviction": SamplingParams(temperature=0, max_tokens=tokens + 8, ignore_eos=True),
              "streaming_1024": SamplingParams(temperature=0, max_tokens=tokens + 8, ignore_eos=True,
                                               kv_eviction={"policy": "streaming", "budget": 1024})}
    prompts = {"no_eviction": ids[:1024 - tokens // 2], "streaming_1024": ids[:4096]}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for name, engine in engines.items():
        engine.add_request(prompts[name], params[name])
        while engine.scheduler.running == [] or engine.scheduler.running[0].num_output_tokens < 8:
            engine.step()  # prefill and a few warm-up decodes
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, engine in engines.items():
            if engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                times[name].append(1000 * (time.perf_counter() - start))
    result = {}
    for name, values in times.items():
        result[f"{name}_ms_per_token"] = statistics.mean(values)
        result[f"{name}_median_ms"] = statistics.median(values)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-dtypes", default="bfloat16,fp8,int8,int4")
    parser.add_argument("--decode-tokens", type=int, default=200)
    parser.add_argument("--part", choices=("errors", "cost", "all"), default="all")
    parser.add_argument("--json", default=None, help="write (or update) the results here")
    args = parser.parse_args()
    results = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else {}
    loaded = load_model(None)
    if args.part in ("errors", "all"):
        engine = LLMEngine(EngineArgs(kv_cache_memory="512MiB", max_num_batched_tokens=1024), loaded_model=loaded)
        errors = results["errors"] = error_table(engine, args.kv_cache_dtypes.split(","))
        print(f"relative RMS error of keys moved {SHIFT * EVENTS} positions down "
              f"({engine.model_config.num_layers} layers x 1,024 tokens of the novel):")
        print(f"{'kv dtype':<10} {'before RoPE (a)':>16} {f'{EVENTS}x re-rotated (b)':>20}")
        for kv_dtype, row in errors.items():
            print(f"{kv_dtype:<10} {100 * row['before_rope']:>15.2f}% {100 * row['rerotated']:>19.2f}%")
        del engine
    if args.part in ("cost", "all"):
        cost = results["cost"] = cost_table(loaded, args.decode_tokens)
        print(f"decode, one sequence, ~1,024 cached tokens ({args.decode_tokens} tokens, default dtype), "
              f"mean / median ms per token: no eviction {cost['no_eviction_ms_per_token']:.1f} / "
              f"{cost['no_eviction_median_ms']:.1f}; streaming, budget 1,024 (keys rotated when gathered, an "
              f"eviction every 16 tokens) {cost['streaming_1024_ms_per_token']:.1f} / "
              f"{cost['streaming_1024_median_ms']:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
