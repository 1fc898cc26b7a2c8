"""Greedy token ids of the default model under every KV dtype and eviction policy, as JSON: run it
on two commits (PYTHONPATH pointing at each checkout) and compare the files to show a refactor
changed no output.

    PYTHONPATH=/path/to/old python benchmarks/greedy_outputs.py --json old.json
    PYTHONPATH=/path/to/new python benchmarks/greedy_outputs.py --json new.json
    python benchmarks/greedy_outputs.py --compare old.json new.json
"""
from __future__ import annotations

import argparse
import json
import sys

CONFIGS = {  # name -> LLM options (all share the prompts and the sampling)
    "auto": {},
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
    "int8": {"kv_cache_dtype": "int8"},
    "int4": {"kv_cache_dtype": "int4"},
    "int4_kivi": {"kv_cache_dtype": "int4_kivi"},
    "torch_backend": {"attention_backend": "torch"},
    "streaming": {"kv_eviction": "streaming", "kv_budget": 128},
    "h2o": {"kv_eviction": "h2o", "kv_budget": 128},
}


def generate(num_prompts: int, max_tokens: int) -> dict[str, list[list[int]]]:
    from kvserve import LLM, SamplingParams
    from kvserve.bench.datasets import BOOK_PATH

    words = BOOK_PATH.read_text().split()
    prompts = [" ".join(words[i * 300: i * 300 + 40 + 25 * i]) for i in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results = {}
    for name, options in CONFIGS.items():
        llm = LLM(kv_cache_memory="256MiB", max_model_len=2048, **options)
        results[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        print(f"{name}: {sum(map(len, results[name]))} tokens", file=sys.stderr)
        del llm
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the token ids here")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two such files")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    if args.compare:
        old, new = (json.load(open(path)) for path in args.compare)
        differ = [name for name in old if old[name] != new.get(name)]
        for name in old:
            print(f"{name}: {'DIFFERENT' if name in differ else 'identical'}")
        return 1 if differ else 0
    results = generate(args.num_prompts, args.max_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
