"""`kvserve bench serve` against a fake OpenAI-compatible SSE server: streaming completions and
chat, failures counted with their errors, a server that is down, results and plots on disk."""
import asyncio
import json

import pytest
from fake_openai_server import FakeServer, free_port

from kvserve.bench.client import ClientConfig, error_message
from kvserve.bench.datasets import SampleRequest
from kvserve.bench.serve import LoadConfig, run_load
from kvserve.cli import main

QUIET = LoadConfig(progress=False, metrics_interval=0.02)


def samples(n: int, out: int = 6, fail_every: int = 0) -> list[SampleRequest]:
    return [SampleRequest(("FAIL " if fail_every and i % fail_every == 0 else "") + f"prompt number {i}", 3, out)
            for i in range(n)]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_requests_are_timed(endpoint):
    with FakeServer(delay=0.003) as url:
        config = ClientConfig(url, endpoint, "fake-model", ignore_eos=True)
        run = asyncio.run(run_load(config, samples(8, out=6), QUIET, url + "/metrics"))
    assert len(run.results) == 8 and all(r.success for r in run.results)
    for r in run.results:
        assert r.output_tokens == 6 and len(r.token_times) == 6 and len(r.itl) == 5
        assert r.generated_text == "w0 w1 w2 w3 w4 w5 "
        assert 0 < r.ttft <= r.latency
        assert r.prompt_len == 3  # the server's usage count (3 words) replaces the dataset's
        assert r.token_times == sorted(r.token_times)
    # /metrics was sampled, and once more after the last request: the fake server's counters
    # then hold every request (3 prompt words each, a third of them "hits")
    last = run.server_samples[-1]
    assert (last.prefix_queries, last.prefix_hits, last.running) == (24, 8, 0)


def test_max_concurrency_bounds_requests_in_flight():
    with FakeServer(delay=0.004) as url:
        config = ClientConfig(url, "/v1/completions", "fake-model")
        load = LoadConfig(max_concurrency=2, progress=False, metrics_interval=0)
        run = asyncio.run(run_load(config, samples(8, out=5), load))
    spans = [(r.start, r.start + r.latency) for r in run.results]
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert most <= 2 and all(r.success for r in run.results)


def test_server_errors_are_counted_with_their_message():
    with FakeServer() as url:
        config = ClientConfig(url, "/v1/completions", "fake-model")
        run = asyncio.run(run_load(config, samples(6, fail_every=2), QUIET))
    failed = [r for r in run.results if not r.success]
    assert len(failed) == 3
    assert all(r.error == "HTTP 400: fake failure requested" for r in failed)


def test_a_stalled_stream_fails_after_the_request_timeout():
    with FakeServer(delay=2.0) as url:
        config = ClientConfig(url, "/v1/completions", "fake-model")
        load = LoadConfig(progress=False, metrics_interval=0, request_timeout=0.3)
        run = asyncio.run(run_load(config, samples(1, out=3), load))
    [result] = run.results
    assert not result.success and result.error.startswith("timed out (no reply for 0.3 s) waiting for " + url)


async def read_request(reader: asyncio.StreamReader) -> bool:
    """One HTTP request read off a raw connection (headers and body, ignored); False at its end."""
    if not await reader.readline():
        return False
    length = 0
    while line := (await reader.readline()).strip():
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return True


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def run_against(handle, requests: list[SampleRequest], load: LoadConfig):
    """`run_load` against a raw asyncio server whose connections `handle` serves."""
    async def run():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            return await run_load(ClientConfig(url, "/v1/completions", "fake-model"), requests, load)

    return asyncio.run(run()).results


def test_events_split_across_reads_and_longer_than_a_read_buffer_are_read_whole():
    """A server may write an event in pieces, and an event may be larger than the client's read
    buffer (64 KiB): each is one chunk of text, timed when its last byte arrives."""
    long_text = "x" * 200_000
    events = [{"choices": [{"text": "a", "index": 0}]}, {"choices": [{"text": long_text, "index": 0}]},
              {"choices": [{"text": "b", "index": 0}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    pieces = [body[:9], body[9:40], body[40:70_000], body[70_000:]]  # cuts inside events and inside a line

    async def handle(reader, writer):
        await read_request(reader)
        writer.write(SSE_HEAD)
        for piece in pieces:
            writer.write(http_chunk(piece))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    [result] = run_against(handle, samples(1, out=3), LoadConfig(progress=False, metrics_interval=0))
    assert result.success, result.error
    assert result.generated_text == "a" + long_text + "b"
    assert result.output_tokens == 3 and len(result.token_times) == 3 and len(result.itl) == 2


def test_a_connection_is_kept_for_the_next_request_when_the_stream_ends_after_done():
    """The client reads past [DONE] to the response's end, so the server's keep-alive connection
    serves the next request (else each request would pay a new connection inside its TTFT)."""
    connections = []

    async def handle(reader, writer):
        connections.append(1)
        while await read_request(reader):
            writer.write(SSE_HEAD)
            for event in (b'data: {"choices": [{"text": "hi", "index": 0}]}\n\n', b"data: [DONE]\n\n"):
                writer.write(http_chunk(event))
            await writer.drain()
            await asyncio.sleep(0.05)  # the end of the body comes in a read of its own
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    load = LoadConfig(max_concurrency=1, progress=False, metrics_interval=0)
    results = run_against(handle, samples(3, out=1), load)
    assert all(r.success and r.generated_text == "hi" for r in results)
    assert len(connections) == 1
    # each is timed to its [DONE], which came in the same write as its text, not to the body's end 50 ms later
    assert all(r.start + r.latency - r.token_times[-1] < 0.025 for r in results)


def test_error_message_from_openai_body():
    assert error_message(400, b'{"error": {"message": "bad things", "type": "x"}}') == "HTTP 400: bad things"
    assert error_message(502, b"<html>gateway</html>") == "HTTP 502: <html>gateway</html>"


def test_cli_end_to_end_writes_vllm_json_and_plots(tiny_llama, tmp_path, capsys):
    out = tmp_path / "result.json"
    with FakeServer(delay=0.002) as url:
        rc = main(["bench", "serve", "--base-url", url, "--tokenizer", str(tiny_llama), "--num-prompts", "10",
                   "--random-input-len", "16", "--random-output-len", "5", "--request-rate", "200",
                   "--endpoint", "/v1/chat/completions", "--metrics-interval", "0.02", "--disable-tqdm",
                   "--goodput", "ttft:10000", "--percentile-metrics", "ttft,tpot,itl,e2el",
                   "--metric-percentiles", "50,99", "--save-result", str(out), "--plot", str(tmp_path / "plots")])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "============ Serving Benchmark Result ============" in printed
    assert "Request rate configured (RPS):           200.00" in printed
    data = json.loads(out.read_text())
    assert data["model_id"] == "fake-model"  # the first of /v1/models
    assert data["completed"] == 10 and data["failed"] == 0
    assert data["total_output_tokens"] == 50 and data["request_goodput"] == pytest.approx(data["request_throughput"])
    for key in ("mean_ttft_ms", "p99_itl_ms", "p50_tpot_ms", "median_e2el_ms", "output_throughput"):
        assert data[key] > 0
    assert data["server_metrics"]["num_samples"] >= 1
    assert "Client CPU (% of one core):" in printed and data["client_cpu_seconds"] > 0
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"latency_cdf.png", "throughput.png",
                                                                "server_timeline.png"}


def test_cli_counts_failures_and_exits_nonzero(tiny_llama, tmp_path, capsys):
    text = tmp_path / "fail.txt"
    text.write_text("FAIL " * 400)
    out = tmp_path / "r.json"
    with FakeServer() as url:
        rc = main(["bench", "serve", "--base-url", url, "--model", "fake-model", "--tokenizer", str(tiny_llama),
                   "--dataset-name", "book", "--dataset-path", str(text), "--book-input-len", "8",
                   "--num-prompts", "4", "--disable-tqdm", "--save-result", str(out)])
    captured = capsys.readouterr()
    assert rc == 1
    assert "Failed requests:                         4" in captured.out
    assert captured.err.strip().splitlines()[-1] == (
        "kvserve bench serve: error: 4 of 4 requests failed (4x: HTTP 400: fake failure requested)")
    assert json.loads(out.read_text())["errors"] == ["HTTP 400: fake failure requested"] * 4


def test_cli_server_down(tiny_llama, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rc = main(["bench", "serve", "--base-url", url, "--tokenizer", str(tiny_llama), "--num-prompts", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(f"kvserve bench: error: cannot reach the server at {url}")
    # with --model there is no /v1/models probe: every request fails, and says why
    rc = main(["bench", "serve", "--base-url", url, "--model", "m", "--tokenizer", str(tiny_llama),
               "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "2", "--disable-tqdm"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "Failed requests:                         3" in captured.out
    assert f"3 of 3 requests failed (3x: ClientConnectorError: Cannot connect to host {url[7:]}" in captured.err


@pytest.mark.parametrize("flags, message", [
    (["--endpoint", "/v1/embeddings"], "--endpoint must be"),
    (["--request-rate", "0"], "--request-rate must be positive"),
    (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
    (["--goodput", "itl:3"], "--goodput takes"),
    (["--random-range-ratio", "1.5"], "range-ratio"),
])
def test_cli_bad_flags_fail_in_one_line(tiny_llama, capsys, flags, message):
    url = f"http://127.0.0.1:{free_port()}"
    rc = main(["bench", "serve", "--base-url", url, "--model", "m", "--tokenizer", str(tiny_llama), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0]


def test_warmups_are_not_counted_and_must_not_all_fail():
    with FakeServer() as url:
        config = ClientConfig(url, "/v1/completions", "fake-model")
        load = LoadConfig(num_warmups=3, progress=False, metrics_interval=0)
        run = asyncio.run(run_load(config, samples(4), load))
        assert len(run.results) == 4 and all(r.success for r in run.results)
        with pytest.raises(ValueError, match="every warm-up request failed; the first error: HTTP 400"):
            asyncio.run(run_load(config, samples(2, fail_every=1), load))
