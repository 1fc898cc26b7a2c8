"""The default model's linears (30 layers of q/k/v, o, gate/up, down, and the LM head) at a few row
counts: dense weights (oneDNN-prepacked, as the engine holds them: bf16 where oneDNN runs it, and
float32) vs the small-batch kernel on int4 weights (kvserve's where it is built, else torch's int4
kernel; 8-bit LM head), the choice behind KERNEL_MAX_ROWS in kvserve/model/quant_linear.py. Median of interleaved rounds, milliseconds for all the linears of one
step.

    python benchmarks/quantized_linears.py --threads 1 --rows 1,2,4,8,16,32
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from kvserve.model import quant_linear
from kvserve.model.cpu_linear import PrepackedLinear, prepacking_available
from kvserve.model.quantized import quantize_int4, quantize_int8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def build(dtype: torch.dtype, plain: bool = False) -> tuple[list[nn.Module], list[nn.Module]]:
    torch.manual_seed(0)
    dense, quantized = [], []
    for i, (out, cols) in enumerate(SHAPES):
        linear = nn.Linear(cols, out, bias=False)
        linear.weight.data.normal_(0, 0.02)
        matrix = quantize_int8(linear.weight.data) if i == len(SHAPES) - 1 else quantize_int4(linear.weight.data)
        quantized.append(quant_linear.QuantizedLinear(matrix, None, dtype, torch.device("cpu"), keep_dense=False))
        linear = linear.to(dtype)
        prepack = not plain and prepacking_available(torch.device("cpu"), dtype)
        dense.append(PrepackedLinear(linear, keep_plain=dtype == torch.bfloat16) if prepack else linear)
    return dense, quantized


def step_ms(layers: list[nn.Module], rows: int, dtype: torch.dtype) -> float:
    inputs = [torch.randn(rows, cols).to(dtype) for _, cols in SHAPES]
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
    parser.add_argument("--dense", default="prepacked", choices=("prepacked", "plain"),
                        help="plain: the dense weights as plain nn.Linear (F.linear), as before float32 prepacking")
    args = parser.parse_args()
    from kvserve.engine.llm_engine import select_dtype

    torch.set_num_threads(args.threads)
    dtype = select_dtype(args.dtype, torch.device("cpu"))
    dense, quantized = build(dtype, plain=args.dense == "plain")
    print(f"dtype {str(dtype).removeprefix('torch.')}, dense {args.dense}, threads {args.threads}; "
          "ms per step of linears (median)")
    print("| rows | dense | int4 kernel | kernel / dense |\n|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[str, list[float]] = {"dense": [], "kernel": []}
        step_ms(dense, rows, dtype), step_ms(quantized, rows, dtype)  # warm-up
        for _ in range(args.rounds):
            times["dense"].append(step_ms(dense, rows, dtype))
            times["kernel"].append(step_ms(quantized, rows, dtype))
        d, k = statistics.median(times["dense"]), statistics.median(times["kernel"])
        print(f"| {rows} | {d:.1f} | {k:.1f} | {k / d:.2f} |", flush=True)


if __name__ == "__main__":
    main()
