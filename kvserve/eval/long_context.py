"""`kvserve eval --long-context`: KV eviction policies on long text, the StreamingLLM protocol
(Xiao et al. 2023, arXiv:2309.17453, section 4.1): feed a book through one sequence in small
chunks, score every next token, and compare at the same KV budget

* dense: the full cache, up to max-model-len (the model's trained context);
* window: the most recent tokens only (streaming without sinks);
* every registered eviction policy (kvserve/cache/eviction/policies), by name: streaming (4 sink
  tokens + the recent window, StreamingLLM), h2o (sinks + heavy hitters by accumulated attention
  + a recent window, arXiv:2306.14048), snapkv, tova, ... each with its own default recent window;

with the evicting ones continued past max-model-len. The default run is all of them (`CONFIGS`);
--long-configs picks some. Perplexity is reported per range (the
trained context and beyond) and per segment for a plot. Chunks of `chunk_size` tokens stand in
for the paper's token-by-token feeding: within a chunk the later tokens see up to chunk_size - 1
more tokens than the budget.

Passkey retrieval (passkey.py's prompts) at budgets that are fractions of the prompt length:
StreamingLLM can only find keys that are still inside its window; attention-scored policies may
keep them.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.cache.eviction import POLICIES
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.eval.passkey import PasskeyConfig, make_prompts
from kvserve.eval.runner import DEFAULT_TEXT, read_text
from kvserve.figures import pyplot, save_figure
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.eval")

CONFIGS = ("dense", "window", *POLICIES)  # dense, window-only, then every registered policy
_KEY = re.compile(r"\d{5}")  # as passkey.py: the first 5-digit number generated must be the key


@dataclass(frozen=True)
class LongContextConfig:
    num_tokens: int = 16_384  # tokens fed through each evicting sequence (dense stops at max-model-len)
    budget: int = 1024  # KV tokens per sequence for window / streaming / h2o
    sink_tokens: int = 4
    recent_tokens: int | None = None  # recent window of the scored policies (default: each policy's own)
    chunk_size: int = 16
    segment: int = 512  # perplexity per segment of this many tokens (the plot)
    configs: tuple[str, ...] = CONFIGS
    passkey_length: int = 2048  # 0: no passkey
    passkey_budgets: tuple[float, ...] = (0.25, 0.5)  # as fractions of passkey_length
    passkey_depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    passkey_trials: int = 2
    # Tokens per engine step while the passkey prompts are prefilled (small, like chunk_size: a
    # chunk as large as the budget would leave H2O little to choose from).
    passkey_chunk_size: int = 64

    def __post_init__(self) -> None:
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown or not self.configs:
            raise ValueError(f"unknown long-context configuration {', '.join(unknown) or '(none)'}: "
                             f"choose from {', '.join(CONFIGS)}")
        for name in ("num_tokens", "budget", "chunk_size", "segment", "passkey_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.chunk_size > self.budget - self.sink_tokens:
            raise ValueError(f"the chunk size ({self.chunk_size}) must be at most budget - sink tokens "
                             f"({self.budget - self.sink_tokens})")
        if not all(0 < b <= 1 for b in self.passkey_budgets):
            raise ValueError("passkey budgets are fractions of the passkey length, in (0, 1]")

    def eviction(self, name: str, budget: int | None = None) -> dict[str, Any] | None:
        """The kv_eviction settings of a configuration (None: dense)."""
        budget = budget or self.budget
        if name == "dense":
            return None
        if name == "window":
            return {"policy": "streaming", "budget": budget, "sink_tokens": 0}
        spec = {"policy": name, "budget": budget, "sink_tokens": self.sink_tokens}
        if POLICIES[name].scored_share and self.recent_tokens is not None:
            spec["recent_tokens"] = self.recent_tokens
        return spec


@dataclass
class PerplexityCurve:
    config: str
    num_tokens: int  # next-token predictions scored
    perplexity_in_context: float  # over predictions at positions < max-model-len
    perplexity_beyond: float | None  # over the rest (None: dense, which stops there)
    segment_perplexity: list[float]  # per `segment` predictions, in order
    seconds: float


@dataclass
class PasskeyRow:
    config: str
    budget: int | None  # None: dense
    by_depth: dict[float, tuple[int, int]]  # depth -> (correct, total)

    @property
    def correct(self) -> int:
        return sum(c for c, _ in self.by_depth.values())

    @property
    def total(self) -> int:
        return sum(t for _, t in self.by_depth.values())


@dataclass
class LongContextReport:
    model: str
    dtype: str
    text: str
    max_model_len: int
    config: LongContextConfig
    curves: list[PerplexityCurve] = field(default_factory=list)
    passkey: list[PasskeyRow] = field(default_factory=list)


def next_token_nll(engine: LLMEngine, token_ids: list[int], chunk_size: int,
                   kv_eviction: dict | None) -> np.ndarray:
    """Negative log-likelihood [len(token_ids) - 1] of each next token, fed in chunks."""
    nll = np.empty(len(token_ids) - 1, dtype=np.float64)
    done = 0
    for logits in engine.score_chunks(token_ids, chunk_size, kv_eviction=kv_eviction):
        n = logits.shape[0]
        rows = min(n, len(nll) - done)  # the last token has nothing to predict
        targets = torch.tensor(token_ids[done + 1: done + 1 + rows], device=logits.device)
        logprobs = torch.log_softmax(logits[:rows].float(), dim=-1)
        nll[done: done + rows] = -logprobs.gather(1, targets[:, None])[:, 0].double().cpu().numpy()
        done += n
    return nll


def perplexity_curve(name: str, nll: np.ndarray, max_model_len: int, segment: int, seconds: float) -> PerplexityCurve:
    inside, beyond = nll[: max_model_len - 1], nll[max_model_len - 1:]
    segments = [float(math.exp(nll[i: i + segment].mean())) for i in range(0, len(nll), segment)]
    return PerplexityCurve(name, len(nll), float(math.exp(inside.mean())),
                           float(math.exp(beyond.mean())) if len(beyond) else None, segments, seconds)


def run_passkey_rows(engine: LLMEngine, config: LongContextConfig) -> list[PasskeyRow]:
    """Every configuration's passkey trials, each configuration batched through the scheduler."""
    prompts = make_prompts(engine.tokenizer, PasskeyConfig((config.passkey_length,), config.passkey_depths,
                                                           config.passkey_trials))
    runs = [("dense", None)] if "dense" in config.configs else []
    runs += [(name, round(fraction * config.passkey_length)) for name in config.configs if name != "dense"
             for fraction in config.passkey_budgets]
    rows = []
    for name, budget in runs:
        params = SamplingParams(temperature=0, max_tokens=8, kv_eviction=config.eviction(name, budget) or "none")
        pending = {engine.add_request(p.token_ids, params): p for p in prompts}
        tally: dict[float, list[int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    prompt = pending[output.request_id]
                    found = _KEY.search(output.outputs[0].text)
                    counts = tally.setdefault(prompt.depth, [0, 0])
                    counts[0] += int(found is not None and found.group() == prompt.key)
                    counts[1] += 1
        rows.append(PasskeyRow(name, budget, {d: tuple(tally[d]) for d in sorted(tally)}))
        logger.info("passkey %s (budget %s): %d/%d", name, budget, rows[-1].correct, rows[-1].total)
    return rows


def evaluate_long_context(model: str | None = None, text: Path | str = DEFAULT_TEXT,
                          config: LongContextConfig = LongContextConfig(), **engine_options: Any) -> LongContextReport:
    """Run the protocol on one engine (the configurations differ only in per-request eviction).
    `engine_options` are EngineArgs fields; the token budget per step is `passkey_chunk_size`."""
    options = {**engine_options, "max_num_batched_tokens": config.passkey_chunk_size}
    engine = LLMEngine(EngineArgs(model=model, **options))
    tokens = engine.tokenizer.encode(read_text(text), add_special_tokens=False)
    if len(tokens) < config.num_tokens:
        raise ValueError(f"the text has {len(tokens)} tokens; --long-tokens asks for {config.num_tokens}")
    if config.budget > engine.max_model_len:
        raise ValueError(f"the budget ({config.budget}) exceeds max-model-len ({engine.max_model_len})")
    tokens = tokens[: config.num_tokens]
    report = LongContextReport(str(engine.model_path), str(engine.dtype).removeprefix("torch."), str(text),
                               engine.max_model_len, config)
    for name in config.configs:
        start = time.monotonic()
        fed = tokens[: engine.max_model_len] if name == "dense" else tokens
        nll = next_token_nll(engine, fed, config.chunk_size, config.eviction(name))
        curve = perplexity_curve(name, nll, engine.max_model_len, config.segment, time.monotonic() - start)
        report.curves.append(curve)
        logger.info("%s: perplexity %.3f within max-model-len, %s beyond (%d tokens, %.0f s)", name,
                    curve.perplexity_in_context, f"{curve.perplexity_beyond:.3f}" if curve.perplexity_beyond else "-",
                    curve.num_tokens, curve.seconds)
    if config.passkey_length:
        report.passkey = run_passkey_rows(engine, config)
    return report


# ---------------------------------------------------------------------------- presentation
def report_dict(report: LongContextReport) -> dict[str, Any]:
    data = dataclasses.asdict(report)
    for row, raw in zip(report.passkey, data["passkey"]):
        raw["by_depth"] = {str(depth): list(counts) for depth, counts in row.by_depth.items()}
        raw["accuracy"] = row.correct / row.total
    return data


def render_tables(report: LongContextReport) -> list:
    from rich.table import Table

    cfg = report.config
    dense = next((c for c in report.curves if c.config == "dense"), None)
    ppl = Table(title=f"Long-context perplexity: {Path(report.model).name} ({report.dtype}), KV budget "
                      f"{cfg.budget} tokens, {cfg.sink_tokens} sinks, chunks of {cfg.chunk_size}")
    limit = f"{report.max_model_len:,}"
    for header in ("config", "tokens", f"ppl < {limit}", "vs dense", f"ppl >= {limit}"):
        ppl.add_column(header, justify="left" if header == "config" else "right")
    for c in report.curves:
        ratio = f"{100 * (c.perplexity_in_context / dense.perplexity_in_context - 1):+.1f}%" if dense else "-"
        beyond = f"{c.perplexity_beyond:.3f}" if c.perplexity_beyond is not None else "-"
        ppl.add_row(c.config, f"{c.num_tokens + 1:,}", f"{c.perplexity_in_context:.3f}", ratio, beyond)
    tables = [ppl]
    if report.passkey:
        keys = Table(title=f"Passkey retrieval, {cfg.passkey_length}-token prompts, "
                           f"{cfg.passkey_trials} keys per depth")
        depths = list(report.passkey[0].by_depth)
        for header in ("config", "budget", *(f"depth {d:g}" for d in depths), "all"):
            keys.add_column(header, justify="left" if header == "config" else "right")
        for row in report.passkey:
            budget = "full" if row.budget is None else f"{row.budget} ({row.budget / cfg.passkey_length:.0%})"
            keys.add_row(row.config, budget, *(f"{c}/{t}" for c, t in row.by_depth.values()),
                         f"{row.correct}/{row.total}")
        tables.append(keys)
    return tables


def plot(report: LongContextReport, path: Path | str) -> Path:
    """Perplexity per segment against position, one line per configuration."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    seg = report.config.segment
    for c in report.curves:
        x = [(i + 1) * seg for i in range(len(c.segment_perplexity))]
        ax.plot(x, c.segment_perplexity, label=c.config, marker=".")
    ax.axvline(report.max_model_len, color="gray", linestyle="--", linewidth=1)
    ax.text(report.max_model_len, ax.get_ylim()[1], " max-model-len", va="top", fontsize=9, color="gray")
    ax.set_yscale("log")
    ax.set_xlabel("position in the text (tokens)")
    ax.set_ylabel(f"perplexity per {seg} tokens (log)")
    ax.set_title(f"{Path(report.model).name}: KV budget {report.config.budget} tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)
