"""The command line given bad input: a one-line error and exit 2, never a traceback, never a run
that goes wrong later (the review's findings: an abbreviated flag that `serve --data-parallel-size`
passed on to its replicas, an output path that is a directory, NaN and out-of-range numbers)."""
from __future__ import annotations

import argparse
import math

import pytest

import kvserve.plan.cli as plan_cli
from kvserve.bench.datasets import check_dataset_args
from kvserve.bench.metrics import parse_goodput
from kvserve.bench.serve import LoadConfig
from kvserve.cli import build_parser, main
from kvserve.engine.args import EngineArgs


@pytest.mark.parametrize("argv", [
    ["serve", "model", "--data-parallel", "2"],  # a replica read it as --data-parallel-size: replicas without end
    ["serve", "model", "--rout", "round_robin"],
    ["bench", "serve", "--request-time", "5"],
])
def test_abbreviated_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_an_os_error_is_one_line_and_exit_2(monkeypatch, capsys):
    def write_into_a_directory(args: argparse.Namespace) -> int:
        raise IsADirectoryError(21, "Is a directory", "/tmp")

    monkeypatch.setattr(plan_cli, "run_plan", write_into_a_directory)
    assert main(["plan"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "kvserve plan: error: Is a directory (/tmp)"


@pytest.mark.parametrize("argv, words", [
    (["top", "--interval", "nan", "http://127.0.0.1:9"], "--interval must be a positive number"),
    (["top", "--interval", "inf", "http://127.0.0.1:9"], "--interval must be a positive number"),
])
def test_top_refuses_an_interval_that_is_no_number_of_seconds(argv, words, capsys):
    assert main(argv) == 2 and words in capsys.readouterr().err


def test_numbers_that_are_nan_or_out_of_range_are_refused():
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput(["ttft:nan"])
    with pytest.raises(ValueError, match="--request-timeout"):
        LoadConfig(request_timeout=math.nan).validate()
    with pytest.raises(ValueError, match="--master-port must be a TCP port"):
        EngineArgs(model="x", master_port=99999).validate()
    args = argparse.Namespace(num_prompts=4, dataset_name="random", random_input_len="0", random_output_len="4",
                              random_range_ratio=0.0, random_prefix_len=0)
    with pytest.raises(ValueError, match="empty prompts"):
        check_dataset_args(args)


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "m", "--pooling-type", "MEAN"],  # only /v1/embeddings (serve) and LLM.embed pool
    ["chat", "--model", "m", "--pooling-type", "MEAN"],
    ["bench", "throughput", "--model", "m", "--pooling-type", "MEAN"],
])
def test_a_command_that_never_embeds_does_not_take_the_pooling_type(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2 and "unrecognized arguments: --pooling-type" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    # flags a run would otherwise accept and never read
    (["bench", "throughput", "--model", "m", "--dataset-path", "x.json"],
     "--dataset-path describes the sharegpt and book workloads, not --dataset-name random"),
    (["bench", "serve", "--model", "m", "--base-url", "http://127.0.0.1:9", "--dataset-path", "x.json"],
     "--dataset-path describes the sharegpt, book and multi-turn workloads, not --dataset-name random"),
    (["bench", "throughput", "--model", "m", "--dataset-name", "sharegpt", "--random-input-len", "64"],
     "--random-input-len describes the random workload, not --dataset-name sharegpt"),
    (["bench", "serve", "--model", "m", "--base-url", "http://127.0.0.1:9", "--multi-turn-turns", "3"],
     "--multi-turn-turns describes the multi-turn workload, not --dataset-name random"),
    (["bench", "serve", "--model", "m", "--base-url", "http://127.0.0.1:9", "--dataset-name", "multi-turn",
      "--book-input-len", "64"], "--book-input-len describes the book workload, not --dataset-name multi-turn"),
    (["bench", "throughput", "--model", "m", "--hf-batch-size", "8"], "--hf-batch-size is the HF backend's"),
    (["plan", "m", "--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization is the share of --gpu-memory"),
    (["plan", "m", "--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization is the share of --gpu-memory"),
    (["eval", "--model", "/nonexistent", "--no-passkey", "--passkey-trials", "5"],
     "--passkey-trials: passkey options, and --no-passkey skips"),
    (["eval", "--model", "/nonexistent", "--long-context", "--no-passkey", "--long-passkey-length", "500"],
     "--long-passkey-length: passkey"),
    (["generate", "--model", "m", "--master-port", "29500", "hi"], "--master-addr and --master-port are where "
                                                                   "tensor-parallel processes meet"),
])
def test_a_flag_the_run_would_not_read_is_refused(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_a_plot_path_without_a_suffix_is_written_as_png_and_reported_so(tmp_path):
    from kvserve.figures import pyplot, save_figure

    plt = pyplot()
    written = save_figure(plt.figure(), tmp_path / "sub" / "chart")
    assert written == tmp_path / "sub" / "chart.png" and written.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="is a directory"):
        save_figure(plt.figure(), tmp_path)


@pytest.mark.parametrize("argv", [["eval", "--model", "/nonexistent"], ["plan", "/nonexistent"]])
def test_a_chart_path_that_is_a_directory_is_refused_before_any_work(argv, tmp_path, capsys):
    assert main([*argv, "--plot", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
