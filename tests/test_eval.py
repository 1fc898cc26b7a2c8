"""`kvserve eval`: scoring windows, the fidelity metrics, passkey prompts and scoring, the report,
and the command line, on a tiny random checkpoint."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kvserve.cli import main
from kvserve.eval import PasskeyConfig, ScoringConfig, evaluate
from kvserve.eval.passkey import FILLER, NEEDLE, build_prompt, make_prompts
from kvserve.eval.perplexity import FidelityMeter, make_windows
from kvserve.eval.report import plot, render_table, report_dict

SMALL_SCORING = ScoringConfig(num_tokens=48, context_len=32, score_len=24, chunk_size=8)
SMALL_PASSKEY = PasskeyConfig(lengths=(96, 160), depths=(0.0, 1.0), trials=1, max_tokens=4)


def test_windows_are_consecutive_and_sized():
    tokens = list(range(1000))
    windows = make_windows(tokens, ScoringConfig(num_tokens=50, context_len=10, score_len=20))
    assert windows == [tokens[0:30], tokens[30:60], tokens[60:90]]  # ceil(50 / 20) windows
    with pytest.raises(ValueError, match="the text has 1000 tokens"):
        make_windows(tokens, ScoringConfig(num_tokens=1000, context_len=10, score_len=20))
    with pytest.raises(ValueError, match="chunk-size must be positive"):
        ScoringConfig(chunk_size=0)


def test_fidelity_metrics_by_hand():
    reference = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), -1)
    other = torch.log_softmax(torch.tensor([[0.0, 2.0, 0.0], [0.0, 1.0, 0.0]]), -1)
    targets = torch.tensor([0, 1])
    meter = FidelityMeter()
    meter.add(other, targets, reference)
    result = meter.result()
    p = reference.exp()
    kl = ((p * (reference - other)).sum(-1)).mean().item()
    assert result.mean_kl == pytest.approx(kl)
    assert result.top1_agreement == 0.5  # argmax differs at the first position only
    assert result.perplexity == pytest.approx(math.exp(-(other[0, 0] + other[1, 1]).item() / 2))
    assert result.num_tokens == 2
    itself = FidelityMeter()
    itself.add(reference, targets, reference)
    assert itself.result().mean_kl == pytest.approx(0.0, abs=1e-7) and itself.result().top1_agreement == 1.0


def test_passkey_prompt_holds_the_key_at_the_requested_depth(tiny_tokenizer):
    unit = len(tiny_tokenizer.encode(FILLER))
    for depth in (0.1, 0.5, 0.9):
        ids = build_prompt(tiny_tokenizer, "48213", 1500, depth)
        text = tiny_tokenizer.decode(ids)
        needle = text.index(NEEDLE.format(key="48213"))
        assert abs(len(ids) - 1500) <= unit  # within one filler sentence group
        before, total = text[:needle].count("back again."), text.count("back again.")  # filler sentences
        assert total > 10 and abs(before / total - depth) <= 1 / total
        assert text.rstrip().endswith("The pass key is")
    first = make_prompts(tiny_tokenizer, PasskeyConfig(lengths=(128,), depths=(0.5,), trials=3, seed=7))
    again = make_prompts(tiny_tokenizer, PasskeyConfig(lengths=(128,), depths=(0.5,), trials=3, seed=7))
    assert [p.key for p in first] == [p.key for p in again]
    assert len({p.key for p in first}) == 3 and all(len(p.key) == 5 for p in first)
    with pytest.raises(ValueError, match="depths must lie in"):
        PasskeyConfig(depths=(1.5,))


@pytest.fixture(scope="module")
def tiny_report(tiny_llama):
    return evaluate(str(tiny_llama), ("auto", "int8", "int4"), scoring=SMALL_SCORING, passkey=SMALL_PASSKEY,
                    dtype="float32", kv_cache_memory="8MiB", max_model_len=512)


def test_evaluate_compares_against_the_first_dtype(tiny_report):
    auto, int8, int4 = tiny_report.results
    assert [r.kv_cache_dtype for r in tiny_report.results] == ["auto", "int8", "int4"]
    assert auto.format == "float32" and tiny_report.dtype == "float32"
    assert auto.fidelity.mean_kl == 0.0 and auto.fidelity.top1_agreement == 1.0 and auto.perplexity_increase == 0.0
    assert auto.fidelity.num_tokens == int8.fidelity.num_tokens == 48
    # The tiny model has 2 layers, 2 KV heads, head_dim 16: bytes per token, scales included.
    assert auto.bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert int8.bytes_per_token == 2 * 2 * 2 * (16 + 2)
    assert int4.bytes_per_token == 2 * 2 * 2 * (8 + 4)
    assert int8.capacity_ratio == pytest.approx(auto.bytes_per_token / int8.bytes_per_token)
    assert int8.tokens_per_gib == int(2 ** 30 // int8.bytes_per_token)
    # Coarser storage costs more: int4 drifts further from the reference than int8.
    assert 0 < int8.fidelity.mean_kl < int4.fidelity.mean_kl
    assert int8.fidelity.top1_agreement >= int4.fidelity.top1_agreement
    assert int8.perplexity_increase == pytest.approx(int8.fidelity.perplexity / auto.fidelity.perplexity - 1)
    for r in tiny_report.results:
        assert r.passkey.total == 4 and r.passkey.by_length.keys() == {96, 160}
        assert sum(t for _, t in r.passkey.by_length.values()) == 4


def test_report_table_json_and_plot(tiny_report, tmp_path):
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(render_table(tiny_report))
    text = console.export_text()
    for needle in ("auto (float32)", "int8", "int4", "passkey 96", "+0.00%"):
        assert needle in text
    data = json.loads(json.dumps(report_dict(tiny_report)))
    assert data["results"][1]["kv_cache_dtype"] == "int8"
    assert data["results"][1]["passkey"]["accuracy"] == tiny_report.results[1].passkey.accuracy
    path = plot(tiny_report, tmp_path / "chart.png")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"


def test_cli_json_and_plot(tiny_llama, tmp_path, capsys):
    chart = tmp_path / "eval.png"
    code = main(["eval", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-dtypes", "auto,fp8",
                 "--num-tokens", "16", "--context-len", "16", "--score-len", "16", "--chunk-size", "8",
                 "--no-passkey", "--json", "--plot", str(chart), "--output-json", str(tmp_path / "eval.json")])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "eval.json").read_text()) == data
    assert [r["kv_cache_dtype"] for r in data["results"]] == ["auto", "fp8"]
    assert data["results"][1]["format"] == "fp8_e4m3" and data["passkey"] is None
    assert chart.exists()


@pytest.mark.parametrize("argv,message", [
    (["--kv-cache-dtypes", "auto,int3"], "unknown KV cache dtype 'int3'"),
    (["--num-tokens", "100000000", "--no-passkey"], "use a longer text or fewer --num-tokens"),
    (["--text", "/nonexistent/book.txt"], "cannot read the evaluation text"),
    (["--passkey-lengths", "4000"], "lower --passkey-lengths"),
    (["--long-tokens", "500"], "--long-tokens: options of the long-context protocol, which needs --long-context"),
])
def test_cli_errors_are_one_line(tiny_llama, capsys, argv, message):
    argv = ["eval", "--model", str(tiny_llama), "--max-model-len", "1024", *argv]
    if "'int3'" in message:  # rejected by argparse itself
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    else:
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_weight_quantization_axis_compares_each_mode_with_the_first(tiny_llama):
    report = evaluate(str(tiny_llama), ("auto",), scoring=SMALL_SCORING, passkey=None, quantizations=("none", "int4"),
                      dtype="float32", kv_cache_memory="8MiB", max_model_len=512)
    reference, int4 = report.results
    assert (reference.quantization, int4.quantization) == ("none", "int4")
    assert reference.fidelity.mean_kl == 0 and int4.fidelity.mean_kl > 0
    assert int4.fidelity.perplexity != reference.fidelity.perplexity
    table = render_table(report)
    assert table.columns[0].header == "weights"
