"""An adversarial run against real `kvserve serve` processes: what an attacker or a careless user
tries, in categories, each counted with its outcomes and whether the server's guarantee held.

- auth: every route, path spelling, method, wrong key and spoofed Host (and two Authorization
  headers) against `--api-key` -> 401 each; then overload and n=128 under a tiny KV pool.
- bodies: ~190 malformed or absurd request bodies -> a 4xx with an OpenAI error body, or a 200
  where the value is valid; never a 5xx or a hang; the server healthy and drained after.
- floods: thousands of idle connections, trickled request heads, stalled bodies -> closed by the
  limits and timeouts; /health latency while flooded; each kind of closing logged once.
- large prompts: prompts just under the character limit whose clients leave -> a small request's
  latency against unloaded (median of several); bodies in flight past the bound -> 503; RSS.
- aborts and overload (benchmarks/scenarios.py) -> no 5xx, the pool drained after.
- signals: SIGTERM with streams in flight and requests waiting for the tokenizer -> SSE error
  events and 503 OpenAI bodies, exit within --shutdown-timeout plus a few seconds.
- model files and options: bad GGUF / config.json files and out-of-range options, each under a
  2 GiB address-space limit -> exit 2 with one line; peak RSS per process.
- router, disk tier, requests that look valid: the second round (issue 45), in
  benchmarks/adversarial_round2.py.

It reuses the reliability tests' helpers (tests/ on sys.path) and prints a table; the results go
to benchmarks/results/adversarial.json.

    python benchmarks/adversarial.py                    # the default model for the HTTP server
    python benchmarks/adversarial.py --skip model_files
    python benchmarks/adversarial.py --only router disk_tier requests
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from adversarial_bodies import all_cases  # noqa: E402
from scenarios import HealthMonitor, aborts, book_prompts, overload, read_metrics, wait_drained  # noqa: E402
from server_process import ServerProcess  # noqa: E402
from test_reliability_auth import protected_paths, raw_status, unauthorised_requests  # noqa: E402
from test_reliability_connections import open_connections, wait_closed_by_server  # noqa: E402
from test_reliability_fuzz import assert_openai_error  # noqa: E402
from test_reliability_model_files import build_cases, limit_memory  # noqa: E402
from test_reliability_shutdown import start_streams  # noqa: E402
from test_reliability_tokenization import latency, limits, send_and_leave  # noqa: E402
from tiny_models import build_tiny_model, build_tokenizer  # noqa: E402

KEY = "sk-adversarial-0123456789"
TIMEOUT_S = 60  # any answer slower than this is a hang
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, MAX_CONNECTIONS = 3, 3, 1000
IDLE_CONNECTIONS = 5000
DEFAULT_FLOOD = 15000  # against the default --max-connections (the file-descriptor limit minus a reserve)
SHUTDOWN_TIMEOUT_S = 2
LARGE_PROMPTS = 24  # prompts just under the character limit, sent at once, their clients leaving
WAITING_AT_SIGTERM = 40  # such prompts still queued for the tokenizer when SIGTERM comes
MAIN_ARGS = ["--max-model-len", "8192", "--kv-cache-memory", "256MiB", "--timeout-header", str(HEADER_TIMEOUT_S),
             "--timeout-body", str(BODY_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS)]
TINY_ARGS = ["--dtype", "float32", "--kv-cache-memory", "832KiB", "--max-model-len", "128"]


@dataclass
class Section:
    """One category: how many attempts, what came back, and whether every guarantee held."""

    name: str
    attempts: int = 0
    outcomes: dict = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)  # each guarantee that did not hold, in words
    seconds: float = 0.0

    def check(self, held: bool, what: str) -> None:
        if not held:
            self.broken.append(what)

    @property
    def held(self) -> bool:
        return not self.broken


def rss_mb(pid: int) -> dict[str, float]:
    """The process's resident set now and at its peak (VmHWM), in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss": int(fields["VmRSS"].split()[0]) / 1024, "peak": int(fields["VmHWM"].split()[0]) / 1024}


def count_in_log(server: ServerProcess, *needles: str) -> dict[str, int]:
    text = server.log_path.read_text(errors="replace")
    return {needle: text.count(needle) for needle in needles}


def healthy_and_drained(server: ServerProcess, headers: dict[str, str] | None = None) -> bool:
    if httpx.get(server.base_url + "/health", timeout=10).status_code != 200:
        return False
    return wait_drained(server.base_url, headers, timeout=30).drained


# --- auth (and a tiny pool) ---------------------------------------------------------------------

def run_auth(tiny: ServerProcess) -> Section:
    section = Section("auth")
    requests = unauthorised_requests(tiny.port, protected_paths(tiny.base_url, KEY), KEY)
    with ThreadPoolExecutor(8) as pool:
        statuses = Counter(pool.map(lambda r: raw_status(tiny.port, *r), requests))
    section.attempts = len(requests)
    section.outcomes = {"statuses": dict(statuses)}
    section.check(set(statuses) == {401}, f"not all 401: {dict(statuses)}")
    right = httpx.get(tiny.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    section.check(right.status_code == 200, f"the right key got {right.status_code}")
    return section


def run_tiny_pool(tiny: ServerProcess) -> Section:
    """Overload at the test's full size and one request with n=128 into a pool of ~1,700 tokens."""
    section = Section("tiny pool: overload + n=128")
    headers = {"Authorization": f"Bearer {KEY}"}
    result = asyncio.run(overload(tiny.base_url, book_prompts(1000, 14), 16, headers=headers))
    body = {"prompt": "It is a truth universally acknowledged", "n": 128, "max_tokens": 32, "ignore_eos": True}
    many = httpx.post(tiny.base_url + "/v1/completions", json=body, headers=headers, timeout=600)
    choices = many.json().get("choices", []) if many.status_code == 200 else []
    section.attempts = result.requests + 1
    section.outcomes = {"overload_statuses": dict(result.statuses), "overload_completed": result.completed,
                        "overload_s": round(result.wall_s, 1), "n128_status": many.status_code,
                        "n128_choices": len(choices)}
    section.check(result.num_failures == 0 and result.http_5xx == 0, f"overload: {result.failures[:3]}")
    section.check(len(choices) == 128, f"n=128: {many.status_code} {many.text[:200]}")
    section.check(healthy_and_drained(tiny, headers), "pool not drained after")
    return section


# --- malformed bodies -----------------------------------------------------------------------------

def vocab_size(server: ServerProcess) -> int:
    answer = httpx.post(server.base_url + "/v1/completions", json={"prompt": [10 ** 9]}, timeout=TIMEOUT_S)
    return int(answer.json()["error"]["message"].split("the model has ")[1].split(" ")[0])


def run_bodies(server: ServerProcess) -> Section:
    section = Section("malformed bodies")
    cases = all_cases(vocab_size(server))
    ok_values: dict[str, str] = {}

    def send(case) -> tuple[str, int | str, float]:
        name, path, body, headers = case
        start = time.monotonic()
        try:
            with httpx.stream("POST", server.base_url + path, content=body, timeout=TIMEOUT_S,
                              headers={"content-type": "application/json", **headers}) as response:
                if response.headers.get("content-type", "").startswith("text/event-stream"):
                    events = [line for _, line in zip(range(3), response.iter_lines())]
                    ok_values[name] = f"(streamed; first events {events[:1]!r})"
                    return name, response.status_code, time.monotonic() - start  # leaves mid-stream
                response.read()
        except httpx.HTTPError as exc:
            return name, type(exc).__name__, time.monotonic() - start
        try:
            assert_openai_error(response.status_code, response.headers.get("content-type", ""), response.content)
        except (AssertionError, ValueError, KeyError) as exc:
            return name, f"bad {response.status_code}: {str(exc)[:120]}", time.monotonic() - start
        if response.status_code == 200 and path in ("/v1/completions", "/v1/chat/completions"):
            choice = response.json()["choices"][0]
            ok_values[name] = choice.get("text", choice.get("message", {}).get("content"))
        return name, response.status_code, time.monotonic() - start

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, cases))
    statuses = Counter(status for _, status, _ in answers)
    section.attempts = len(cases)
    bad = [(name, status) for name, status, _ in answers if not isinstance(status, int) or status >= 500]
    greedy = httpx.post(server.base_url + "/v1/completions", timeout=TIMEOUT_S,
                        json={"prompt": "Hello", "max_tokens": 2, "temperature": 0}).json()["choices"][0]["text"]
    section.outcomes = {"statuses": {str(k): v for k, v in statuses.items()},
                        "slowest_answer_s": round(max(seconds for _, _, seconds in answers), 2),
                        "accepted_as_valid": sorted(ok_values),
                        "per_case": {name: status for name, status, _ in answers},
                        "temperature_1e-40_text_equals_greedy": ok_values.get("temperature 1e-40 (acts as greedy)")
                        == greedy}
    section.check(not bad, f"5xx, hang or non-OpenAI error body: {bad[:5]}")
    section.check(section.outcomes["temperature_1e-40_text_equals_greedy"], "temperature 1e-40 is not greedy")
    section.check(healthy_and_drained(server), "not healthy and drained after")
    return section


# --- floods and slow clients ----------------------------------------------------------------------

def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(f"the hard RLIMIT_NOFILE ({hard}) is below the {needed} the flood opens")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))


def health_latencies(server: ServerProcess, count: int) -> list[float]:
    seconds = []
    for _ in range(count):
        start = time.monotonic()
        status = httpx.get(server.base_url + "/health", timeout=TIMEOUT_S).status_code
        seconds.append(time.monotonic() - start if status == 200 else float("inf"))
    return seconds


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def trickle(port: int, count: int, budget_s: float) -> list[float]:
    """`count` connections that each send one byte of an endless request head every 0.2 s; the
    seconds after which the server closed each (inf: still open after `budget_s`)."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    closed_at = [float("inf")] * count
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < budget_s and any(t == float("inf") for t in closed_at):
        for i, sock in enumerate(sockets):
            if closed_at[i] == float("inf"):
                if closed_by_peer(sock):
                    closed_at[i] = time.monotonic() - start
                else:
                    try:
                        sock.send(head[step:step + 1])
                    except OSError:
                        closed_at[i] = time.monotonic() - start
        step += 1
        time.sleep(0.2)
    for sock in sockets:
        sock.close()
    return closed_at


def idle_flood(server: ServerProcess, count: int, header_timeout: float) -> dict:
    """Open `count` connections that send nothing (every 7th an unfinished request head), time
    /health while they are open, and wait until the server has closed them all."""
    raise_fd_limit(count + 500)
    unloaded = statistics.median(health_latencies(server, 5))
    start = time.monotonic()
    sockets = open_connections(server.port, count)
    for sock in sockets[::7]:
        try:
            sock.send(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        except OSError:
            pass
    flooded = health_latencies(server, 10)
    closed = wait_closed_by_server(sockets, timeout=header_timeout + 60)
    closed_s = time.monotonic() - start
    for sock in sockets:
        sock.close()
    return {"idle_connections": count, "idle_closed": closed, "idle_all_closed_after_s": round(closed_s, 1),
            "health_unloaded_ms": round(unloaded * 1000, 1),
            "health_flooded_ms_median": round(statistics.median(flooded) * 1000, 1),
            "health_flooded_ms_max": round(max(flooded) * 1000, 1)}


def run_floods(server: ServerProcess) -> Section:
    section = Section("floods and slow clients")
    idle = idle_flood(server, IDLE_CONNECTIONS, HEADER_TIMEOUT_S)
    trickled = trickle(server.port, 20, budget_s=HEADER_TIMEOUT_S + 20)
    stalled = []
    for _ in range(50):  # a request head, then a body that stops after a few bytes
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        stalled.append(sock)
    stall_start = time.monotonic()
    stalled_closed = wait_closed_by_server(stalled, timeout=BODY_TIMEOUT_S + 30)
    stalled_s = time.monotonic() - stall_start
    for sock in stalled:
        sock.close()
    log = count_in_log(server, f"connection limit ({MAX_CONNECTIONS}, --max-connections) reached",
                       "sent no complete request head within", "request body paused for more than",
                       "ERROR", "Traceback")
    section.attempts = IDLE_CONNECTIONS + len(trickled) + len(stalled)
    section.outcomes = {
        **idle, "trickled": len(trickled), "trickled_closed_after_s_max": round(max(trickled), 1),
        "stalled_bodies": len(stalled), "stalled_closed": stalled_closed,
        "stalled_all_closed_after_s": round(stalled_s, 1),
        "log_lines": log}
    check_idle_flood(section, idle)
    section.check(max(trickled) <= HEADER_TIMEOUT_S + 2, f"a trickled head stayed open {max(trickled):.1f} s")
    section.check(stalled_closed == len(stalled) and stalled_s <= BODY_TIMEOUT_S + 5,
                  f"{stalled_closed} of {len(stalled)} stalled bodies closed in {stalled_s:.1f} s")
    once = [n for needle, n in log.items() if needle not in ("ERROR", "Traceback")]
    section.check(all(n == 1 for n in once), f"closings not logged exactly once: {log}")
    section.check(log["ERROR"] == 0 and log["Traceback"] == 0, f"errors in the log: {log}")
    section.check(httpx.get(server.base_url + "/health", timeout=10).status_code == 200, "/health down after")
    return section


def check_idle_flood(section: Section, idle: dict) -> None:
    section.check(idle["idle_closed"] == idle["idle_connections"],
                  f"{idle['idle_closed']} of {idle['idle_connections']} idle connections closed")
    section.check(idle["health_flooded_ms_max"] < 5000, f"/health took up to {idle['health_flooded_ms_max']} ms")


def run_default_flood(server: ServerProcess) -> Section:
    """A larger flood against a server with the default connection limit and timeouts."""
    section = Section("flood, default limits")
    idle = idle_flood(server, DEFAULT_FLOOD, 10.0)
    log = count_in_log(server, "--max-connections) reached", "sent no complete request head within",
                       "ERROR", "Traceback")
    section.attempts = DEFAULT_FLOOD
    section.outcomes = {**idle, "log_lines": log}
    check_idle_flood(section, idle)
    section.check(log["--max-connections) reached"] <= 1 and log["sent no complete request head within"] == 1,
                  f"closings not logged once: {log}")
    section.check(log["ERROR"] == 0 and log["Traceback"] == 0, f"errors in the log: {log}")
    return section


# --- large prompts and bodies in flight -----------------------------------------------------------

def run_large_prompts(server: ServerProcess) -> Section:
    section = Section("large prompts, bodies in flight")
    _, max_chars = limits(server)
    for _ in range(3):
        latency(server.base_url)
    unloaded = statistics.median(latency(server.base_url) for _ in range(7))
    big = ("Elizabeth walked to Netherfield. " * (max_chars // 33 + 1))[: max_chars - 1]
    start = time.monotonic()
    one = httpx.post(server.base_url + "/v1/completions", json={"prompt": big, "max_tokens": 1}, timeout=TIMEOUT_S)
    one_s = time.monotonic() - start  # tokenizing one such prompt (a 400: over max-model-len tokens)
    senders = [threading.Thread(target=send_and_leave, args=(server.port, big, 0.5)) for _ in range(LARGE_PROMPTS)]
    for sender in senders:
        sender.start()
    time.sleep(0.3)
    loaded = statistics.median(latency(server.base_url) for _ in range(7))
    for sender in senders:
        sender.join()
    ratio = loaded / max(unloaded, 0.02)

    # 16 clients each upload a 30 MB prompt at once (under the 32 MiB body limit; far over the
    # character limit): at most 4 bodies are held (the default bound, 4 x 32 MiB), the rest get 503.
    memory_before = rss_mb(server.process.pid)
    huge = json.dumps({"prompt": "a" * 30_000_000, "max_tokens": 1}).encode()

    def upload(_) -> int:
        return httpx.post(server.base_url + "/v1/completions", content=huge, timeout=TIMEOUT_S,
                          headers={"content-type": "application/json"}).status_code

    with ThreadPoolExecutor(16) as pool:
        statuses = Counter(pool.map(upload, range(16)))
    memory_after = rss_mb(server.process.pid)
    section.attempts = 1 + LARGE_PROMPTS + 14 + 16
    section.outcomes = {"max_chars": max_chars, "one_large_prompt_status": one.status_code,
                        "one_large_prompt_s": round(one_s, 2), "large_prompts_left": LARGE_PROMPTS,
                        "small_unloaded_ms": round(unloaded * 1000, 1), "small_loaded_ms": round(loaded * 1000, 1),
                        "latency_ratio": round(ratio, 2), "uploads_30MB": 16,
                        "upload_statuses": {str(k): v for k, v in statuses.items()},
                        "rss_before_mb": round(memory_before["rss"]),
                        "rss_peak_before_mb": round(memory_before["peak"]),
                        "rss_peak_after_mb": round(memory_after["peak"]),
                        "rss_after_mb": round(memory_after["rss"])}
    section.check(ratio <= 3, f"a small request took {ratio:.1f}x its unloaded latency")
    section.check(set(statuses) <= {400, 503} and statuses[503] > 0, f"uploads: {dict(statuses)}")
    section.check(healthy_and_drained(server), "not healthy and drained after")
    return section


# --- aborts and overload --------------------------------------------------------------------------

def run_aborts_and_overload(server: ServerProcess) -> Section:
    section = Section("aborts and overload")
    before = read_metrics(server.base_url)
    with HealthMonitor(server.base_url) as health:
        storm = asyncio.run(aborts(server.base_url, book_prompts(100, 12, offset=5000), 64, abort_every=10))
        burst = asyncio.run(overload(server.base_url, book_prompts(256, 14), 32))
    state = wait_drained(server.base_url, timeout=30)
    preempted = "kvserve:num_preemptions_total"
    preemptions = read_metrics(server.base_url)[preempted] - before[preempted]
    section.attempts = storm.requests + burst.requests
    section.outcomes = {"streams": storm.requests, "clients_left": storm.aborted, "streams_completed": storm.completed,
                        "streams_s": round(storm.wall_s, 1), "burst": burst.requests,
                        "burst_completed": burst.completed, "burst_s": round(burst.wall_s, 1),
                        "http_5xx": storm.http_5xx + burst.http_5xx, "health_checks": health.checks,
                        "health_failures": len(health.failures), "health_slowest_s": round(health.max_latency_s, 2),
                        "preemptions": int(preemptions),
                        "free_blocks_after": f"{state.num_free_blocks}/{state.num_blocks}"}
    section.check(storm.num_failures == 0 and burst.num_failures == 0, f"{storm.failures[:2]} {burst.failures[:2]}")
    section.check(storm.http_5xx + burst.http_5xx == 0, "5xx answers")
    section.check(not health.failures, f"/health failed: {health.failures[:3]}")
    section.check(state.drained, f"pool not drained: {state}")
    return section


# --- signals ----------------------------------------------------------------------------------------

def run_sigterm(log_dir: Path, max_chars: int) -> Section:
    section = Section("SIGTERM with work in flight")
    server = ServerProcess.start(["--max-model-len", "8192", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)], log_dir)
    big = ("Mr. Darcy bowed. " * (max_chars // 17 + 1))[: max_chars - 1]
    waiting: list[httpx.Response | str] = []

    def post() -> None:
        try:
            waiting.append(httpx.post(server.base_url + "/v1/completions", json={"prompt": big, "max_tokens": 1},
                                      timeout=120))
        except httpx.HTTPError as exc:
            waiting.append(f"{type(exc).__name__}: {exc}")

    try:
        streams = start_streams(server, 4, max_tokens=4000)
        clients = [threading.Thread(target=post) for _ in range(WAITING_AT_SIGTERM)]
        for client in clients:
            client.start()
        time.sleep(0.5)
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=120)
        exit_s = time.monotonic() - start
        for client in clients:
            client.join(60)
        for stream in streams:
            stream.join()
    finally:
        server.stop()
    error_events = sum(1 for s in streams if s.done and '"error"' in s.events[-2])
    statuses = Counter(r.status_code if isinstance(r, httpx.Response) else r for r in waiting)
    openai_bodies = sum(1 for r in waiting if isinstance(r, httpx.Response)
                        and r.headers.get("content-type") == "application/json" and "error" in r.json())
    log = count_in_log(server, "Traceback")
    section.attempts = len(streams) + len(waiting)
    section.outcomes = {"shutdown_timeout_s": SHUTDOWN_TIMEOUT_S, "exit_code": code, "exit_s": round(exit_s, 1),
                        "streams": len(streams), "streams_with_error_event_and_done": error_events,
                        "waiting_for_tokenizer": len(waiting),
                        "waiting_statuses": {str(k): v for k, v in statuses.items()},
                        "openai_error_bodies": openai_bodies, "tracebacks": log["Traceback"]}
    section.check(code == 0, f"exit code {code}")
    section.check(exit_s <= SHUTDOWN_TIMEOUT_S + 5, f"exit took {exit_s:.1f} s")
    section.check(error_events == len(streams), f"{error_events} of {len(streams)} streams got an error event")
    section.check(set(statuses) <= {400, 503} and openai_bodies == len(waiting), f"waiting: {dict(statuses)}")
    section.check(log["Traceback"] == 0, "a traceback in the log")
    return section


# --- bad model files and options --------------------------------------------------------------------

def serve_once(argv: list[str]) -> tuple[int, str, float]:
    """Run `kvserve serve ARGV` under the 2 GiB address-space limit: (exit code, stderr, peak RSS MB).
    The peak is the child's VmHWM polled from /proc while it runs: getrusage's ru_maxrss for a child
    is no use here, as Linux carries the parent's high-water mark across fork and exec into it."""
    peak_kb = 0
    with tempfile.TemporaryFile() as err:
        process = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", *argv, "--port", "0"],
                                   stdout=subprocess.DEVNULL, stderr=err, preexec_fn=limit_memory)
        status = Path(f"/proc/{process.pid}/status")
        while process.poll() is None:
            try:
                hwm = next((line for line in status.read_text().splitlines() if line.startswith("VmHWM:")), None)
            except OSError:
                hwm = None
            if hwm is not None:
                peak_kb = max(peak_kb, int(hwm.split()[1]))
            time.sleep(0.02)
        err.seek(0)
        return process.returncode, err.read().decode(errors="replace"), peak_kb / 1024


def run_model_files(tmp: Path) -> Section:
    section = Section("bad model files and options")
    tokenizer = build_tokenizer()
    tiny = build_tiny_model(tmp / "tiny", "llama", tokenizer)
    mismatched = build_tiny_model(tmp / "tiny-vocab-256", "llama", tokenizer, vocab_size=256)
    cases = {name: [str(model)] for name, (model, _, _) in build_cases(tmp / "cases", tiny, mismatched).items()}
    for option in (["--max-num-seqs", "0"], ["--max-num-seqs", "-1"], ["--max-num-batched-tokens", "0"],
                   ["--block-size", "7"], ["--max-model-len", "0"], ["--kv-cache-memory", "-1"]):
        cases[" ".join(option)] = [str(tiny), *option]
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(cases, pool.map(serve_once, cases.values())))
    rows = {}
    for name, (code, stderr, peak) in results.items():
        lines = stderr.strip().splitlines()
        # argparse's own refusals (a value outside `choices`) print the usage block first, as usual.
        usage = bool(lines) and lines[0].startswith("usage:")
        lines = [line for line in lines if not (usage and (line.startswith("usage:") or line.startswith(" ")))]
        one_line = len(lines) == 1 and lines[0].startswith("kvserve serve: error: ")
        rows[name] = {"exit": code, "one_line": one_line, "usage_shown": usage, "peak_rss_mb": round(peak),
                      "message": lines[-1][:160] if lines else ""}
        section.check(code == 2 and one_line and "Traceback" not in stderr, f"{name}: exit {code}, {len(lines)} lines")
        section.check(peak < 2048, f"{name}: peak RSS {peak:.0f} MB")
    section.attempts = len(cases)
    section.outcomes = {"cases": rows, "max_peak_rss_mb": max(r["peak_rss_mb"] for r in rows.values())}
    return section


# --- the run ------------------------------------------------------------------------------------------

def summary(sections: list[Section]) -> str:
    rows = ["| category | attempts | held | seconds |", "|---|---|---|---|"]
    for s in sections:
        held = "yes" if s.held else "NO: " + "; ".join(s.broken)
        rows.append(f"| {s.name} | {s.attempts} | {held} | {s.seconds:.0f} |")
    return "\n".join(rows)


def machine() -> str:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{os.cpu_count()} vCPU {cpu}, Python {platform.python_version()}, torch {torch.__version__}"


SECTIONS = ("auth", "bodies", "floods", "large_prompts", "aborts", "sigterm", "model_files",
            "router", "disk_tier", "requests")  # the last three: adversarial_round2.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    parser.add_argument("--only", nargs="*", default=None, choices=SECTIONS)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "adversarial.json")
    args = parser.parse_args()
    run = [name for name in (args.only or SECTIONS) if name not in args.skip]
    sections: list[Section] = []
    started = time.monotonic()

    def timed(fn, *fn_args) -> None:
        start = time.monotonic()
        section = fn(*fn_args)
        section.seconds = time.monotonic() - start
        sections.append(section)
        print(f"{section.name}: {'held' if section.held else 'BROKEN ' + str(section.broken)} "
              f"({section.attempts} attempts, {section.seconds:.0f} s)\n  {json.dumps(section.outcomes)[:600]}",
              flush=True)

    with tempfile.TemporaryDirectory(prefix="kvserve-adversarial-") as tmp_name:
        tmp = Path(tmp_name)
        for name in ("tiny", "main", "sigterm"):
            (tmp / name).mkdir()
        if {"auth"} & set(run):
            tiny = ServerProcess.start([str(build_tiny_model(tmp / "tiny-model", "llama")), *TINY_ARGS,
                                        "--served-model-name", "tiny"], tmp / "tiny", env={"KVSERVE_API_KEY": KEY})
            try:
                timed(run_auth, tiny)
                timed(run_tiny_pool, tiny)
                if "floods" in run:
                    timed(run_default_flood, tiny)
            finally:
                tiny.stop()
        max_chars = 0
        if {"bodies", "floods", "large_prompts", "aborts", "sigterm"} & set(run):
            main_server = ServerProcess.start(MAIN_ARGS, tmp / "main")
            try:
                max_chars = limits(main_server)[1]
                for name, fn in (("bodies", run_bodies), ("floods", run_floods),
                                 ("large_prompts", run_large_prompts), ("aborts", run_aborts_and_overload)):
                    if name in run:
                        timed(fn, main_server)
                tracebacks = count_in_log(main_server, "Traceback")["Traceback"]
            finally:
                main_server.stop()
            print(f"main server log: {tracebacks} tracebacks", flush=True)
        if "sigterm" in run:
            timed(run_sigterm, tmp / "sigterm", max_chars)
        if "model_files" in run:
            timed(run_model_files, tmp)
        if {"router", "disk_tier", "requests"} & set(run):
            from adversarial_round2 import run_disk_tier, run_requests, run_router

            tiny_model = build_tiny_model(tmp / "tiny-model-round2", "llama")
            for name, fn, fn_args in (("router", run_router, (tmp / "router",)),
                                      ("disk_tier", run_disk_tier, (tmp / "disk_tier", tiny_model)),
                                      ("requests", run_requests, (tmp / "requests", tiny_model))):
                if name in run:
                    (tmp / name).mkdir(exist_ok=True)
                    timed(fn, *fn_args)

    table = summary(sections)
    print("\n" + table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "machine": machine(), "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                                      capture_output=True, text=True).stdout.strip(),
        "wall_s": round(time.monotonic() - started), "sections": [asdict(s) | {"held": s.held} for s in sections]},
        indent=1) + "\n")
    print(f"results: {args.output}")
    sys.exit(0 if all(s.held for s in sections) else 1)


if __name__ == "__main__":
    main()
