"""Speculative decoding by n-gram lookup against plain decoding, side by side in one process.

Three workloads on the default model, greedy, at 1 and 8 concurrent requests:
  repeat  a completion prompt holding a passage, then its opening again (the model goes on copying:
          what prompt lookup is for, like quoting a retrieved document or editing code)
  edit    a chat request to return a passage with its typos fixed
  open    a chat request for a short story (little to look up: the drafts' cost)
  json    a chat request to put a passage's sentences in a JSON array, under a JSON schema
          (structured output copying from the context, as an agent's extraction step does)
Each round runs both engines in turn on every workload; the table gives medians of the rounds'
generated tokens per second (wall time of `generate`, prefill included), the drafts' acceptance,
and whether the two engines' tokens were identical.

    python benchmarks/speculative_ngram.py --rounds 3 --output-json spec.json

`--verify-cost` measures instead what a verified draft costs: the median time of a decode step of
each request count with every decode carrying K drafts (fixed ones: the cost does not depend on
what is accepted), over the step without drafts. A step that emits on average more tokens per
request than that ratio gains. `--dummy-preset` takes a `kvserve plan` preset's shapes with random
weights (as benchmarks/vs_llama_cpp.py does), for models larger than the bundled one:

    python benchmarks/speculative_ngram.py --verify-cost --dummy-preset qwen3-0.6b --concurrency 1,4
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from kvserve import LLM, SamplingParams, StructuredOutputsParams

PASSAGES = Path(__file__).resolve().parents[1] / "kvserve" / "data" / "pride-and-prejudice.txt"


def passages(count: int, chars: int = 900) -> list[str]:
    text = PASSAGES.read_text()
    return [text[2000 + i * chars:2000 + (i + 1) * chars] for i in range(count)]


def typos(text: str) -> str:
    """Every 12th word with two letters swapped."""
    words = text.split(" ")
    return " ".join(w[1] + w[0] + w[2:] if i % 12 == 5 and len(w) > 3 else w for i, w in enumerate(words))


def workloads(concurrency: int, llm: LLM) -> dict[str, list]:
    texts = passages(concurrency)
    chat = llm.engine.apply_chat_template
    return {
        "repeat": [{"prompt_token_ids": llm.engine.tokenize(t + "\n\n" + t[:120])[1]} for t in texts],
        "edit": [{"prompt_token_ids": chat([{"role": "user", "content": "Fix the typos in this text and return "
                                              "the whole text:\n\n" + typos(t)}])} for t in texts],
        "open": [{"prompt_token_ids": chat([{"role": "user", "content": f"Write a short story about a robot "
                                              f"who learns to paint, number {i}."}])} for i in range(concurrency)],
        "json": [{"prompt_token_ids": chat([{"role": "user", "content": "Put each sentence of this text, word for "
                                              "word, in a JSON object's \"sentences\" array:\n\n" + t}])}
                 for t in texts],
    }


SENTENCES_SCHEMA = {"type": "object", "properties": {"sentences": {"type": "array", "items": {"type": "string"}}},
                    "required": ["sentences"]}


def run(llm: LLM, prompts: list, max_tokens: int, structured: bool = False) -> tuple[float, list[list[int]]]:
    constraint = StructuredOutputsParams(json=SENTENCES_SCHEMA) if structured else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=not structured,
                            structured_outputs=constraint)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed, [o.outputs[0].token_ids for o in outputs]


def verify_cost(llm: LLM, concurrency: int, draft_counts: list[int], steps: int) -> dict[int, float]:
    """Median decode-step seconds of `concurrency` requests, each decode carrying k fixed drafts."""
    engine = llm.engine
    wanted = {"k": 0}
    engine.drafter.drafts = lambda request, budget: [request.token_ids[-1]] * min(wanted["k"], budget)
    params = SamplingParams(temperature=0, max_tokens=steps * len(draft_counts) * (1 + max(draft_counts)) + 8,
                            ignore_eos=True)
    ids = [engine.add_request(list(range(100 + i, 164 + i)), params) for i in range(concurrency)]
    engine.step()  # the prompts
    medians = {}
    for k in draft_counts:
        wanted["k"] = k
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        medians[k] = statistics.median(times[2:])
    for request_id in ids:
        engine.abort_request(request_id)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default="repeat,edit,open,json", help="comma list")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--verify-cost", action="store_true", help="measure a verified draft's cost instead")
    parser.add_argument("--draft-counts", default="0,1,2,4,8", help="--verify-cost: drafts per decode")
    parser.add_argument("--steps", type=int, default=12, help="--verify-cost: steps timed per draft count")
    parser.add_argument("--dummy-preset", default=None, metavar="PRESET",
                        help="--verify-cost: a `kvserve plan` preset's shapes with random weights, e.g. qwen3-0.6b")
    args = parser.parse_args()
    config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
              "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    if args.verify_cost:
        counts = [int(k) for k in args.draft_counts.split(",")]
        options: dict = {}
        if args.dummy_preset:
            from kvserve.model.loader import resolve_model_path
            from vs_llama_cpp import _dummy_model  # (benchmarks/vs_llama_cpp.py)

            options = {"load_format": "dummy", "tokenizer": str(resolve_model_path(None))}
            args.model = _dummy_model(args.dummy_preset)
        llm = LLM(args.model, speculative_config={**config, "num_speculative_tokens": max(counts) or 1}, **options)
        rows = []
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            medians = verify_cost(llm, concurrency, counts, args.steps)
            for k, seconds in medians.items():
                rows.append({"concurrency": concurrency, "drafts": k, "step_ms": 1000 * seconds,
                             "ratio": seconds / medians[counts[0]]})
                print(f"c={concurrency:<3d} drafts {k}: {1000 * seconds:7.2f} ms a step, x{rows[-1]['ratio']:.2f}",
                      flush=True)
        if args.output_json:
            Path(args.output_json).write_text(json.dumps({"model": args.dummy_preset or args.model or "default",
                                                          "rows": rows}, indent=1))
        return
    engines = {"plain": LLM(args.model), "ngram": LLM(args.model, speculative_config=config)}
    drafter = engines["ngram"].engine.drafter
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for name, prompts in workloads(concurrency, engines["plain"]).items():
            if name not in args.workloads.split(","):
                continue
            rates = {engine: [] for engine in engines}
            tokens, before = {}, drafter.stats.copy()
            for _ in range(args.rounds):
                for engine, llm in engines.items():
                    rate, tokens[engine] = run(llm, prompts, args.max_tokens, structured=name == "json")
                    rates[engine].append(rate)
            stats = drafter.stats
            drafts = stats.num_drafts - before.num_drafts
            accepted = stats.num_accepted_tokens - before.num_accepted_tokens
            drafted = stats.num_draft_tokens - before.num_draft_tokens
            row = {"workload": name, "concurrency": concurrency,
                   "plain_tok_s": statistics.median(rates["plain"]), "ngram_tok_s": statistics.median(rates["ngram"]),
                   "acceptance": accepted / drafted if drafted else 0.0,
                   "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
                   "identical_tokens": tokens["plain"] == tokens["ngram"]}
            row["speedup"] = row["ngram_tok_s"] / row["plain_tok_s"]
            rows.append(row)
            print(f"{name:7s} c={concurrency:<3d} plain {row['plain_tok_s']:7.1f} tok/s  "
                  f"ngram {row['ngram_tok_s']:7.1f} tok/s  x{row['speedup']:.2f}  accepted {100 * row['acceptance']:.0f}% of drafts, mean length "
                  f"{row['mean_acceptance_length']:.2f}, identical tokens: {row['identical_tokens']}", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"config": config, "machine": platform.processor() or
                                                      platform.machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
