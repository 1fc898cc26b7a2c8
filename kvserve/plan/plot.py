"""`kvserve plan --plot out.png`: KV bytes of the planned batch against context length, one line
per KV dtype, with the KV budget as a horizontal line."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from kvserve.figures import pyplot, save_figure
from kvserve.units import GiB
from kvserve.plan.calculator import Plan, footprint

NUM_POINTS = 200


def plot_plan(plan: Plan, kv_cache_dtypes: list[str], path: str | Path) -> Path:
    plt = pyplot()

    inputs = plan.inputs
    top = inputs.max_model_len
    lengths = sorted({max(1, round(top * i / NUM_POINTS)) for i in range(NUM_POINTS + 1)})
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in kv_cache_dtypes:
        points = [footprint(plan.arch, name, dataclasses.replace(inputs, max_model_len=n), None) for n in lengths]
        label = f"{points[0].kv_cache_dtype} ({points[0].pool_layout} layout)"
        ax.plot(lengths, [p.pool_bytes_per_device / GiB for p in points], label=label)
    if plan.budget is not None:
        ax.axhline(plan.budget.bytes / GiB, color="black", linestyle="--",
                   label=f"KV budget {plan.budget.bytes / GiB:,.2f} GiB")
    device = " per device" if inputs.tensor_parallel_size > 1 else ""
    ax.set_xlabel("context length (tokens per sequence)")
    ax.set_ylabel(f"KV cache{device} (GiB)")
    ax.set_title(f"{plan.arch.name}: KV cache of {inputs.batch_size} sequence(s), block size {inputs.block_size}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return save_figure(fig, path, bbox_inches="tight")
