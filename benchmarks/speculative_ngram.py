"""Speculative decoding by n-gram lookup against plain decoding, side by side in one process.

Three workloads on the default model, greedy, at 1 and 8 concurrent requests:
  repeat  a completion prompt holding a passage, then its opening again (the model goes on copying:
          what prompt lookup is for, like quoting a retrieved document or editing code)
  edit    a chat request to return a passage with its typos fixed
  open    a chat request for a short story (little to look up: the drafts' cost)
Each round runs both engines in turn on every workload; the table gives medians of the rounds'
generated tokens per second (wall time of `generate`, prefill included), the drafts' acceptance,
and whether the two engines' tokens were identical.

    python benchmarks/speculative_ngram.py --rounds 3 --output-json spec.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from kvserve import LLM, SamplingParams

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
    }


def run(llm: LLM, prompts: list, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
              "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    engines = {"plain": LLM(args.model), "ngram": LLM(args.model, speculative_config=config)}
    drafter = engines["ngram"].engine.drafter
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for name, prompts in workloads(concurrency, engines["plain"]).items():
            rates = {engine: [] for engine in engines}
            tokens, before = {}, drafter.stats.copy()
            for _ in range(args.rounds):
                for engine, llm in engines.items():
                    rate, tokens[engine] = run(llm, prompts, args.max_tokens)
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
            print(f"{name:7s} c={concurrency:<3d} plain {row['plain_tok_s']:7.1f} tok/s  ngram {row['ngram_tok_s']:7.1f} "
                  f"tok/s  x{row['speedup']:.2f}  accepted {100 * row['acceptance']:.0f}% of drafts, mean length "
                  f"{row['mean_acceptance_length']:.2f}, identical tokens: {row['identical_tokens']}", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"config": config, "machine": platform.processor() or
                                                      platform.machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
