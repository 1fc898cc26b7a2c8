"""kvserve vs llama.cpp (llama-cpp-python) vs HF transformers on the same GGUF, in one process.

Each round runs every backend in turn (interleaved, so a noisy neighbour hits all of them alike);
the table reports each figure's median over the rounds:

- decode: single-stream output tokens/s over `--decode-tokens` greedy tokens after a
  `--prompt-tokens` prompt, prefill excluded;
- prefill: prompt tokens/s of a `--prefill-tokens` prompt (to its first token);
- cN: output tokens/s of N concurrent requests of `--prompt-tokens` in / `--decode-tokens` out,
  end to end (their prefills included).

llama.cpp runs through llama-cpp-python's low-level API: one context per concurrency with one
sequence per request, every step one `llama_decode` over a batch holding each sequence's next
token (what `llama-server --parallel N` does per step). HF transformers (GGUF dequantized to the
model dtype by transformers, what users of it run) is measured at the largest concurrency only, as
one static batch of `generate`. Prompts are random token ids, fresh each round.

    pip install -e '.[llama-cpp]'
    python benchmarks/vs_llama_cpp.py --kvserve-quantization auto,none --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kvserve.bench.efficiency import random_prompts

Prompts = list[list[int]]


# ------------------------------------------------------------------------------------- kvserve
class KvserveBackend:
    def __init__(self, model: str | None, quantization: str, dtype: str, lean: bool = True, **options: Any):
        from kvserve.llm import LLM

        self.name = f"kvserve ({quantization})" if lean else f"kvserve ({quantization}, lean step off)"
        self.llm = LLM(model, quantization=quantization, dtype=dtype, kv_cache_memory="2GiB", max_model_len=1024,
                       max_num_seqs=256, **options)
        if not lean:  # the module path for every step, as before the lean decode step
            self.llm.engine.model.lean = None
        self.dtype = self.llm.engine.dtype

    def _generate(self, prompts: Prompts, max_tokens: int) -> None:
        from kvserve.sampling_params import SamplingParams

        self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)

    def decode(self, prompt: list[int], tokens: int) -> float:
        from kvserve.bench.efficiency import kvserve_decode

        run = kvserve_decode(self.llm, 1, len(prompt), tokens - 1, seed=prompt[0])
        return run.tokens_per_s

    def prefill(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self._generate([prompt], 1)
        return len(prompt) / (time.perf_counter() - start)

    def concurrent(self, prompts: Prompts, tokens: int) -> float:
        start = time.perf_counter()
        self._generate(prompts, tokens)
        return len(prompts) * tokens / (time.perf_counter() - start)


# ------------------------------------------------------------------------------------- llama.cpp
class LlamaCppBackend:
    def __init__(self, path: Path, threads: int):
        import llama_cpp

        self.lib = llama_cpp
        self.name = "llama.cpp"
        self.threads = threads
        self.llama = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_threads=threads,
                                     n_threads_batch=threads, verbose=False)
        self.model = self.llama.model
        self.vocab = self.llama.n_vocab()
        self.contexts: dict[int, Any] = {}

    def _context(self, sequences: int) -> Any:
        if sequences not in self.contexts:
            params = self.lib.llama_context_default_params()
            params.n_ctx = max(1024, 320 * sequences)
            params.n_batch = params.n_ubatch = 512
            params.n_seq_max = sequences
            params.n_threads = params.n_threads_batch = self.threads
            new_context = getattr(self.lib, "llama_init_from_model", None) or self.lib.llama_new_context_with_model
            self.contexts[sequences] = new_context(self.model, params)
        ctx = self.contexts[sequences]
        if hasattr(self.lib, "llama_memory_clear"):
            self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)
        else:
            self.lib.llama_kv_self_clear(ctx)
        return ctx

    def _decode(self, ctx: Any, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode per 512 entries (token, position, sequence, wants logits); the greedy
        next token of every entry that wants logits, in order."""
        chosen = []
        for start in range(0, len(entries), 512):
            chunk = entries[start:start + 512]
            batch = self.lib.llama_batch_init(len(chunk), 0, 1)
            try:
                batch.n_tokens = len(chunk)
                for i, (token, pos, seq, logits) in enumerate(chunk):
                    batch.token[i], batch.pos[i] = token, pos
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = seq
                    batch.logits[i] = logits
                if self.lib.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                for i, entry in enumerate(chunk):
                    if entry[3]:
                        row = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(ctx, i), shape=(self.vocab,))
                        chosen.append(int(row.argmax()))
            finally:
                self.lib.llama_batch_free(batch)
        return chosen

    def _prefill(self, ctx: Any, prompts: Prompts) -> list[int]:
        entries = [(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
        return self._decode(ctx, entries)

    def decode(self, prompt: list[int], tokens: int) -> float:
        ctx = self._context(1)
        token = self._prefill(ctx, [prompt])[0]
        start = time.perf_counter()
        for step in range(tokens - 1):
            token = self._decode(ctx, [(token, len(prompt) + step, 0, True)])[0]
        return (tokens - 1) / (time.perf_counter() - start)

    def prefill(self, prompt: list[int]) -> float:
        ctx = self._context(1)
        start = time.perf_counter()
        self._prefill(ctx, [prompt])
        return len(prompt) / (time.perf_counter() - start)

    def concurrent(self, prompts: Prompts, tokens: int) -> float:
        ctx = self._context(len(prompts))
        start = time.perf_counter()
        next_tokens = self._prefill(ctx, prompts)
        for step in range(tokens - 1):
            next_tokens = self._decode(ctx, [(t, len(p) + step, seq, True)
                                             for seq, (t, p) in enumerate(zip(next_tokens, prompts))])
        return len(prompts) * tokens / (time.perf_counter() - start)


# ------------------------------------------------------------------------------------- HF
class HFBackend:
    def __init__(self, model: str | None, dtype: torch.dtype):
        from kvserve.bench.hf_backend import HFGenerator, load_hf_model

        self.name = f"HF transformers ({str(dtype).removeprefix('torch.')})"
        hf = load_hf_model(model, dtype, torch.device("cpu"))
        self.generator = HFGenerator(hf, 0)

    def concurrent(self, prompts: Prompts, tokens: int) -> float:
        start = time.perf_counter()
        self.generator.generate_batch(prompts, tokens)
        return len(prompts) * tokens / (time.perf_counter() - start)


def _dummy_model(preset: str) -> str:
    """A directory holding the preset's config.json (kvserve.plan.presets), for --load-format dummy;
    removed when the process exits."""
    import atexit
    import shutil
    import tempfile

    from kvserve.plan.presets import PRESETS

    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose from {', '.join(sorted(PRESETS))}")
    directory = Path(tempfile.mkdtemp(prefix=f"kvserve-{preset}-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    (directory / "config.json").write_text(json.dumps({**PRESETS[preset].config, "torch_dtype": "bfloat16"}))
    return str(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--concurrency", default="8,32", help="comma list")
    parser.add_argument("--kvserve-quantization", default="auto", help="comma list of --quantization modes")
    parser.add_argument("--compare-lean", action="store_true",
                        help="also run each kvserve mode with the lean decode step off (its before/after)")
    parser.add_argument("--dtype", default="auto", help="kvserve's --dtype (HF runs in the dtype it resolves to)")
    parser.add_argument("--backends", default="kvserve,llama.cpp,hf", help="comma list of kvserve, llama.cpp, hf")
    parser.add_argument("--dummy-preset", default=None, metavar="PRESET",
                        help="kvserve only: a `kvserve plan` preset's shapes with random weights (--load-format "
                             "dummy) and the bundled model's tokenizer, e.g. qwen3-0.6b")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    from kvserve.model.loader import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    wanted = args.backends.split(",")
    options: dict[str, Any] = {}
    if args.dummy_preset:
        if wanted != ["kvserve"]:
            parser.error("--dummy-preset measures kvserve alone (--backends kvserve)")
        args.model, options = _dummy_model(args.dummy_preset), {"load_format": "dummy", "tokenizer": str(path)}
    backends: list[Any] = []
    if "kvserve" in wanted:
        for q in args.kvserve_quantization.split(","):
            backends.append(KvserveBackend(args.model, q, args.dtype, **options))
            if args.compare_lean:
                backends.append(KvserveBackend(args.model, q, args.dtype, lean=False, **options))
    if "llama.cpp" in wanted:
        backends.append(LlamaCppBackend(path, args.threads))
    concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    dtype = backends[0].dtype if backends and hasattr(backends[0], "dtype") else torch.float32
    if "hf" in wanted:
        backends.append(HFBackend(args.model, dtype))
    vocab = 49152 if not backends else getattr(getattr(backends[0], "llm", None), "engine", None)
    # (a dummy preset's vocabulary can be larger than the tokenizer it borrows: prompts stay in both)
    vocab = min(vocab.model_config.vocab_size, len(vocab.tokenizer)) if vocab is not None else 49152
    results: dict[str, dict[str, list[float]]] = {b.name: {} for b in backends}

    def record(backend: Any, key: str, measure: Callable[[], float]) -> None:
        value = measure()
        results[backend.name].setdefault(key, []).append(value)
        print(f"  {backend.name:28s} {key:8s} {value:8.1f} tok/s", flush=True)

    for b in backends:  # warm-up: first calls build kernels, contexts and caches
        if hasattr(b, "decode"):
            b.decode(random_prompts(vocab, 1, 16, 99)[0], 4)
        b.concurrent(random_prompts(vocab, 2, 16, 98), 4)
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", flush=True)
        seed = 1000 * (r + 1)
        for b in backends:
            if hasattr(b, "decode"):
                record(b, "decode", lambda: b.decode(random_prompts(vocab, 1, args.prompt_tokens, seed)[0],
                                                    args.decode_tokens))
                record(b, "prefill", lambda: b.prefill(random_prompts(vocab, 1, args.prefill_tokens, seed + 1)[0]))
            for n in concurrency:
                if isinstance(b, HFBackend) and n != max(concurrency):  # HF: the largest only
                    continue
                record(b, f"c{n}", lambda: b.concurrent(random_prompts(vocab, n, args.prompt_tokens, seed + 2 + n),
                                                       args.decode_tokens))
    keys = ["decode", "prefill"] + [f"c{n}" for n in concurrency]
    print("\nmedian tok/s over", args.rounds, "rounds; threads", args.threads)
    print(f"| backend | {' | '.join(keys)} |")
    print(f"|---|{'---|' * len(keys)}")
    medians = {name: {k: statistics.median(v) for k, v in figures.items()} for name, figures in results.items()}
    for name, figures in medians.items():
        print(f"| {name} | " + " | ".join(f"{figures[k]:.1f}" if k in figures else "–" for k in keys) + " |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "runs": results, "medians": medians},
                                                     indent=1))


if __name__ == "__main__":
    main()
