"""PNG plots of a serving benchmark: latency CDFs, the server's KV cache and queues over time,
output throughput over time; and, for `compare`, grouped bars and overlaid timelines."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvserve.figures import pyplot, save_figure

if TYPE_CHECKING:
    from kvserve.bench.serve import RunOutput


def _save(fig: Any, directory: Path, name: str) -> Path:
    fig.tight_layout()
    return save_figure(fig, directory / name, dpi=110)


def _cdf(ax: Any, values_ms: list[float], label: str | None = None) -> None:
    if not values_ms:
        return
    x = np.sort(np.asarray(values_ms))
    ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)


def output_rate(run: "RunOutput", bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times, output tokens per second) from chunk arrival times. A chunk counts as the
    request's reported output tokens spread evenly over its chunks (1 each when none reported)."""
    times, weights = [], []
    for r in run.results:
        if r.success and r.token_times:
            w = (r.output_tokens / len(r.token_times)) if r.output_tokens else 1.0
            times += r.token_times
            weights += [w] * len(r.token_times)
    if not times:
        return np.zeros(0), np.zeros(0)
    edges = np.arange(0.0, max(times) + bin_s, bin_s)
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], counts / bin_s


def plot_run(run: "RunOutput", directory: str | os.PathLike, title: str = "") -> list[Path]:
    """latency_cdf.png, throughput.png and (when /metrics was sampled) server_timeline.png."""
    plt = pyplot()
    out = Path(directory)
    ok = [r for r in run.results if r.success]
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, values, name in ((axes[0], [r.ttft * 1000 for r in ok], "TTFT"),
                             (axes[1], [x * 1000 for r in ok for x in r.itl], "ITL")):
        _cdf(ax, values)
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of samples", title=f"{name} CDF {title}".strip())
        ax.grid(alpha=0.3)
    paths.append(_save(fig, out, "latency_cdf.png"))

    t, rate = output_rate(run)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step(t, rate, where="post")
    ax.set(xlabel="time (s)", ylabel="output tokens/s", title=f"Output throughput {title}".strip())
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out, "throughput.png"))

    samples = run.server_samples
    if samples:
        ts = [s.t for s in samples]
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        top.plot(ts, [100 * (s.kv_cache_usage or 0.0) for s in samples])
        top.set(ylabel="KV cache usage (%)", ylim=(0, 105), title=f"Server state {title}".strip())
        bottom.plot(ts, [s.running or 0 for s in samples], label="running")
        bottom.plot(ts, [s.waiting or 0 for s in samples], label="waiting")
        bottom.set(xlabel="time (s)", ylabel="requests")
        bottom.legend()
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        paths.append(_save(fig, out, "server_timeline.png"))
    return paths


def safe_name(label: str) -> str:
    """A label as a directory name: "--kv-cache-dtype fp8" -> "kv-cache-dtype_fp8"."""
    label = re.sub(r"(?<![\w-])-+", "", label)  # flags lose their leading dashes
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_-.") or "config"


def plot_compare(labels: list[str], ratios: dict[str, list[float]], runs: list["RunOutput"],
                 directory: str | os.PathLike) -> list[Path]:
    """compare_bars.png: each metric's value per config as a ratio to the first config;
    compare_kv_cache.png: KV cache usage over time per config (when sampled)."""
    plt = pyplot()
    out = Path(directory)
    names = list(ratios)
    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(names)), 4.5))
    x = np.arange(len(names))
    for i, label in enumerate(labels):
        ax.bar(x + i * width - 0.4 + width / 2, [ratios[n][i] for n in names], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, names, rotation=20, ha="right")
    ax.set(ylabel=f"ratio to {labels[0]}", title="Comparison (higher throughput / lower latency is better)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    paths = [_save(fig, out, "compare_bars.png")]

    if any(run.server_samples for run in runs):
        fig, ax = plt.subplots(figsize=(8, 4))
        for label, run in zip(labels, runs):
            if run.server_samples:
                ax.plot([s.t for s in run.server_samples],
                        [100 * (s.kv_cache_usage or 0.0) for s in run.server_samples], label=label)
        ax.set(xlabel="time (s)", ylabel="KV cache usage (%)", ylim=(0, 105), title="KV cache usage over time")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        paths.append(_save(fig, out, "compare_kv_cache.png"))
    for label, run in zip(labels, runs):
        if run.results:
            paths += plot_run(run, out / safe_name(label), title=f"({label})")
    return paths
