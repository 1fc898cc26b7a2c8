"""What structured outputs cost on decode speed: the same 32 concurrent chat requests against one
`kvserve serve`, constrained by a JSON schema and unconstrained, side by side in one run.

The schema ({"items": at least MIN_ITEMS strings}) cannot complete before `--max-tokens`, and both
modes send `ignore_eos`, so every request of both modes generates exactly `--max-tokens` tokens
(checked) and the comparison is per token. Each round runs both modes (order alternating between
rounds); reported per mode: median over rounds of the batch's output tokens/s (all tokens / wall
time from sending to the last byte) and of the median time per output token (TPOT: a stream's
first content to its last, over its tokens after the first).

    flock /tmp/kvserve-heavy.lock python benchmarks/structured_outputs.py [--rounds 3] [--max-tokens 128]
        [--concurrency 32] [-- extra serve flags]

`--steps-profile` instead times, in this process, the grammar work of one decode step for
`--concurrency` rows of the default model's vocabulary (each row at its own place in the schema):
filling the bitmasks, unpacking them, applying them to the logits, and advancing the matchers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_process import ServerProcess  # noqa: E402

MIN_ITEMS = 256
SCHEMA = {"type": "object",
          "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": MIN_ITEMS}},
          "required": ["items"], "additionalProperties": False}
TOPICS = ["fruits", "rivers", "composers", "birds", "programming languages", "cities in Spain", "board games",
          "vegetables", "planets and moons", "painters", "trees", "dog breeds", "capital cities", "spices",
          "musical instruments", "mountains", "cheeses", "poets", "flowers", "sports", "chemical elements",
          "car makers", "fish", "rock bands", "desserts", "islands", "languages", "tools", "insects",
          "famous bridges", "colours", "card games"]


async def one_request(client: httpx.AsyncClient, url: str, model: str, topic: str, max_tokens: int,
                      constrained: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"List as many {topic} as you can, as JSON "
                                                                     f"with the key \"items\"."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "items", "schema": SCHEMA}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    text = ""
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text += choice["delta"]["content"]
    return {"tokens": tokens, "start": start, "first": first, "last": last, "text": text}


async def run_batch(base_url: str, model: str, concurrency: int, max_tokens: int, constrained: bool) -> dict:
    url = f"{base_url}/v1/chat/completions"
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*[one_request(client, url, model, TOPICS[i % len(TOPICS)], max_tokens,
                                                     constrained) for i in range(concurrency)])
        wall = time.perf_counter() - start
    counts = {r["tokens"] for r in results}
    if counts != {max_tokens}:
        raise SystemExit(f"expected {max_tokens} tokens from every request, got {sorted(counts)}")
    if constrained:  # cut by max_tokens: a prefix of the schema's JSON
        assert all(r["text"].startswith('{"items": [') for r in results), results[0]["text"][:80]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in results]
    return {"tokens_per_s": sum(r["tokens"] for r in results) / wall, "tpot_ms": 1000 * statistics.median(tpot),
            "ttft_ms": 1000 * statistics.median(r["first"] - r["start"] for r in results), "wall_s": wall,
            "sample": results[0]["text"][:120]}


def profile_steps(rows: int, steps: int = 60) -> None:
    """Median milliseconds per step of each piece of the grammar work, over `steps` decode steps."""
    import random

    import torch
    from llguidance.torch import fill_next_token_bitmask_par

    from kvserve.engine.structured_output import GrammarCompiler, GrammarMasks
    from kvserve.model.loader import load_model
    from kvserve.sampling_params import StructuredOutputsParams

    loaded = load_model(None)
    vocab = loaded.config.vocab_size
    compiler = GrammarCompiler(loaded.tokenizer, vocab, (loaded.tokenizer.eos_token_id,))
    matchers = [compiler.matcher(StructuredOutputsParams(json=SCHEMA)) for _ in range(rows)]
    words = ["apple", "Danube", "Mozart", "sparrow", "Python", "Seville", "chess", "carrot", "Monet", "oak"]
    texts = []
    for i in range(rows):  # a different valid continuation per row
        rng = random.Random(i)
        texts.append(loaded.tokenizer.encode('{"items": [' + ", ".join(f'"{rng.choice(words)}"' for _ in range(60))))
    masks = GrammarMasks(vocab, torch.device("cpu"))
    logits = torch.randn(rows, vocab)
    timings: dict[str, list[float]] = {"fill": [], "fill + unpack": [], "fill + unpack + apply": [], "advance": []}
    for step in range(steps):
        buffer = masks._buffer_for(rows)
        start = time.perf_counter()
        fill_next_token_bitmask_par(masks._executor, [(m.matcher, i) for i, m in enumerate(matchers)], buffer)
        timings["fill"].append(time.perf_counter() - start)
        start = time.perf_counter()
        masks.banned(matchers)
        timings["fill + unpack"].append(time.perf_counter() - start)
        row_logits = logits.clone()
        start = time.perf_counter()
        masks.apply(row_logits, list(range(rows)), matchers)
        timings["fill + unpack + apply"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            assert m.accept(texts[i][step]) is None
        timings["advance"].append(time.perf_counter() - start)
    print(f"grammar work per decode step, {rows} constrained rows, vocabulary {vocab}, median of {steps} steps:")
    for name, values in timings.items():
        print(f"  {name:>22}: {1000 * statistics.median(values):6.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--json", default=None, help="write the per-round results here")
    parser.add_argument("--steps-profile", action="store_true", help="time the per-step grammar work in-process")
    parser.add_argument("serve_args", nargs="*", help="more `kvserve serve` flags (after --)")
    args = parser.parse_args()
    if args.steps_profile:
        profile_steps(args.concurrency)
        return
    serve_args = ["--max-num-seqs", str(args.concurrency), *args.serve_args]
    with tempfile.TemporaryDirectory() as log_dir:
        server = ServerProcess.start(serve_args, Path(log_dir), env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        try:
            model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
            asyncio.run(run_batch(server.base_url, model, 4, 8, True))  # warm-up: compile, first masks
            rounds = []
            for index in range(args.rounds):
                order = (False, True) if index % 2 == 0 else (True, False)
                result = {}
                for constrained in order:
                    mode = "json_schema" if constrained else "unconstrained"
                    result[mode] = asyncio.run(run_batch(server.base_url, model, args.concurrency, args.max_tokens,
                                                         constrained))
                    print(f"round {index + 1} {mode:>13}: {result[mode]['tokens_per_s']:7.1f} tok/s, "
                          f"TPOT {result[mode]['tpot_ms']:6.1f} ms, TTFT {result[mode]['ttft_ms']:7.1f} ms", flush=True)
                rounds.append(result)
        finally:
            server.stop()
    print(f"\n{args.concurrency} concurrent chat requests, {args.max_tokens} tokens each (ignore_eos), "
          f"median of {args.rounds} rounds:")
    medians = {}
    for mode in ("unconstrained", "json_schema"):
        medians[mode] = {key: statistics.median(r[mode][key] for r in rounds) for key in ("tokens_per_s", "tpot_ms")}
        print(f"  {mode:>13}: {medians[mode]['tokens_per_s']:7.1f} tok/s   TPOT {medians[mode]['tpot_ms']:6.1f} ms")
    ratio = medians["json_schema"]["tokens_per_s"] / medians["unconstrained"]["tokens_per_s"]
    per_round = [r["json_schema"]["tokens_per_s"] / r["unconstrained"]["tokens_per_s"] for r in rounds]
    print(f"  json_schema / unconstrained tokens/s: {ratio:.3f}x (of the medians); per round "
          f"{', '.join(f'{x:.2f}' for x in per_round)}, median {statistics.median(per_round):.3f}x")
    print(f"  sample constrained output: {rounds[-1]['json_schema']['sample']!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "medians": medians, "ratio": ratio,
                                               "per_round_ratios": per_round,
                                               "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
