"""What `kvserve top` draws from one GET /dashboard/state body (README "Dashboard"): a header, the
pool as a bar by block state, sparklines of KV usage and throughput, and the request table."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table
from rich.text import Text

STATE_STYLES = {"free": "grey50", "cached": "blue", "used": "green", "shared": "red"}
STATE_LABELS = {"free": "free", "cached": "cached for reuse", "used": "in use", "shared": "shared"}
SPARKS = "▁▂▃▄▅▆▇█"
HISTORY = 120  # samples kept for the sparklines


def sparkline(values: list[float | None], width: int) -> str:
    values = [v for v in values if v is not None][-width:]
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1) + 0.5))] for v in values)


def pool_bar(counts: dict[str, int], width: int) -> Text:
    """One bar, `width` cells, split in proportion to the blocks per state (largest remainder)."""
    total = sum(counts.values()) or 1
    exact = {s: counts.get(s, 0) * width / total for s in STATE_STYLES}
    cells = {s: int(v) for s, v in exact.items()}
    for s in sorted(exact, key=lambda s: exact[s] - cells[s], reverse=True)[:width - sum(cells.values())]:
        cells[s] += 1
    bar = Text()
    for s in ("shared", "used", "cached", "free"):
        bar.append("█" * cells[s], style=STATE_STYLES[s])
    return bar


@dataclass
class TopView:
    """The samples behind the sparklines, fed one state body at a time."""

    usage: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    gen_rate: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    prompt_rate: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    _last: dict | None = None

    def add(self, state: dict) -> None:
        counts, n = state["pool"]["counts"], state["pool"]["num_blocks"]
        last = self._last
        if last is not None and (state["step"], state["time"]) == (last["step"], last["time"]):
            return  # the same snapshot again (a long step is running)
        self.usage.append(100.0 * (counts["used"] + counts["shared"]) / n)
        if last is not None and state["time"] > last["time"]:
            dt = state["time"] - last["time"]
            self.gen_rate.append((state["totals"]["generation_tokens"] - last["totals"]["generation_tokens"]) / dt)
            self.prompt_rate.append((state["totals"]["prompt_tokens"] - last["totals"]["prompt_tokens"]) / dt)
        self._last = state

    def render(self, state: dict, width: int, max_rows: int, notice: str = "") -> Group:
        pool, counts = state["pool"], state["pool"]["counts"]
        running = [r for r in state["requests"] if r["status"] == "running"]
        age = state["age_s"]
        header = Text.assemble(
            ("kvserve top ", "bold"), f"{state['model']} · {state['kv_cache_dtype']} KV · block size "
            f"{state['block_size']} · step {state['step']}, {age:.1f} s ago")
        if state["engine"]["step_running_s"] and state["engine"]["step_running_s"] > 1:
            header.append(f" (step {state['engine']['steps_completed'] + 1} running for "
                          f"{state['engine']['step_running_s']:.1f} s)", style="yellow")
        legend = Text("  ".join(f"{STATE_LABELS[s]} {counts[s]}" for s in STATE_STYLES))
        for s, style in STATE_STYLES.items():
            legend.highlight_words([f"{STATE_LABELS[s]} {counts[s]}"], style=style)
        spark_width = max(10, width - 34)
        usage = self.usage[-1] if self.usage else 0.0
        gen = self.gen_rate[-1] if self.gen_rate else 0.0
        sparks = Text.assemble(
            f"KV usage {usage:5.1f}%      ", (sparkline(list(self.usage), spark_width), "green"), "\n",
            f"generation {gen:7.1f} tok/s ", (sparkline(list(self.gen_rate), spark_width), "cyan"))
        table = Table(box=None, pad_edge=False, header_style="bold", expand=False, padding=(0, 1, 0, 0))
        for name in ("id", "status", "prompt", "output", "hit", "KV tok", "blocks", "shared", "evict",
                     "evicted", "preempt"):
            table.add_column(name, justify="left" if name in ("id", "status", "evict") else "right",
                             no_wrap=True, overflow="ellipsis", max_width=max(8, min(26, width - 72)) if name == "id" else None)
        for r in state["requests"][:max_rows]:
            table.add_row(r["id"], r["status"], str(r["prompt_tokens"]), str(r["output_tokens"]),
                          str(r["cached_tokens"]), str(r["kv_tokens"]), str(r["num_blocks"]),
                          str(r["shared_blocks"]), r["eviction"] or "-", str(r["evicted_tokens"]),
                          str(r["preemptions"]))
        more = len(state["requests"]) - max_rows
        footer = Text(f"… and {more} more" if more > 0 else "")
        title = Text(f"KV pool: {pool['num_blocks']} blocks   requests: {len(running)} running, "
                     f"{len(state['requests']) - len(running)} waiting")
        parts = [header, title, pool_bar(counts, max(10, width - 2)), legend, sparks, table, footer]
        if notice:
            parts.insert(1, Text(notice, style="bold red"))
        return Group(*parts)
