"""The engine's own host work per generated token: `LLMEngine.step()` in a loop, no server, on a
model with next to no compute (a random Llama of 1 layer, hidden 64), so that what is timed is
the Python around the model: scheduling, packing the step, sampling, detokenization, outputs.
This is the part of a step a GPU does not take off the host (BENCHMARKS.md, "The served path's
host ceiling"). Every request decodes `--output-len` tokens (EOS ignored), `--num-prompts` at once,
and is reported every step as a streaming server's would be (not final-only).

`--graph-path` sends the decode steps down the CUDA graphs' path (`DecodeGraphs.run`: the
persistent buffers filled from the host, the device block tables updated) with the replay itself
stubbed out (zero hidden states): the host work a CUDA decode step does around its graph, timed
on CPU. `--async-scheduling` is the engine option of that name.

    python benchmarks/host_overhead.py [--num-prompts 256] [--input-len 16] [--output-len 256] [--rounds 5]
    python benchmarks/host_overhead.py --graph-path [--async-scheduling]
    PYTHONPATH=/path/to/other/checkout python benchmarks/host_overhead.py   # the same on another revision
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
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", help="a checkpoint directory (default: the near-zero model, built in a temp dir)")
    parser.add_argument("--graph-path", action="store_true", help="decodes through the CUDA graphs' host path, "
                        "the replay stubbed out")
    parser.add_argument("--async-scheduling", action="store_true")
    args = parser.parse_args()

    from kvserve.engine.args import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tiny_models import build_tiny_model

            model = str(build_tiny_model(Path(tmp), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         max_position_embeddings=2048))
        engine = LLMEngine(EngineArgs(model=model, max_num_seqs=args.num_prompts, kv_cache_memory="1GiB",
                                      max_num_batched_tokens=8192, async_scheduling=args.async_scheduling))
        if args.graph_path:
            stub_graph_replay(engine, args.num_prompts)
        vocab = engine.model_config.vocab_size
        rng = random.Random(0)

        def run(num_prompts: int, output_len: int) -> tuple[int, float]:
            params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
            for _ in range(num_prompts):
                prompt = [rng.randrange(3, vocab) for _ in range(args.input_len)]
                engine.add_request({"prompt_token_ids": prompt}, params)
            generated, start = 0, time.perf_counter()
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        generated += len(output.outputs[0].token_ids)
            return generated, time.perf_counter() - start

        run(min(64, args.num_prompts), 32)  # warm-up
        rates = []
        for _ in range(args.rounds):
            generated, seconds = run(args.num_prompts, args.output_len)
            rates.append(generated / seconds)
            print(f"{generated} tokens in {seconds:.3f} s: {rates[-1]:,.0f} tok/s", flush=True)
        median = statistics.median(rates)
        print(f"median {median:,.0f} tok/s = {1e6 / median:.1f} us of host time per generated token "
              f"({args.num_prompts} at once, {args.input_len} in / {args.output_len} out)")


def stub_graph_replay(engine, max_batch: int) -> None:
    """Give the runner CUDA graphs' decode path on CPU, each replay replaced by zero hidden states."""
    import torch

    from kvserve.engine.decode_graphs import DecodeGraphs

    runner = engine.runner
    graphs = DecodeGraphs(engine.model, engine.kv_cache, runner.backend, max_batch, engine.max_model_len)
    hidden = torch.zeros(graphs.max_batch, engine.model_config.hidden_size, dtype=engine.dtype)
    graphs._forward = lambda size: hidden[:size]
    runner.graphs = graphs


if __name__ == "__main__":
    main()
