"""Peak memory and time to start on a GGUF larger than the bundled one.

Writes a `kvserve plan` preset's shapes as a GGUF the way llama.cpp's Q4_0 files are made (random
weights: linears Q4_0, the embedding Q8_0, norms F32; no tokenizer metadata, so the bundled model's
tokenizer is borrowed), then starts `LLM()` on it in a fresh child process per `--quantization`
and reports the child's peak resident memory (VmHWM) and the LLM() time, beside the peak of a
child that only imports kvserve. To compare commits, run the script with PYTHONPATH set to each
checkout: the children inherit it.

    python benchmarks/gguf_load_memory.py --preset llama-3.2-1b --quantization auto,none
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Peak RSS from /proc's VmHWM: ru_maxrss would carry over the parent's peak through fork and exec.
CHILD = """
import json, sys, time

def peak_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

from kvserve import LLM
imported = peak_kib()
path, tokenizer, quantization = sys.argv[1:4]
if quantization != "-":
    begin = time.perf_counter()
    LLM(path, tokenizer=tokenizer, quantization=quantization, kv_cache_memory="64MiB", max_model_len=512)
    seconds = time.perf_counter() - begin
else:
    seconds = 0.0
print(json.dumps({"import_maxrss_kib": imported, "maxrss_kib": peak_kib(), "llm_seconds": seconds}))
"""


def write_gguf(preset: str, path: Path, seed: int = 0) -> int:
    """The preset's tensors as llama.cpp names and stores them; returns the file's size in bytes."""
    import gguf
    from gguf import quants

    from kvserve.plan.presets import PRESETS

    config = PRESETS[preset].config
    if config["model_type"] != "llama":
        raise SystemExit(f"{preset}: this writer makes llama-architecture GGUFs")
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // heads
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)

    def add(name: str, rows: int, cols: int, qtype: gguf.GGMLQuantizationType) -> None:
        values = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
        writer.add_tensor(name, quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", vocab, hidden, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    if not config.get("tie_word_embeddings", False):
        add("output.weight", vocab, hidden, gguf.GGMLQuantizationType.Q8_0)
    q4 = gguf.GGMLQuantizationType.Q4_0
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim),
                                 ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)):
            add(f"blk.{i}.{name}.weight", rows, cols, q4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.stat().st_size


def run_child(path: Path, tokenizer: str, quantization: str) -> dict:
    # (not from this checkout's directory: `python -c` puts the working directory first on sys.path,
    # ahead of PYTHONPATH's checkout)
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), tokenizer, quantization], env=os.environ,
                         cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--quantization", default="auto,none", help="comma list of --quantization modes")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--gguf", default=None, help="reuse (or keep) the written file here")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    from kvserve.model.loader import default_model_path

    directory = None if args.gguf else tempfile.TemporaryDirectory(prefix="kvserve-gguf-")
    path = Path(args.gguf) if args.gguf else Path(directory.name) / f"{args.preset}-q4_0.gguf"
    if not path.exists():
        start = time.perf_counter()
        size = write_gguf(args.preset, path)
        print(f"wrote {path} ({size / 2**30:.2f} GiB) in {time.perf_counter() - start:.0f} s", flush=True)
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for mode in ["-", *args.quantization.split(",")]:
            run = run_child(path, str(default_model_path()), mode)
            results.setdefault(mode, []).append(run)
            label = "import only" if mode == "-" else f"--quantization {mode}"
            print(f"{label:24s} peak RSS {run['maxrss_kib'] / 2**20:6.2f} GiB  LLM() {run['llm_seconds']:5.1f} s",
                  flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "file_bytes": path.stat().st_size,
                                                      "runs": results}, indent=1))
    if directory is not None:
        directory.cleanup()


if __name__ == "__main__":
    main()
