"""Where the start of `LLM(kv_cache_memory="256MiB")` on the default model goes: imports, reading the
GGUF, dequantizing, the tokenizer, building the model, and the start-up calibration of fp8_e4m3
(key bases: calibration prefill + fit) or int4 (key centres).

Each round is a fresh process (start-up costs are per process). `--cache cold` gives every round
an empty kvserve cache directory (first start: tokenizer built from the GGUF, calibration run);
`--cache warm` fills one first and reuses it (later starts). Either way the compiled CPU decode
kernel is taken from the usual cache (its one-off build is not what is measured here).

    python benchmarks/startup_time.py [--dtype auto] [--kv-cache-dtype fp8_e4m3] [--cache cold] [--rounds 3]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 KVSERVE_CPU_BF16=0 \\
        python benchmarks/startup_time.py --dtype float32     # as on an AVX2 CPU without bf16

Also times code from before the GGUF reader and the disk cache (it wraps the gguf package's reader
and dequantizer then): run it with PYTHONPATH pointing at such a checkout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PIECES = ["import torch", "import kvserve", "GGUF header", "dequantize", "tokenizer", "load_model",
          "model build", "calibration prefill", "fit", "calibration", "LLM()"]


def _child(dtype: str, kv_cache_dtype: str) -> dict[str, float]:
    """One start in this process: seconds per piece (pieces nest: load_model holds the first ones)."""
    times: dict[str, float] = {}

    def wrap(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                times[label] = times.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)

    start = time.perf_counter()
    import torch  # noqa: F401

    times["import torch"] = time.perf_counter() - start
    start = time.perf_counter()
    import kvserve.engine.key_basis as key_basis
    import kvserve.engine.key_centering as key_centering
    import kvserve.engine.key_transforms as key_transforms
    import kvserve.engine.loading as loading
    import kvserve.model.loader as loader
    from kvserve import LLM
    from kvserve.model.llama import LlamaForCausalLM

    times["import kvserve"] = time.perf_counter() - start
    if hasattr(loader, "read_gguf"):
        wrap(loader, "read_gguf", "GGUF header")
        # (since the GGUF's tensors are read lazily, dequantizing happens inside the model build)
        wrap(loader, "dequantize_all" if hasattr(loader, "dequantize_all") else "dequantize", "dequantize")
        wrap(loader, "_gguf_tokenizer", "tokenizer")
    else:  # before kvserve's own reader: both of the gguf package's reader passes count as the header
        import gguf
        import transformers

        wrap(gguf, "GGUFReader", "GGUF header")
        wrap(gguf.quants, "dequantize", "dequantize")
        wrap(transformers.AutoTokenizer, "from_pretrained", "tokenizer")
    wrap(loading, "load_model", "load_model")
    wrap(LlamaForCausalLM, "from_hf_weights", "model build")  # a bound classmethod stays bound
    wrap(key_basis, "record_projections", "calibration prefill")
    wrap(key_centering, "record_projections", "calibration prefill")
    wrap(key_basis, "fit_transforms", "fit")
    wrap(key_transforms, "calibrate_key_bases", "calibration")
    wrap(key_transforms, "calibrate_key_centers", "calibration")
    start = time.perf_counter()
    LLM(kv_cache_memory="256MiB", dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    times["LLM()"] = time.perf_counter() - start
    return times


def _round(args: argparse.Namespace, cache_dir: Path) -> dict[str, float]:
    kernels = cache_dir / "kernels"  # reuse the compiled decode kernel
    if not kernels.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        kernels.symlink_to(args.kernel_cache, target_is_directory=True)
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(cache_dir)}
    result = subprocess.run([sys.executable, __file__, "--child", args.dtype, args.kv_cache_dtype], env=env,
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    parser.add_argument("--cache", choices=["cold", "warm"], default="cold")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kernel-cache", type=Path, default=Path.home() / ".cache" / "kvserve" / "kernels",
                        help="where the compiled CPU decode kernel is (default: ~/.cache/kvserve/kernels)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    with tempfile.TemporaryDirectory() as temp:
        if args.cache == "warm":
            _round(args, Path(temp) / "warm")  # fills the cache
        rounds = [_round(args, Path(temp) / ("warm" if args.cache == "warm" else f"cold-{i}"))
                  for i in range(args.rounds)]
    print(f"{args.dtype} weights, {args.kv_cache_dtype} cache, {args.cache} kvserve cache, {args.rounds} fresh "
          f"processes: median (min-max) seconds")
    for piece in PIECES:
        values = [r[piece] for r in rounds if piece in r]
        if values:
            print(f"  {piece:20s} {statistics.median(values):6.2f}  ({min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
