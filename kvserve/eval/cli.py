"""`kvserve eval`: measure what each KV-cache dtype costs in quality and gains in capacity.

    kvserve eval                                   # the default model, all dtypes, the bundled novel
    kvserve eval --kv-cache-dtypes auto,int8 --json --plot eval.png
    kvserve eval --quantizations none,auto,int8,int4 --kv-cache-dtypes auto --no-passkey   # weights
    kvserve eval --output-json results/eval.json   # table on stdout, JSON to a file
    kvserve eval --long-context --kv-budget 1024 --plot long.png   # KV eviction policies on long text
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from kvserve.cache.formats import KV_CACHE_DTYPES
from kvserve.engine.args import EMBEDDING_ARGS, EngineArgs
from kvserve.figures import check_chart_path
from kvserve.engine.generation_defaults import ENGINE_DEFAULTS, GENERATION_CONFIG_ARGS
from kvserve.eval.passkey import PasskeyConfig
from kvserve.eval.perplexity import ScoringConfig
from kvserve.eval.runner import DEFAULT_KV_CACHE_DTYPES, DEFAULT_TEXT


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _choice_list(text: str, choices: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A comma-separated list of names, each one of `choices` (argparse's error otherwise)."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in choices]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or text!r}: "
                                         f"choose from {', '.join(choices)}")
    return names


def _dtype_list(text: str) -> tuple[str, ...]:
    return _choice_list(text, KV_CACHE_DTYPES, "KV cache dtype")


def _quantization_list(text: str) -> tuple[str, ...]:
    from kvserve.model.quant_linear import QUANTIZATION_MODES

    return _choice_list(text, QUANTIZATION_MODES, "quantization")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="measure the quality cost and memory gain of KV-cache dtypes (perplexity, KL, passkey)",
        description="Perplexity, KL divergence and top-1 agreement vs the first (reference) dtype, computed "
                    "through the paged KV cache, passkey retrieval, and bytes per token of each KV-cache dtype.")
    p.add_argument("--kv-cache-dtypes", type=_dtype_list, default=DEFAULT_KV_CACHE_DTYPES,
                   help="comma-separated KV cache dtypes to compare; the first is the reference "
                        f"(default: {','.join(DEFAULT_KV_CACHE_DTYPES)})")
    p.add_argument("--quantizations", type=_quantization_list, default=None,
                   help="comma-separated weight quantizations (--quantization modes: auto,none,int8,int4) to "
                        "compare, each with every KV cache dtype; the first configuration is the reference "
                        "(default: just --quantization)")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file to score (default: the bundled novel)")
    d = ScoringConfig()
    p.add_argument("--num-tokens", type=int, default=d.num_tokens, help="scored tokens (default: %(default)s)")
    p.add_argument("--context-len", type=int, default=d.context_len,
                   help="context tokens before each scored window (default: %(default)s)")
    p.add_argument("--score-len", type=int, default=d.score_len, help="scored tokens per window (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=d.chunk_size,
                   help="tokens per forward pass while scoring (default: %(default)s)")
    k = PasskeyConfig()
    p.add_argument("--passkey-lengths", type=_int_list, default=k.lengths,
                   help=f"passkey prompt lengths in tokens (default: {','.join(map(str, k.lengths))})")
    p.add_argument("--passkey-depths", type=_float_list, default=k.depths,
                   help=f"needle depths as fractions (default: {','.join(map(str, k.depths))})")
    p.add_argument("--passkey-trials", type=int, default=k.trials, help="keys per length and depth (default: %(default)s)")
    p.add_argument("--no-passkey", action="store_true", help="skip passkey retrieval")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--output-json", metavar="PATH", default=None, help="also write the results as JSON to this file")
    p.add_argument("--plot", metavar="PNG", default=None, help="save a memory-vs-quality chart to this file")
    add_long_context_args(p)
    EngineArgs.add_cli_args(p, skip=("kv_cache_dtype", *GENERATION_CONFIG_ARGS, *EMBEDDING_ARGS))  # greedy scoring
    # Each configuration only needs room for one scoring window or one batch of passkey prompts.
    p.set_defaults(func=run_eval, kv_cache_memory="1GiB", parser=p, generation_config=ENGINE_DEFAULTS)


# Options of one protocol that the other never reads: given to it, they are refused, not ignored.
_DTYPE_COMPARISON_ONLY = ("kv_cache_dtypes", "quantizations", "num_tokens", "context_len", "score_len",
                          "chunk_size", "passkey_lengths")
_LONG_CONTEXT_ONLY = ("long_configs", "long_tokens", "long_chunk_size", "long_segment", "long_passkey_length",
                      "long_passkey_budgets")


def _refuse_unread(args: argparse.Namespace, names: tuple[str, ...], why: str) -> None:
    """ValueError naming every option of `names` given a value other than its default."""
    given = ["--" + name.replace("_", "-") for name in names if getattr(args, name) != args.parser.get_default(name)]
    if given:
        raise ValueError(f"{', '.join(given)}: {why}")


def run_eval(args: argparse.Namespace) -> int:
    check_chart_path(args.plot)
    if args.no_passkey:
        options = ("passkey_lengths", "passkey_depths", "passkey_trials", "long_passkey_budgets",
                   *(("long_passkey_length",) if args.long_passkey_length != 0 else ()))  # 0 also means none
        _refuse_unread(args, options, "passkey options, and --no-passkey skips passkey retrieval")
    if args.long_context:
        return run_long_context(args)
    _refuse_unread(args, _LONG_CONTEXT_ONLY, "options of the long-context protocol, which needs --long-context")
    from kvserve.eval.report import plot, render_table, report_json
    from kvserve.eval.runner import evaluate

    scoring = ScoringConfig(args.num_tokens, args.context_len, args.score_len, args.chunk_size)
    passkey = None if args.no_passkey else PasskeyConfig(args.passkey_lengths, args.passkey_depths, args.passkey_trials)
    engine = EngineArgs.from_cli_args(args)
    options = {k: v for k, v in vars(engine).items() if k not in ("model", "kv_cache_dtype")}
    report = evaluate(engine.model, args.kv_cache_dtypes, args.text, scoring, passkey, args.quantizations, **options)
    return _emit(args, report_json(report), [render_table(report)], lambda path: plot(report, path))


def _emit(args: argparse.Namespace, report_json: str, tables: list, plot_to: Callable[[str], Path]) -> int:
    """Print the tables (or the JSON with --json), write --output-json, draw --plot."""
    if args.json:
        print(report_json)
    else:
        from rich.console import Console

        # Piped to a file, rich would squeeze the tables into 80 columns.
        console = Console(width=None if sys.stdout.isatty() else 200)
        for table in tables:
            console.print(table)
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(report_json + "\n")
    if args.plot:
        print(f"chart saved to {plot_to(args.plot)}", file=sys.stderr)
    return 0


def add_long_context_args(p: argparse.ArgumentParser) -> None:
    from kvserve.eval.long_context import CONFIGS, LongContextConfig

    d = LongContextConfig()
    g = p.add_argument_group(
        "long-context protocol (--long-context): KV eviction policies on long text, StreamingLLM's perplexity "
        "protocol and passkey retrieval; the budget, sinks and the scored policies' recent window come from "
        f"--kv-budget (default {d.budget}), --sink-tokens ({d.sink_tokens}) and --recent-tokens")
    g.add_argument("--long-context", action="store_true", help="run this protocol instead of the KV dtype comparison")
    g.add_argument("--long-configs", type=lambda t: tuple(x.strip() for x in t.split(",") if x.strip()),
                   default=d.configs, help=f"configurations: dense, window (no sinks) and the registered KV "
                                           f"eviction policies (default: all of them, {','.join(CONFIGS)})")
    g.add_argument("--long-tokens", type=int, default=d.num_tokens, help="tokens fed (default: %(default)s)")
    g.add_argument("--long-chunk-size", type=int, default=d.chunk_size,
                   help="tokens per forward pass while feeding (default: %(default)s)")
    g.add_argument("--long-segment", type=int, default=d.segment,
                   help="tokens per perplexity segment in the plot (default: %(default)s)")
    g.add_argument("--long-passkey-length", type=int, default=d.passkey_length,
                   help="passkey prompt length in tokens; 0 skips passkey (default: %(default)s)")
    g.add_argument("--long-passkey-budgets", type=_float_list, default=d.passkey_budgets,
                   help=f"KV budgets as fractions of the passkey length (default: "
                        f"{','.join(map(str, d.passkey_budgets))})")


def run_long_context(args: argparse.Namespace) -> int:
    import json

    from kvserve.eval.long_context import (LongContextConfig, evaluate_long_context, plot, render_tables,
                                           report_dict)

    _refuse_unread(args, _DTYPE_COMPARISON_ONLY + ("kv_eviction", "max_num_batched_tokens"),
                   "not read by --long-context, which compares the policies of --long-configs on the model's own "
                   "KV dtype, with --long-tokens, --long-chunk-size and a step budget of its own")
    d = LongContextConfig()
    config = LongContextConfig(
        num_tokens=args.long_tokens, budget=d.budget if args.kv_budget is None else args.kv_budget,
        sink_tokens=d.sink_tokens if args.sink_tokens is None else args.sink_tokens,
        recent_tokens=args.recent_tokens, chunk_size=args.long_chunk_size, segment=args.long_segment,
        configs=args.long_configs, passkey_length=0 if args.no_passkey else args.long_passkey_length,
        passkey_budgets=args.long_passkey_budgets, passkey_depths=args.passkey_depths,
        passkey_trials=args.passkey_trials)
    engine = EngineArgs.from_cli_args(args)
    options = {k: v for k, v in vars(engine).items()
               if k not in ("model", "kv_eviction", "kv_budget", "sink_tokens", "recent_tokens")}
    report = evaluate_long_context(engine.model, args.text, config, **options)
    return _emit(args, json.dumps(report_dict(report), indent=2), render_tables(report),
                 lambda path: plot(report, path))
