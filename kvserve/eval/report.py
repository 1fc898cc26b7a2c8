"""Presenting an `EvalReport`: a rich table, JSON, and a memory-vs-quality chart."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kvserve.eval.runner import EvalReport
from kvserve.figures import pyplot, save_figure


def report_dict(report: EvalReport) -> dict[str, Any]:
    """Plain data for --json (passkey tallies keyed by prompt length)."""
    data = dataclasses.asdict(report)
    for result, raw in zip(report.results, data["results"]):
        if result.passkey is not None:
            raw["passkey"]["accuracy"] = result.passkey.accuracy
    return data


def report_json(report: EvalReport) -> str:
    return json.dumps(report_dict(report), indent=2)


def render_table(report: EvalReport):
    """A rich Table: one row per configuration, quality relative to the first (the reference)."""
    from rich.table import Table

    ref = report.reference
    weights = len({r.quantization for r in report.results}) > 1
    table = Table(title=f"KV-cache quality and capacity: {Path(report.model).name} ({report.dtype}), "
                        f"{ref.fidelity.num_tokens} scored tokens, reference {ref.kv_cache_dtype}"
                        f"{f' with weights {ref.quantization}' if weights else ''}")
    if weights:
        table.add_column("weights", justify="left")
        table.add_column("weight bytes", justify="right")
    for header in ("kv cache dtype", "bytes/token", "tokens/GiB", "capacity", "perplexity", "ppl change",
                   "KL (nats)", "top-1 agree"):
        table.add_column(header, justify="left" if header == "kv cache dtype" else "right")
    if report.passkey is not None:
        for length in report.passkey.lengths:
            table.add_column(f"passkey {length}", justify="right")
        table.add_column("passkey all", justify="right")
    for r in report.results:
        f = r.fidelity
        name = r.kv_cache_dtype if r.kv_cache_dtype == r.format else f"{r.kv_cache_dtype} ({r.format})"
        row = [r.quantization, f"{r.weight_bytes:,}"] if weights else []
        row += [name, f"{r.bytes_per_token:,.0f}", f"{r.tokens_per_gib:,}", f"{r.capacity_ratio:.2f}x",
               f"{f.perplexity:.3f}", f"{100 * r.perplexity_increase:+.2f}%", f"{f.mean_kl:.5f}",
               f"{100 * f.top1_agreement:.1f}%"]
        if r.passkey is not None:
            row += [f"{c}/{t}" for c, t in (r.passkey.by_length[n] for n in report.passkey.lengths)]
            row.append(f"{r.passkey.correct}/{r.passkey.total}")
        table.add_row(*row)
    return table


def plot(report: EvalReport, path: Path | str) -> Path:
    """Save a chart of bytes per token against perplexity change (and passkey accuracy)."""
    plt = pyplot()
    panels = 2 if report.passkey is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    memory = [r.bytes_per_token / 1024 for r in report.results]
    series = [("perplexity change vs reference (%)", [100 * r.perplexity_increase for r in report.results])]
    if report.passkey is not None:
        series.append(("passkey accuracy (%)", [100 * r.passkey.accuracy for r in report.results]))
    markers = "os^Dvp*Xh"
    for ax, (label, values) in zip(axes[0], series):
        # One marker and colour per configuration, named in a legend: configurations of equal size
        # and quality sit on top of each other, where point labels would collide.
        for i, (r, x, y) in enumerate(zip(report.results, memory, values)):
            ax.scatter([x], [y], marker=markers[i % len(markers)], s=60, label=r.kv_cache_dtype, alpha=0.8)
        ax.set_xlabel("KV cache KiB per token (all layers, scales included)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=9)
    fig.suptitle(f"{Path(report.model).name}: KV-cache memory vs quality")
    fig.tight_layout()
    return save_figure(fig, path)
