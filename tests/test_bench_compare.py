"""`kvserve bench compare`: servers started per configuration, one workload against each, the
comparison table / JSON / bar chart; end to end on real `kvserve serve` processes (tiny model)."""
import json
import sys
from pathlib import Path

import pytest

from kvserve.bench.compare import run_compare
from kvserve.cli import build_parser, main

FAKE_SERVER = str(Path(__file__).resolve().parent / "fake_openai_server.py")


def fake_server(port: int, args: list[str]) -> list[str]:
    return [sys.executable, FAKE_SERVER, "--port", str(port), *args]


def compare_args(tokenizer: Path, tmp_path: Path, *extra: str):
    argv = ["bench", "compare", "--tokenizer", str(tokenizer), "--num-prompts", "6", "--random-input-len", "12",
            "--random-output-len", "4", "--metrics-interval", "0.02", "--disable-tqdm",
            "--server-log-dir", str(tmp_path / "logs"), "--save-result", str(tmp_path / "cmp.json"),
            "--plot", str(tmp_path / "plots"), *extra]
    return build_parser().parse_args(argv)


def test_two_configs_end_to_end_on_fake_servers(tiny_llama, tmp_path, capsys):
    args = compare_args(tiny_llama, tmp_path, "--configs", "--delay 0.001", "--delay=0.01")
    assert run_compare(args, fake_server) == 0
    out = capsys.readouterr().out
    assert out.count("============ Serving Benchmark Result ============") == 2
    assert "Comparison (ratio to the first config)" in out
    data = json.loads((tmp_path / "cmp.json").read_text())
    assert [c["label"] for c in data["configs"]] == ["--delay 0.001", "--delay=0.01"]
    assert all(c["result"]["completed"] == 6 and c["result"]["failed"] == 0 for c in data["configs"])
    tpot = data["comparison"]["mean_tpot_ms"]
    assert tpot["--delay=0.01"] > tpot["--delay 0.001"]  # the slower server is measured slower
    first, second = data["configs"][0]["result"], data["configs"][1]["result"]
    assert first["input_lens"] == second["input_lens"]  # the same workload for both
    plots = {p.name for p in (tmp_path / "plots").iterdir()}
    assert {"compare_bars.png", "compare_kv_cache.png", "delay_0.001", "delay_0.01"} <= plots


def test_config_that_does_not_start_is_reported_and_others_still_run(tiny_llama, tmp_path, capsys):
    args = compare_args(tiny_llama, tmp_path, "--labels", "ok", "broken", "--configs", "--delay 0.001",
                        "--no-such-flag")
    assert run_compare(args, fake_server) == 1
    captured = capsys.readouterr()
    assert "broken: the server exited with code 2 before it was ready" in captured.err
    assert "unrecognized arguments: --no-such-flag" in captured.err
    data = json.loads((tmp_path / "cmp.json").read_text())
    assert data["configs"][0]["result"]["completed"] == 6 and data["configs"][1]["result"] is None


def test_config_file(tiny_llama, tmp_path, capsys):
    toml = tmp_path / "configs.toml"
    toml.write_text('server_args = "--kv-per-request 0.2"\n'
                    '[[configs]]\nlabel = "fast"\nargs = "--delay 0.001"\n'
                    '[[configs]]\nlabel = "slow"\nargs = "--delay 0.004"\n')
    assert run_compare(compare_args(tiny_llama, tmp_path, "--config-file", str(toml)), fake_server) == 0
    data = json.loads((tmp_path / "cmp.json").read_text())
    assert data["server_args"] == "--kv-per-request 0.2"
    assert [c["label"] for c in data["configs"]] == ["fast", "slow"]


@pytest.mark.parametrize("extra, message", [
    (["--configs", "--delay 0.001", "--num-prompts", "3"], "--configs takes the rest of the command line"),
    ([], "give the configurations to compare"),
    (["--labels", "a", "b", "--configs", "--delay 0.001"], "--labels names 2 configs but there are 1"),
])
def test_bad_configurations_fail_in_one_line(tiny_llama, tmp_path, capsys, extra, message):
    argv = ["bench", "compare", "--tokenizer", str(tiny_llama), "--num-prompts", "2", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_prefix_caching_before_after_on_real_kvserve_servers(tiny_llama, tmp_path, capsys):
    """The seed's before/after matrix, tiny: prefix caching off vs on, on a prefix-heavy workload
    (the servers demand an API key, which compare takes from their flags)."""
    argv = ["bench", "compare", "--dataset-name", "prefix-repetition", "--num-prompts", "8",
            "--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len", "8",
            "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "4", "--max-concurrency", "2",
            "--metrics-interval", "0.05", "--disable-tqdm", "--server-timeout", "300",
            "--server-args",
            f"--model {tiny_llama} --dtype float32 --kv-cache-memory 16MiB --max-model-len 256 --api-key sesame",
            "--save-result", str(tmp_path / "cmp.json"),
            "--configs", "--no-enable-prefix-caching", "--enable-prefix-caching"]
    assert main(argv) == 0, capsys.readouterr().err
    data = json.loads((tmp_path / "cmp.json").read_text())
    off, on = (c["result"] for c in data["configs"])
    assert off["completed"] == on["completed"] == 8 and off["total_output_tokens"] == 32
    assert off["model_id"] == str(tiny_llama)
    assert (on["server_metrics"]["prefix_cache_hit_rate"] or 0) > 0.3
    assert not off["server_metrics"]["prefix_cache_hit_rate"]


def test_multi_turn_workload_on_fake_servers(tiny_llama, tmp_path, capsys):
    """`--dataset-name multi-turn` goes through compare too: each configuration runs the same
    sessions and reports them per turn."""
    argv = ["bench", "compare", "--tokenizer", str(tiny_llama), "--dataset-name", "multi-turn",
            "--multi-turn-sessions", "2", "--multi-turn-turns", "2", "--multi-turn-system-prompt-len", "16",
            "--multi-turn-user-len", "8", "--multi-turn-output-len", "3", "--metrics-interval", "0",
            "--disable-tqdm", "--server-log-dir", str(tmp_path / "logs"), "--save-result", str(tmp_path / "cmp.json"),
            "--configs", "--delay 0.001", "--delay 0.002"]
    assert run_compare(build_parser().parse_args(argv), fake_server) == 0
    assert capsys.readouterr().out.count("Per turn (ms)") == 2
    data = json.loads((tmp_path / "cmp.json").read_text())
    for config in data["configs"]:
        result = config["result"]
        assert result["endpoint"] == "/v1/chat/completions" and result["completed"] == 4
        assert [row["turn"] for row in result["per_turn"]] == [1, 2]
        assert result["generated_texts"] == ["w0 w1 w2 "] * 4
