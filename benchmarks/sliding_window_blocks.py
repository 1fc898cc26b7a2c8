"""Sliding-window models' blocks back to the pool (KVCacheManager, vLLM's sliding-window manager):
the same workload on the same pool with the release on and off. A random Mistral-shaped model
(every layer windowed, `--window` tokens) decodes `--num-prompts` requests of `--input-len` +
`--output-len` tokens at once on a pool that holds `--pool-sequences` whole sequences. Without the
release the pool runs that many at a time and preempts; with it each sequence holds about the
window and one step's tokens. Reports tokens/s, preemptions, the most requests running at once
and the most blocks in use (medians over rounds, the two modes interleaved).

    python benchmarks/sliding_window_blocks.py [--num-prompts 16] [--window 256] [--rounds 3]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--pool-sequences", type=int, default=4, help="whole sequences the pool holds")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from tiny_models import build_tiny_model

    from kvserve.engine.args import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.sampling_params import SamplingParams

    seq_len = args.input_len + args.output_len
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp), "mistral", hidden_size=128, intermediate_size=256,
                                     sliding_window=args.window, max_position_embeddings=seq_len))
        # 2 layers x 2 KV heads x head_dim 32 x K and V x float32: 1,024 bytes a token
        budget = args.pool_sequences * seq_len * 1024

        def engine(release: bool) -> LLMEngine:
            built = LLMEngine(EngineArgs(model=model, dtype="float32", kv_cache_memory=budget, max_model_len=seq_len,
                                         max_num_seqs=args.num_prompts, max_num_batched_tokens=512,
                                         enable_prefix_caching=False))
            assert built.kv_manager.window == args.window
            if not release:
                built.kv_manager.window = None  # every block kept, as before the release
            return built

        engines = {"release on": engine(True), "release off": engine(False)}
        print(f"pool: {engines['release on'].num_blocks} blocks of 16 ({args.pool_sequences} sequences of "
              f"{seq_len:,} tokens); {args.num_prompts} requests of {args.input_len} + {args.output_len} tokens, "
              f"window {args.window}", flush=True)
        vocab = engines["release on"].model_config.vocab_size
        results: dict[str, list[tuple[float, int, int, int]]] = {name: [] for name in engines}
        for round_ in range(args.rounds):
            for name, core in engines.items():
                rng = random.Random(round_)
                params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
                for _ in range(args.num_prompts):
                    core.add_request({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]},
                                     params)
                preempted = core.scheduler.num_preemptions
                generated, most_running, most_blocks = 0, 0, 0
                start = time.perf_counter()
                while core.has_unfinished_requests():
                    for output in core.step():
                        if output.finished:
                            generated += len(output.outputs[0].token_ids)
                    most_running = max(most_running, len(core.scheduler.running))
                    most_blocks = max(most_blocks, core.num_blocks - core.num_free_blocks)
                seconds = time.perf_counter() - start
                results[name].append((generated / seconds, core.scheduler.num_preemptions - preempted,
                                      most_running, most_blocks))
                print(f"round {round_ + 1} {name}: {generated / seconds:,.0f} tok/s, "
                      f"{results[name][-1][1]} preemptions, {most_running} running at most, "
                      f"{most_blocks} blocks in use at most", flush=True)
        medians = {name: [statistics.median(r[i] for r in rows) for i in range(4)] for name, rows in results.items()}
        for name, (rate, preemptions, running, blocks) in medians.items():
            print(f"median {name}: {rate:,.0f} tok/s, {preemptions:.0f} preemptions, {running:.0f} running at "
                  f"most, {blocks:.0f} blocks at most")
        print(f"throughput ratio on/off: {medians['release on'][0] / medians['release off'][0]:.2f}x")


if __name__ == "__main__":
    main()
