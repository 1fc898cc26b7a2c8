"""`kvserve bench compare`: the before/after matrix in one command. Start `kvserve serve` once per
configuration on 127.0.0.1, send every one the same workload, and print each metric per
configuration with its ratio to the first; save the JSON and a grouped bar chart.

    kvserve bench compare --dataset-name prefix-repetition --num-prompts 64 \\
        --configs "--no-enable-prefix-caching" "--enable-prefix-caching"

`--configs` takes the rest of the command line (each quoted string is one configuration's
`kvserve serve` flags), so it comes last. A TOML file does the same with labels:

    server_args = "--max-num-seqs 64"        # optional: given to every configuration
    [[configs]]
    label = "baseline"
    args = "--no-enable-prefix-caching"
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvserve.bench.datasets import add_dataset_args, load_tokenizer
from kvserve.bench.launcher import ServerCommand, ServerStartError, kvserve_serve_command, running_server
from kvserve.bench.metrics import METRIC_TITLES, parse_goodput, parse_percentile_args, percentile_key
from kvserve.bench.multi_turn import MultiTurnWorkload
from kvserve.bench.report import save_json
from kvserve.bench.serve import (RunOutput, add_client_args, benchmark, build_workload, check_workload, client_config,
                                 failure_summary, load_config_from_args, resolve_endpoint)

SERVER_API_KEY_ENV = "KVSERVE_API_KEY"  # what `kvserve serve` reads when no --api-key is given


@dataclass
class ServerConfig:
    label: str
    args: str  # `kvserve serve` flags, as one shell-quoted string


@dataclass
class Row:
    title: str
    key: str
    scale: float = 1.0
    section: str = "result"  # "result" or "server_metrics"


def load_config_file(path: str) -> tuple[str, list[ServerConfig]]:
    """(server_args, configs) from a TOML file (see the module docstring)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"--config-file {path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config-file {path}: not valid TOML ({exc})") from None
    entries = data.get("configs")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"--config-file {path}: needs one or more [[configs]] tables with `args` (and `label`)")
    configs = [ServerConfig(str(e.get("label") or e.get("args") or "default"), str(e.get("args", ""))) for e in entries]
    return str(data.get("server_args", "")), configs


def resolve_configs(args: argparse.Namespace, own_flags: set[str]) -> tuple[str, list[ServerConfig]]:
    server_args = args.server_args or ""
    configs: list[ServerConfig] = []
    if args.config_file:
        file_args, configs = load_config_file(args.config_file)
        server_args = " ".join(filter(None, [file_args, server_args]))
    for text in args.configs or []:
        if text.split("=", 1)[0] in own_flags:
            raise ValueError(f"--configs takes the rest of the command line, so it must come last "
                             f"(found compare's own flag {text!r} after it)")
        configs.append(ServerConfig(text.strip() or "default", text))
    if args.labels:
        if len(args.labels) != len(configs):
            raise ValueError(f"--labels names {len(args.labels)} configs but there are {len(configs)}")
        configs = [ServerConfig(label, c.args) for label, c in zip(args.labels, configs)]
    if len(configs) < 1:
        raise ValueError("give the configurations to compare: --configs \"FLAGS\" ... (last) or --config-file")
    for c in configs:
        try:
            shlex.split(c.args)
        except ValueError as exc:
            raise ValueError(f"config {c.label!r}: cannot split {c.args!r} into flags ({exc})") from None
    return server_args, configs


def _flag_value(flags: list[str], name: str) -> str | None:
    """The value of `name` (e.g. --model) in a list of server flags, if given."""
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


def comparison_rows(selected: list[str], percentiles: list[float]) -> list[Row]:
    rows = [Row("Request throughput (req/s)", "request_throughput"),
            Row("Output token throughput (tok/s)", "output_throughput"),
            Row("Total token throughput (tok/s)", "total_token_throughput")]
    for name in selected:
        short = METRIC_TITLES[name][0]
        rows.append(Row(f"Mean {short} (ms)", f"mean_{name}_ms"))
        rows += [Row(f"P{percentile_key(p)} {short} (ms)", f"p{percentile_key(p)}_{name}_ms") for p in percentiles]
    rows += [Row("Peak KV cache usage (%)", "max_kv_cache_usage", 100.0, "server_metrics"),
             Row("Preemptions", "num_preemptions", 1.0, "server_metrics"),
             Row("Prefix cache hit rate (%)", "prefix_cache_hit_rate", 100.0, "server_metrics"),
             Row("Host tier hit rate (%)", "host_prefix_cache_hit_rate", 100.0, "server_metrics"),
             Row("Disk tier hit rate (%)", "disk_prefix_cache_hit_rate", 100.0, "server_metrics")]
    return rows


def row_value(result: dict[str, Any] | None, row: Row) -> float | None:
    if result is None:
        return None
    source = result.get("server_metrics", {}) if row.section == "server_metrics" else result
    value = source.get(row.key)
    return None if value is None else float(value) * row.scale


def format_comparison(labels: list[str], results: list[dict[str, Any] | None], rows: list[Row]) -> str:
    """One line per metric: each config's value, and after the first its ratio to the first."""
    width = max(22, *(len(label) + 2 for label in labels))
    head = f"{'Metric':<34}" + "".join(f"{label:>{width}}" for label in labels)
    lines = ["{s:{c}^{n}}".format(s=" Comparison (ratio to the first config) ", n=len(head), c="="), head]
    for row in rows:
        values = [row_value(r, row) for r in results]
        if all(v is None for v in values):
            continue
        cells = []
        for i, v in enumerate(values):
            if v is None:
                cells.append("-")
            elif i == 0 or not values[0]:
                cells.append(f"{v:.2f}")
            else:
                cells.append(f"{v:.2f} ({v / values[0]:.2f}x)")
        lines.append(f"{row.title:<34}" + "".join(f"{c:>{width}}" for c in cells))
    lines.append("=" * len(head))
    return "\n".join(lines)


# The metrics drawn as bars: throughput and the mean/tail latencies.
BAR_KEYS = ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
            "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms")


def bar_ratios(results: list[dict[str, Any] | None], rows: list[Row]) -> dict[str, list[float]]:
    ratios = {}
    for row in rows:
        if row.key not in BAR_KEYS:
            continue
        values = [row_value(r, row) for r in results]
        if values[0]:
            ratios[row.title] = [(v / values[0]) if v is not None else 0.0 for v in values]
    return ratios


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("compare", help="start kvserve serve per configuration, run one workload against "
                                              "each, compare them side by side")
    add_client_args(p, with_target=False)
    add_dataset_args(p, num_prompts=100, input_len="512", output_len="128", multi_turn=True)
    s = p.add_argument_group("configurations")
    s.add_argument("--server-args", default="", help="`kvserve serve` flags for every configuration, quoted "
                                                     "(e.g. \"--model DIR --kv-cache-memory 32MiB\"; one flag alone: "
                                                     "--server-args=--FLAG)")
    s.add_argument("--config-file", default=None, help="a TOML file of [[configs]] label/args (and server_args)")
    s.add_argument("--labels", nargs="+", default=None, help="names of the --configs, in order")
    s.add_argument("--tokenizer", default=None, help="workload tokenizer (default: --model of --server-args)")
    s.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for each server's /health")
    s.add_argument("--server-log-dir", default=None, help="where server logs go (default: a temporary directory)")
    r = p.add_argument_group("results")
    r.add_argument("--save-result", default=None, metavar="PATH", help="write every config's result JSON here")
    r.add_argument("--plot", default=None, metavar="DIR", help="write the bar chart and per-config plots here")
    p.add_argument("--configs", nargs=argparse.REMAINDER, default=None,
                   help="LAST: one quoted string of `kvserve serve` flags per configuration")
    p.set_defaults(func=run_compare_cli, compare_flags={o for a in p._actions for o in a.option_strings})


def run_compare(args: argparse.Namespace, server_command: ServerCommand = kvserve_serve_command) -> int:
    """Run every configuration; print, save and plot. `server_command` builds a server's argv."""
    endpoint = resolve_endpoint(args)
    load = load_config_from_args(args)
    selected, percentiles = parse_percentile_args(args.percentile_metrics, args.metric_percentiles)
    if args.goodput:
        parse_goodput(args.goodput)
    check_workload(args)
    server_args, configs = resolve_configs(args, args.compare_flags)
    common = shlex.split(server_args)
    tokenizer = load_tokenizer(args.tokenizer or _flag_value(common, "--model"))
    samples = build_workload(args, tokenizer)
    log_dir = Path(args.server_log_dir or tempfile.mkdtemp(prefix="kvserve-compare-"))

    results: list[dict[str, Any] | None] = []
    runs: list[RunOutput] = []
    problems: list[str] = []
    for i, config in enumerate(configs):
        print(f"\n### [{i + 1}/{len(configs)}] {config.label}: kvserve serve {server_args} {config.args}".rstrip(),
              flush=True)
        log = log_dir / f"server-{i}.log"
        try:
            flags = common + shlex.split(config.args)
            # the key the server will demand, if any: its --api-key flag, else its environment
            api_key = _flag_value(flags, "--api-key") or os.environ.get(SERVER_API_KEY_ENV)
            with running_server(server_command, flags, log, args.server_timeout) as url:
                client = client_config(args, url, endpoint, _served_model(url, api_key), api_key)
                args.label = config.label
                result, run, table = benchmark(args, client, samples, load, tokenizer)
        except ServerStartError as exc:
            problems.append(f"{config.label}: {exc}")
            print(f"{config.label}: {exc}", file=sys.stderr)
            results.append(None)
            runs.append(RunOutput([], 0.0))
            continue
        print(table, flush=True)
        results.append(result)
        runs.append(run)
        if failure := failure_summary(result):
            problems.append(f"{config.label}: {failure}")

    labels = [c.label for c in configs]
    rows = comparison_rows(selected, percentiles)
    print()
    print(format_comparison(labels, results, rows))
    if args.save_result:
        data = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "server_args": server_args,
                "workload": {"dataset_name": args.dataset_name, "seed": args.seed,
                             "request_rate": str(args.request_rate), "max_concurrency": args.max_concurrency,
                             **workload_shape(samples)},
                "configs": [{"label": c.label, "args": c.args, "result": r} for c, r in zip(configs, results)],
                "comparison": {row.key: {label: row_value(r, row) for label, r in zip(labels, results)}
                               for row in rows}}
        print(f"Result saved to {save_json(args.save_result, data)}")
    if args.plot and results[0] is not None:
        from kvserve.bench.plots import plot_compare

        for path in plot_compare(labels, bar_ratios(results, rows), runs, args.plot):
            print(f"Plot saved to {path}")
    if problems:
        print(f"kvserve bench compare: error: {'; '.join(problems)}", file=sys.stderr)
        return 1
    return 0


def workload_shape(samples: list | MultiTurnWorkload) -> dict[str, Any]:
    """`num_prompts`, and for the multi-turn workload its options as well."""
    if isinstance(samples, MultiTurnWorkload):
        return {"num_prompts": samples.options.num_requests, "multi_turn": dataclasses.asdict(samples.options)}
    return {"num_prompts": len(samples)}


def _served_model(base_url: str, api_key: str | None) -> str:
    from kvserve.bench.client import served_models

    models = served_models(base_url, api_key)
    if not models:
        raise ServerStartError(f"{base_url}/v1/models lists no model")
    return models[0]


def run_compare_cli(args: argparse.Namespace) -> int:
    return run_compare(args)
