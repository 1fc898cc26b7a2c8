"""`kvserve bench throughput` / `latency` (offline, kvserve and HF transformers) and the decode
efficiency figures, on a tiny random Llama."""
import json

import pytest
import torch

from kvserve.bench.efficiency import (decode_flops, efficiency_report, kvserve_decode, matmul_params,
                                      measure_matmul_peak, measure_memory_bandwidth)
from kvserve.bench.hf_backend import HFGenerator, load_hf_model
from kvserve.bench.throughput import parse_backends
from kvserve.cli import main
from kvserve.llm import LLM

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_model_len=512)


def test_throughput_kvserve_and_hf_in_one_run(tiny_llama, tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = main(["bench", "throughput", "--model", str(tiny_llama), "--backend", "kvserve,hf", "--num-prompts", "6",
               "--random-input-len", "8:40", "--random-output-len", "3:9", "--hf-batch-size", "4",
               "--output-json", str(out), *ENGINE])
    printed = capsys.readouterr().out
    assert rc == 0
    assert printed.count("Throughput: ") == 2 and "kvserve / hf: " in printed
    data = json.loads(out.read_text())
    kv, hf = data["kvserve"], data["hf"]
    assert kv["num_requests"] == hf["num_requests"] == 6
    # both sides served the same requests, each to exactly its requested length
    assert kv["total_prompt_tokens"] == hf["total_prompt_tokens"]
    assert kv["total_output_tokens"] == hf["total_output_tokens"]
    assert 6 * 3 <= kv["total_output_tokens"] <= 6 * 9
    for r in (kv, hf):
        assert r["output_tokens_per_second"] == pytest.approx(r["total_output_tokens"] / r["elapsed_time"])
        assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"])


def test_latency_kvserve_and_hf(tiny_llama, tmp_path, capsys):
    out = tmp_path / "l.json"
    rc = main(["bench", "latency", "--model", str(tiny_llama), "--backend", "kvserve,hf", "--input-len", "8",
               "--output-len", "4", "--batch-size", "3", "--num-iters-warmup", "1", "--num-iters", "2",
               "--output-json", str(out), *ENGINE])
    printed = capsys.readouterr().out
    assert rc == 0 and "[kvserve] Avg latency:" in printed and "[hf] 99% percentile latency:" in printed
    data = json.loads(out.read_text())
    for backend in ("kvserve", "hf"):
        assert len(data[backend]["latencies"]) == 2
        assert data[backend]["avg_latency"] == pytest.approx(sum(data[backend]["latencies"]) / 2)


@pytest.mark.parametrize("argv, message", [
    (["bench", "throughput", "--backend", "kvserve,vllm"], "--backend takes a comma list"),
    (["bench", "throughput", "--backend", "hf", "--hf-batch-size", "0"], "--hf-batch-size must be at least 1"),
    (["bench", "latency", "--output-len", "0"], "--output-len must be at least 1"),
    (["bench", "throughput", "--num-prompts", "0"], "--num-prompts must be at least 1"),
    (["bench", "throughput", "--random-input-len", "9:3"], "a length range needs 0 <= MIN <= MAX"),
    (["bench", "throughput", "--dataset-name", "book", "--book-output-len", "x"], "a length must be N or MIN:MAX"),
])
def test_bad_offline_flags_fail_before_loading(capsys, monkeypatch, argv, message):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("kvserve.llm.LLM", no_loading)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_too_long_requests_are_refused_before_running(tiny_llama, capsys):
    rc = main(["bench", "throughput", "--model", str(tiny_llama), "--num-prompts", "2", "--random-input-len", "500",
               "--random-output-len", "100", *ENGINE])
    assert rc == 2 and "maximum context length is 512" in capsys.readouterr().err


def test_parse_backends():
    assert parse_backends("kvserve, hf") == ["kvserve", "hf"]
    with pytest.raises(ValueError):
        parse_backends("kvserve,kvserve")


def test_flop_count_matches_the_checkpoint(tiny_llm, tiny_llama):
    cfg = tiny_llm.engine.model_config
    hf = load_hf_model(str(tiny_llama), torch.float32, torch.device("cpu"))
    linear = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(cfg) == linear  # every projection and the lm_head, no embedding, no norms
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 100
    assert decode_flops(cfg, 100) == 2 * linear + attention


def test_kvserve_decode_times_only_decode_steps(tiny_llm):
    cfg = tiny_llm.engine.model_config
    run = kvserve_decode(tiny_llm, concurrency=3, prompt_len=10, steps=5, seed=1)
    assert run.tokens == 3 * 5  # the first token of each sequence comes from prefill and is not counted
    expected = 3 * sum(decode_flops(cfg, 10 + k) for k in range(1, 6))
    assert run.flops == pytest.approx(expected)
    assert run.seconds > 0 and not tiny_llm.engine.has_unfinished_requests()


def test_machine_measurements_are_plausible():
    cpu = torch.device("cpu")
    assert 1e8 < measure_matmul_peak(torch.float32, cpu, n=256, reps=2) < 1e14
    assert 1e8 < measure_memory_bandwidth(cpu, nbytes=8 * 2 ** 20, reps=2) < 1e13


def test_efficiency_report(tiny_llm, tiny_llama):
    hf = HFGenerator(load_hf_model(str(tiny_llama), torch.float32, torch.device("cpu")), pad_token_id=0)
    report = efficiency_report(tiny_llm, hf, concurrencies=(2, 4), prompt_len=8, steps=3, rounds=3)
    text = report.format()
    assert "Single-stream decode: kvserve" in text and ", hf " in text and "median of 3 side-by-side rounds" in text
    assert len(report.single_stream_rounds) == 3
    ratios = sorted(k / h for k, h in report.single_stream_rounds)
    assert report.single_stream_ratio == pytest.approx(ratios[1])
    assert report.single_stream_kvserve == pytest.approx(sorted(k for k, _ in report.single_stream_rounds)[1])
    assert "Decode at 4 concurrent:" in text and "of matmul peak" in text
    assert report.weight_bytes_per_token == matmul_params(tiny_llm.engine.model_config) * 4
    assert [c["concurrency"] for c in report.concurrent] == [2, 4]
    assert all(0 < c["share_of_peak"] == c["flops_per_s"] / report.matmul_peak_flops for c in report.concurrent)
    assert report.to_dict()["bandwidth_ceiling_tokens_per_s"] == pytest.approx(
        report.memory_bandwidth / report.weight_bytes_per_token)


def test_kvserve_decode_times_only_steps_that_hold_every_sequence(tiny_llama):
    """A prefill budget smaller than the prompts admits them over several steps, so they finish
    over several steps too: the timed tokens are those of the steps in which every sequence
    decoded (not the tail after the first one finishes)."""
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_model_len=64, max_num_batched_tokens=16)
    engine, step = llm.engine, llm.engine.step
    counts: dict[str, int] = {}
    full_steps = []

    def observed_step():
        outputs = step()
        decoded = [o for o in outputs if counts.get(o.request_id, 0) >= 1]
        full_steps.append(len(decoded) == 4)
        counts.update((o.request_id, len(o.outputs[0].token_ids)) for o in outputs)
        return outputs

    engine.step = observed_step
    run = kvserve_decode(llm, concurrency=4, prompt_len=10, steps=6, seed=1)
    assert not all(full_steps[-2:])  # the sequences did finish over several steps
    assert run.tokens == 4 * sum(full_steps), (run.tokens, full_steps)


def test_kvserve_decode_with_fewer_slots_than_sequences_times_the_steps_after_the_last_prefill(tiny_llama):
    """--max-num-seqs 2 for 4 sequences: they run in two waves and never decode all at once, so
    the steps after the last first token are timed (not nothing, not a division by zero)."""
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_model_len=64, max_num_seqs=2)
    run = kvserve_decode(llm, concurrency=4, prompt_len=10, steps=6, seed=1)
    assert 0 < run.tokens < 4 * 6 and run.seconds > 0 and run.tokens_per_s > 0
