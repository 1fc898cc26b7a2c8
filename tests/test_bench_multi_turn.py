"""`kvserve bench serve --dataset-name multi-turn` against a real tiny `kvserve serve`: every turn
resends the whole conversation (shared system prompt, earlier user messages and the server's own
answers) plus a U-token user message and gets exactly A tokens back; the report has per-turn
metrics and prefix hit rates by tier; bad options are one-line errors."""
import asyncio
import json
import re

import pytest
from fake_openai_server import FakeServer
from server_process import free_port

from kvserve.bench.client import ClientConfig
from kvserve.bench.datasets import load_tokenizer
from kvserve.bench.multi_turn import MultiTurnOptions, MultiTurnWorkload, build_multi_turn, count_prompt_tokens
from kvserve.bench.multi_turn_run import format_turn_table, per_turn, run_sessions, tier_hit_rates
from kvserve.bench.serve import LoadConfig
from kvserve.bench.server_metrics import parse_metrics, summarize
from kvserve.cli import main

SESSIONS, TURNS, SYSTEM, USER, ANSWER = 3, 3, 48, 12, 5


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(str(tiny_llama))


def test_every_turn_resends_the_whole_conversation(tiny_server, tokenizer):
    options = MultiTurnOptions(SESSIONS, TURNS, SYSTEM, USER, ANSWER)
    workload = build_multi_turn(tokenizer, options, seed=3)
    config = ClientConfig(tiny_server.base_url, "/v1/chat/completions", "tiny", ignore_eos=True)
    load = LoadConfig(progress=False, metrics_interval=0)
    run = asyncio.run(run_sessions(config, workload, load, lambda m: count_prompt_tokens(tokenizer, m)))
    assert run.sessions_cut_short == 0 and len(run.turns) == SESSIONS * TURNS
    n_tokens = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731

    assert n_tokens(workload.system_prompt) == SYSTEM
    for session in range(SESSIONS):
        turns = sorted((t for t in run.turns if t.session == session), key=lambda t: t.turn)
        assert [t.turn for t in turns] == list(range(1, TURNS + 1))
        answers = []
        for t in turns:
            assert t.result.success, t.result.error
            m = t.messages
            # system prompt (the same in every session), then k-1 exchanges, then the new user message
            assert m[0] == {"role": "system", "content": workload.system_prompt}
            assert [x["role"] for x in m[1:]] == ["user", "assistant"] * (t.turn - 1) + ["user"]
            users = [x["content"] for x in m[1::2]]
            assert users == workload.user_messages[session][:t.turn]
            assert all(n_tokens(u) == USER for u in users)
            assert [x["content"] for x in m[2::2]] == answers  # the server's own earlier answers, verbatim
            # the server saw exactly this conversation and answered with exactly ANSWER tokens
            assert t.result.prompt_len == count_prompt_tokens(tokenizer, m)
            assert t.result.output_tokens == ANSWER
            answers.append(t.result.generated_text)
    firsts = {workload.user_messages[s][0] for s in range(SESSIONS)}
    assert len(firsts) == SESSIONS  # each session has its own first user message


def test_cli_reports_per_turn_and_tier_hit_rates(tiny_server, tiny_llama, tmp_path, capsys):
    out = tmp_path / "multi.json"
    rc = main(["bench", "serve", "--base-url", tiny_server.base_url, "--tokenizer", str(tiny_llama),
               "--dataset-name", "multi-turn", "--multi-turn-sessions", "2", "--multi-turn-turns", str(TURNS),
               "--multi-turn-system-prompt-len", str(SYSTEM), "--multi-turn-user-len", str(USER),
               "--multi-turn-output-len", str(ANSWER), "--multi-turn-think-time", "0.01", "--num-warmups", "1",
               "--metrics-interval", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,99", "--save-result", str(out),
               "--plot", str(tmp_path / "plots")])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "Per turn (ms)" in printed and "Hit rate, host memory tier (%):" in printed
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {"latency_cdf.png", "throughput.png"}
    data = json.loads(out.read_text())
    assert data["dataset_name"] == "multi-turn" and data["endpoint"] == "/v1/chat/completions"
    assert data["completed"] == 2 * TURNS == data["num_prompts"] and data["failed"] == 0
    assert data["output_lens"] == [ANSWER] * (2 * TURNS)
    # per request, by session then turn (the same order in every run, so outputs compare across servers)
    assert data["sessions"] == [0] * TURNS + [1] * TURNS and data["turns"] == list(range(1, TURNS + 1)) * 2
    assert data["multi_turn"]["sessions_completed"] == 2
    rows = data["per_turn"]
    assert [r["turn"] for r in rows] == list(range(1, TURNS + 1))
    for row in rows:
        assert row["completed"] == 2 and row["mean_output_tokens"] == ANSWER
        for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p50_e2el_ms", "std_ttft_ms"):
            assert row[key] > 0
    # each turn's prompt is the previous one plus an answer and a user message
    inputs = [r["mean_input_tokens"] for r in rows]
    assert all(b > a + USER + ANSWER for a, b in zip(inputs, inputs[1:]))
    # from turn 2 on, the earlier turns' prompts come from the cache (the server's usage says so)
    assert all(r["cached_prompt_fraction"] > 0.5 for r in rows[1:])
    # later turns reuse the shared system prompt and the session's history from the pool
    rates = data["prefix_cache_hit_rate_by_tier"]
    assert rates["pool"] > 0.3 and rates["total"] >= rates["pool"]
    tiers = data["server_metrics"]
    if tiers.get("host_prefix_cache_hits") is None:  # a server without offload tiers
        assert rates["host"] is None and rates["disk"] is None
        assert re.search(r"Hit rate, host memory tier \(%\): +n/a", printed)


def test_tier_hit_rates_from_metric_deltas():
    page = """# TYPE kvserve:prefix_cache_queries counter
kvserve:prefix_cache_queries_total{{model_name="m"}} {q}
# TYPE kvserve:prefix_cache_hits counter
kvserve:prefix_cache_hits_total{{model_name="m"}} {h}
# TYPE kvserve:prefix_cache_tier_hits counter
{tiers}"""
    before = parse_metrics(page.format(q=100, h=10, tiers=""), 0.0)
    after = parse_metrics(page.format(q=1100, h=410, tiers='kvserve:prefix_cache_tier_hits_total{tier="host"} 300\n'
                                                          'kvserve:prefix_cache_tier_hits_total{tier="disk"} 100\n'),
                          1.0)
    rates = tier_hit_rates(summarize([before, after]))
    assert rates == pytest.approx({"pool": 0.4, "host": 0.3, "disk": 0.1, "total": 0.8})
    # a server without tier counters: pool only
    plain = [parse_metrics(page.format(q=q, h=h, tiers="").replace("# TYPE kvserve:prefix_cache_tier_hits counter",
                                                                     ""), t) for q, h, t in ((0, 0, 0), (10, 5, 1))]
    assert tier_hit_rates(summarize(plain)) == {"pool": 0.5, "host": None, "disk": None, "total": 0.5}


@pytest.mark.parametrize("flags, message", [
    (["--multi-turn-sessions", "0"], "--multi-turn-sessions must be at least 1, got 0"),
    (["--multi-turn-turns", "-2"], "--multi-turn-turns must be at least 1"),
    (["--multi-turn-user-len", "0"], "--multi-turn-user-len must be at least 1"),
    (["--multi-turn-output-len", "0"], "--multi-turn-output-len must be at least 1"),
    (["--multi-turn-system-prompt-len", "-1"], "--multi-turn-system-prompt-len must be at least 0"),
    (["--multi-turn-think-time", "-1"], "--multi-turn-think-time must be a non-negative number"),
    (["--multi-turn-think-time", "nan"], "--multi-turn-think-time must be a non-negative number"),
    (["--endpoint", "/v1/completions"], "multi-turn sends chat conversations: --endpoint must be"),
    (["--num-prompts", "100"], "--num-prompts does not apply to --dataset-name multi-turn"),
])
def test_bad_multi_turn_options_fail_in_one_line(tiny_llama, capsys, flags, message):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the options fail before any request
    rc = main(["bench", "serve", "--base-url", url, "--model", "m", "--tokenizer", str(tiny_llama),
               "--dataset-name", "multi-turn", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err


def test_multi_turn_is_not_an_offline_dataset(tiny_llama, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", "--model", str(tiny_llama), "--dataset-name", "multi-turn"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "invalid choice: 'multi-turn'" in err[-1]  # argparse's usage, then the error


def test_a_workload_longer_than_the_servers_context_fails_before_any_turn(tiny_server, tiny_llama, capsys):
    # the tiny server's max_model_len is 1024: 400 + 4 x (100 + 60) tokens cannot fit in the last turn
    rc = main(["bench", "serve", "--base-url", tiny_server.base_url, "--tokenizer", str(tiny_llama),
               "--dataset-name", "multi-turn", "--multi-turn-sessions", "1", "--multi-turn-turns", "4",
               "--multi-turn-system-prompt-len", "400", "--multi-turn-user-len", "100",
               "--multi-turn-output-len", "60", "--disable-tqdm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "last turn needs at least 1,040 tokens" in err[0] and "max_model_len is 1,024" in err[0]


def test_a_failed_turn_ends_its_session_and_is_reported(tiny_tokenizer):
    """The fake server answers 400 to a message containing FAIL: that session stops there (its
    later turns are not sent), the other session goes on, and the per-turn report says so; a turn
    with no completed request has no latencies (None, n/a) rather than zeros."""
    options = MultiTurnOptions(sessions=2, turns=3, system_prompt_len=4, user_len=3, output_len=2)
    users = [["a b c", "FAIL d e", "f g h"], ["i j k", "l m n", "FAIL o p"]]
    workload = MultiTurnWorkload(options, "the system prompt", users, [])
    with FakeServer() as url:
        config = ClientConfig(url, "/v1/chat/completions", "fake-model", ignore_eos=True)
        run = asyncio.run(run_sessions(config, workload, LoadConfig(progress=False, metrics_interval=0),
                                       lambda m: count_prompt_tokens(tiny_tokenizer, m), url + "/metrics"))
    assert run.sessions_cut_short == 2
    assert [(t.session, t.turn, t.result.success) for t in run.turns] == [
        (0, 1, True), (0, 2, False), (1, 1, True), (1, 2, True), (1, 3, False)]
    assert run.turns[1].result.error == "HTTP 400: fake failure requested"
    rows = per_turn(run, 3, 2, None, ["ttft"], [99])
    assert [(r["sent"], r["completed"], r["failed"], r["not_sent"]) for r in rows] == [
        (2, 2, 0, 0), (2, 1, 1, 0), (1, 0, 1, 1)]
    assert rows[1]["mean_ttft_ms"] > 0 and rows[1]["mean_output_tokens"] == 2
    assert rows[2]["mean_ttft_ms"] is None and rows[2]["mean_input_tokens"] is None
    assert rows[0]["cached_prompt_fraction"] is None  # the fake server reports no cached tokens
    assert format_turn_table(rows, ["ttft"], [99]).splitlines()[-1].split() == ["3", "0/1", "n/a", "n/a", "n/a", "n/a"]
