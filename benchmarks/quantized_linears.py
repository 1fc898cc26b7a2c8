"""The default model's linears (30 layers of q/k/v, o, gate/up, down, and the LM head) at a few row
counts: dense weights (prepacked as the engine holds them: bf16 on kvserve's AVX512-BF16 kernel where
the CPU has it, else oneDNN's where it runs bf16, and float32 on oneDNN; `onednn` forces oneDNN's
packing, for the side-by-side with kvserve's bf16 kernel) vs the small-batch kernel on int4 weights (kvserve's where it is built, else torch's int4
kernel; 8-bit LM head), the choice behind KERNEL_MAX_ROWS in kvserve/model/quant_linear.py. Median
of interleaved rounds, milliseconds for all the linears of one step.

    python benchmarks/quantized_linears.py --threads 1 --rows 1,2,4,8,16,32
    python benchmarks/quantized_linears.py --rows 32,128,512 --without-lm-head   # what a prefill chunk runs
    python benchmarks/quantized_linears.py --rows 32 --per-shape   # each shape called again and again
    python benchmarks/quantized_linears.py --rows 1,8,32,128,512,2048 --dense prepacked,onednn --without-lm-head
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from kvserve.model import cpu_linear, quant_linear
from kvserve.model.cpu_linear import PrepackedLinear, prepacking_available
from kvserve.model.quantized import quantize_int4, quantize_int8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def build(dtype: torch.dtype, dense_kinds: list[str], shapes: list[tuple[int, int]]) -> dict[str, list[nn.Module]]:
    """The step's layers once per kind: "kernel" (QuantizedLinear, no dense copy), and for each of
    `dense_kinds` the same weights dense: "prepacked" (as the engine holds them), "onednn" (oneDNN's
    packing even where kvserve's bf16 kernel runs) or "plain" (F.linear)."""
    torch.manual_seed(0)
    layers: dict[str, list[nn.Module]] = {kind: [] for kind in dense_kinds + ["kernel"]}
    for out, cols in shapes:
        linear = nn.Linear(cols, out, bias=False)
        linear.weight.data.normal_(0, 0.02)
        lm_head = (out, cols) == SHAPES[-1]
        matrix = quantize_int8(linear.weight.data) if lm_head else quantize_int4(linear.weight.data)
        layers["kernel"].append(quant_linear.QuantizedLinear(matrix, None, dtype, torch.device("cpu"),
                                                             keep_dense=False))
        linear = linear.to(dtype)
        for kind in dense_kinds:
            prepack = kind in ("prepacked", "onednn") and prepacking_available(torch.device("cpu"), dtype)
            layers[kind].append(_prepacked(linear, dtype, kind == "onednn") if prepack else linear)
    return layers


def _prepacked(linear: nn.Linear, dtype: torch.dtype, onednn_only: bool) -> PrepackedLinear:
    if not onednn_only:
        return PrepackedLinear(linear, keep_copy=dtype == torch.bfloat16)
    kernel = cpu_linear.bf16_kernel
    cpu_linear.bf16_kernel = lambda: None
    try:
        return PrepackedLinear(linear, keep_copy=dtype == torch.bfloat16)
    finally:
        cpu_linear.bf16_kernel = kernel


def step_ms(layers: list[nn.Module], rows: int, dtype: torch.dtype) -> float:
    inputs = [torch.randn(rows, layer.in_features).to(dtype) for layer in layers]
    with torch.inference_mode():
        start = time.perf_counter()
        for layer, x in zip(layers, inputs):
            layer(x)
        return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--dense", default="prepacked",
                        help="comma list of prepacked (the engine's dense layers), onednn (oneDNN's packing even "
                             "where kvserve's bf16 kernel runs) and plain (nn.Linear, F.linear: float32 before it "
                             "was prepacked), each interleaved with the kernel")
    parser.add_argument("--without-lm-head", action="store_true",
                        help="only the 120 int4 layers (a prefill chunk computes the LM head for its last rows only)")
    parser.add_argument("--per-shape", action="store_true",
                        help="also time each distinct shape's first dense layer called 20 times in a row (its "
                             "weight stays in cache where it fits): the GEMM's own speed, apart from reading weights")
    args = parser.parse_args()
    from kvserve.engine.llm_engine import select_dtype

    kinds = [k.strip() for k in args.dense.split(",") if k.strip()]
    if not kinds or set(kinds) - {"prepacked", "onednn", "plain"}:
        parser.error("--dense takes prepacked, onednn and plain")
    torch.set_num_threads(args.threads)
    dtype = select_dtype(args.dtype, torch.device("cpu"))
    layers = build(dtype, kinds, SHAPES[:-1] if args.without_lm_head else SHAPES)
    print(f"dtype {str(dtype).removeprefix('torch.')}, threads {args.threads}; ms per step of linears (median)")
    print(f"| rows | {' | '.join(f'{k} dense' for k in kinds)} | int4 kernel | kernel / {kinds[0]} |")
    print(f"|---|{'---|' * (len(kinds) + 2)}")
    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[str, list[float]] = {kind: [] for kind in layers}
        for kind in layers:  # warm-up
            step_ms(layers[kind], rows, dtype)
        for _ in range(args.rounds):
            for kind in layers:
                times[kind].append(step_ms(layers[kind], rows, dtype))
        ms = {kind: statistics.median(t) for kind, t in times.items()}
        print(f"| {rows} | {' | '.join(f'{ms[k]:.1f}' for k in kinds)} | {ms['kernel']:.1f} | "
              f"{ms['kernel'] / ms[kinds[0]]:.2f} |", flush=True)
        flops = 2 * rows * sum(layer.in_features * layer.out_features for layer in layers[kinds[0]])
        print(f"  ({kinds[0]} dense: {flops / ms[kinds[0]] / 1e6:.1f} GFLOP/s)")
        if args.per_shape:
            print_per_shape(layers[kinds[0]], rows, dtype)


def print_per_shape(layers: list[nn.Module], rows: int, dtype: torch.dtype) -> None:
    """Median µs and GFLOP/s of each distinct shape's first layer, called 20 times in a row."""
    seen: set[tuple[int, int]] = set()
    for layer in layers:
        shape = (layer.out_features, layer.in_features)
        if shape in seen:
            continue
        seen.add(shape)
        x = torch.randn(rows, layer.in_features).to(dtype)
        with torch.inference_mode():
            for _ in range(3):
                layer(x)
            times = []
            for _ in range(20):
                start = time.perf_counter()
                layer(x)
                times.append(time.perf_counter() - start)
        us = statistics.median(times) * 1e6
        gflops = 2 * rows * shape[0] * shape[1] / us / 1e3
        print(f"  {shape[0]} x {shape[1]}, {rows} rows: {us:.1f} µs, {gflops:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
