"""The second adversarial round (issue 45), run by benchmarks/adversarial.py as three sections:

- router: a `kvserve router` over two default-model replicas, attacked with trickled request heads,
  an idle-connection flood, abandoned 30 MB bodies and JSON nested 10,000 deep, then with a replica
  frozen (SIGSTOP) and one killed while each answers a request -> a small request's latency through
  the router behind each attack against its latency alone; 502 (not 500, not a hang) for the
  failing replica's request; nothing else lost; no traceback or descriptor error in the log.
- disk tier: a server with `--kv-offloading-disk-key auto` whose stored blocks are then forged
  (CRC recomputed), replaced by FIFOs and by links to a 10 MB file, its directory made
  world-writable -> restarted, the same outputs, no hang, the directory 0700 again, the link
  target uncounted; the same forgery without a key, for comparison.
- requests: top_p 1e-46, a regex of 10^6 unrolled characters, 200,000 unknown keys, a body of 180
  prompts of 164k characters sent and abandoned three times, a chat template with nested
  range(100000) loops -> the documented 200 or 400 each, a small request's latency behind them,
  the log's longest line.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx

from adversarial import KEY, TIMEOUT_S, Section, count_in_log, raise_fd_limit, trickle  # noqa: F401
from router_process import RouterProcess
from server_process import ServerProcess
from test_disk_tier_trust import forge
from test_kv_tiers_server import SERVER_ARGS as TINY_TIER_ARGS, run_workload
from test_reliability_connections import open_connections, wait_closed_by_server
from test_template_budget import HOSTILE, with_template

SMALL = {"prompt": "Hello, my name is", "max_tokens": 1, "temperature": 0}
REPLICA_ARGS = ["--max-model-len", "8192", "--kv-cache-memory", "256MiB"]
HEADER_TIMEOUT_S = 3
RATIO_LIMIT = 2.0  # a small request behind an attack, against alone


def small_latency(base_url: str, count: int = 7) -> float:
    """Median seconds of `count` small greedy completions (each must be a 200)."""
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        response = httpx.post(base_url + "/v1/completions", json=SMALL, timeout=TIMEOUT_S)
        if response.status_code != 200:
            raise RuntimeError(f"a small request got {response.status_code}: {response.text[:200]}")
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def post_and_leave(port: int, body: bytes, leave_after: float) -> None:
    """Send a whole completions body, then close the connection before the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(leave_after)


def behind(base_url: str, attack) -> float:
    """The small-request median while `attack()` runs on threads (it returns them, started)."""
    threads = attack()
    time.sleep(0.3)
    loaded = small_latency(base_url, 5)
    for thread in threads:
        thread.join()
    return loaded


def started(*threads: threading.Thread) -> list[threading.Thread]:
    for thread in threads:
        thread.start()
    return list(threads)


# --- router ---------------------------------------------------------------------------------------

def failing_backend(router: RouterProcess, replicas: list[ServerProcess], how: signal.Signals) -> dict:
    """A long non-streaming request; its replica gets `how`; the status and seconds until the
    router answered after the signal."""
    result: dict = {}
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}

    def long_request() -> None:
        try:
            response = httpx.post(router.base_url + "/v1/completions", json=body, timeout=120)
            result["status"], result["answered_at"] = response.status_code, time.monotonic()
            result["message"] = response.json().get("error", {}).get("message", "")[:120]
        except httpx.HTTPError as exc:
            result["status"], result["answered_at"] = type(exc).__name__, time.monotonic()

    thread = started(threading.Thread(target=long_request))[0]
    deadline = time.monotonic() + 30
    while not any(b["in_flight"] for b in router.state()["backends"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    busy = next(b for b in router.state()["backends"] if b["in_flight"])
    victim = next(r for r in replicas if r.base_url == busy["url"])
    time.sleep(0.5)
    victim.process.send_signal(how)
    signalled = time.monotonic()
    thread.join(120)
    return {"status": result.get("status", "no answer"), "message": result.get("message", ""),
            "answered_after_signal_s": round(result.get("answered_at", float("inf")) - signalled, 1),
            "victim": victim}


def run_router(tmp: Path) -> Section:
    section = Section("router (issue 45)")
    replicas = [ServerProcess.start(REPLICA_ARGS, _fresh(tmp / name), wait=False) for name in ("a", "b")]
    for replica in replicas:
        replica.wait_healthy()
    router = RouterProcess.start([r.base_url for r in replicas], _fresh(tmp / "router"), "--timeout-header",
                                 str(HEADER_TIMEOUT_S), "--timeout-body", "3", "--max-connections", "1000")
    outcomes: dict = {}
    try:
        router.wait_until(lambda s: s["tokenizer_loaded"] and all(b["up"] for b in s["backends"]), timeout=60)
        url = router.base_url
        small_latency(url, 3)
        alone = small_latency(url)
        outcomes["small_alone_ms"] = round(alone * 1000, 1)

        trickled = trickle(router.port, 20, budget_s=HEADER_TIMEOUT_S + 20)
        outcomes["trickled_heads_closed_after_s_max"] = round(max(trickled), 1)
        section.check(max(trickled) <= HEADER_TIMEOUT_S + 2, f"a trickled head stayed open {max(trickled):.1f} s")

        raise_fd_limit(5000 + 500)
        sockets = open_connections(router.port, 5000)
        flooded = small_latency(url, 5)
        closed = wait_closed_by_server(sockets, timeout=HEADER_TIMEOUT_S + 60)
        for sock in sockets:
            sock.close()
        outcomes["idle_flood"] = {"connections": 5000, "closed_by_router": closed,
                                  "small_ms": round(flooded * 1000, 1), "ratio": round(flooded / alone, 2)}
        section.check(closed == 5000, f"{closed} of 5000 idle connections closed")

        huge = json.dumps({"prompt": "a" * 30_000_000, "max_tokens": 1}).encode()
        loaded = behind(url, lambda: started(*(threading.Thread(target=post_and_leave, args=(router.port, huge, 0.5))
                                               for _ in range(3))))
        outcomes["abandoned_30MB_bodies"] = {"bodies": 3, "small_ms": round(loaded * 1000, 1),
                                             "ratio": round(loaded / alone, 2)}

        deep = b'{"prompt": "x", "user": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
        nested = httpx.post(url + "/v1/completions", content=deep, headers={"content-type": "application/json"},
                            timeout=TIMEOUT_S)
        outcomes["json_nested_10000_deep"] = nested.status_code
        section.check(nested.status_code == 400, f"deep JSON: {nested.status_code}")

        frozen = failing_backend(router, replicas, signal.SIGSTOP)
        frozen["victim"].process.send_signal(signal.SIGCONT)
        router.wait_until(lambda s: all(b["up"] for b in s["backends"]), timeout=60, what="the frozen replica back")
        killed = failing_backend(router, replicas, signal.SIGKILL)
        for name, case in (("frozen_replica", frozen), ("killed_replica", killed)):
            case.pop("victim")
            outcomes[name] = case
            section.check(case["status"] == 502, f"{name}: {case['status']}")
            section.check(case["answered_after_signal_s"] <= 15, f"{name}: answered after {case['answered_after_signal_s']} s")
        after = small_latency(url)  # on the surviving replica
        outcomes["small_after_ms"] = round(after * 1000, 1)
        for name in ("idle_flood", "abandoned_30MB_bodies"):
            section.check(outcomes[name]["ratio"] <= RATIO_LIMIT, f"{name}: {outcomes[name]['ratio']}x alone")
        log = count_in_log(router, "Traceback", "Too many open files", "ERROR")
        outcomes["router_log"] = log
        section.check(not any(log.values()), f"router log: {log}")
        section.attempts = 20 + 5000 + 3 + 1 + 2
    finally:
        router.stop()
        for replica in replicas:
            replica.stop()
    section.outcomes = outcomes
    return section


# --- disk tier ------------------------------------------------------------------------------------

def run_disk_tier(tmp: Path, tiny_model: Path) -> Section:
    section = Section("disk tier trust (issue 45)")
    outcomes: dict = {}
    secret = tmp / "ten-megabytes"
    secret.write_bytes(b"s" * 10_000_000)
    for keyed in (True, False):
        kv = tmp / f"kv-{'key' if keyed else 'crc'}"
        args = [str(tiny_model), *TINY_TIER_ARGS, "--kv-offloading-disk-path", str(kv), "--kv-offloading-disk-size",
                "0.01", *(["--kv-offloading-disk-key", "auto"] if keyed else [])]
        first = ServerProcess.start(args, _fresh(tmp / f"first-{keyed}"))
        try:
            expected = run_workload(first)
        finally:
            first.stop()
        files = sorted(kv.rglob("*.kvb"))
        for path in files:
            forge(path, 0)  # a payload of its own with its CRC-32 recomputed
        plain_forged = len(files)
        if keyed:  # the other kinds of planted file, and a directory others can write
            for i, path in enumerate(files[: len(files) // 2]):
                path.unlink()
                os.mkfifo(path) if i % 2 else path.symlink_to(secret)
            kv.chmod(0o777)
        second = ServerProcess.start(args, _fresh(tmp / f"second-{keyed}"))
        try:
            start = time.monotonic()
            got = run_workload(second)
            workload_s = time.monotonic() - start
            used = httpx.get(second.base_url + "/dashboard/state", timeout=10).json()["kv_offload_tiers"]
        finally:
            second.stop()
        wrong = sum(a != b for a, b in zip(got, expected))
        log = count_in_log(second, "fails its authentication tag", "carries no authentication tag",
                           "is not a regular file", "symbolic link", "writable by other users", "Traceback")
        row = {"block_files": len(files), "forged_crc": plain_forged, "outputs": len(got), "outputs_wrong": wrong,
               "workload_s": round(workload_s, 1), "exit_code": second.process.returncode, "log": log}
        if keyed:
            row["dir_mode_after"] = oct(kv.stat().st_mode & 0o777)
            row["disk_used_bytes"] = used["disk_used_bytes"]
            section.check(wrong == 0, f"with a key, {wrong} of {len(got)} outputs wrong")
            section.check(kv.stat().st_mode & 0o777 == 0o700, "the directory was left world-writable")
            section.check(used["disk_used_bytes"] < 10_000_000, "a link's target counted in the tier's bytes")
            section.check(log["Traceback"] == 0 and second.process.returncode == 0, f"log {log}")
        outcomes["with_key" if keyed else "crc32_only"] = row
        section.attempts += len(files)
    section.outcomes = outcomes
    return section


def _fresh(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


# --- requests that look valid ----------------------------------------------------------------------

def run_requests(tmp: Path, tiny_model: Path) -> Section:
    section = Section("requests that look valid (issue 45)")
    server = ServerProcess.start(REPLICA_ARGS, _fresh(tmp / "requests"))
    outcomes: dict = {}
    try:
        url = server.base_url
        small_latency(url, 3)
        alone = small_latency(url)
        outcomes["small_alone_ms"] = round(alone * 1000, 1)
        tiny_p = httpx.post(url + "/v1/completions", timeout=TIMEOUT_S, json={
            "prompt": "The capital of France is", "max_tokens": 4, "top_p": 1e-46, "seed": 1}).json()
        greedy = httpx.post(url + "/v1/completions", timeout=TIMEOUT_S, json={
            "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).json()
        outcomes["top_p_1e-46_equals_greedy"] = tiny_p["choices"][0]["text"] == greedy["choices"][0]["text"]
        section.check(outcomes["top_p_1e-46_equals_greedy"], f"top_p 1e-46: {tiny_p}")

        regex = httpx.post(url + "/v1/completions", timeout=TIMEOUT_S, json={
            "prompt": "x", "max_tokens": 4, "guided_regex": "(a{1000}){1000}"})
        outcomes["regex_status"] = regex.status_code
        section.check(regex.status_code == 400, f"regex: {regex.status_code}")

        keys = {f"k{i}": i for i in range(200_000)}
        unknown = httpx.post(url + "/v1/completions", timeout=TIMEOUT_S, json={**SMALL, **keys})
        outcomes["unknown_keys_status"] = unknown.status_code
        section.check(unknown.status_code == 200, f"unknown keys: {unknown.status_code}")

        many = json.dumps({"prompt": ["word " * 32_800] * 180, "max_tokens": 1}).encode()
        loaded = behind(url, lambda: started(*(threading.Thread(target=post_and_leave, args=(server.port, many, 0.5))
                                               for _ in range(3))))
        outcomes["abandoned_180_prompt_bodies"] = {"body_mb": round(len(many) / 1e6, 1), "small_ms":
                                                   round(loaded * 1000, 1), "ratio": round(loaded / alone, 2)}
        section.check(loaded / alone <= RATIO_LIMIT, f"behind 180-prompt bodies: {loaded / alone:.1f}x alone")
        longest = max(len(line) for line in server.log_path.read_text(errors="replace").splitlines())
        outcomes["longest_log_line_chars"] = longest
        section.check(longest < 10_000, f"a log line of {longest} characters")
        section.check(count_in_log(server, "Traceback")["Traceback"] == 0, "a traceback in the log")
    finally:
        server.stop()
    template = with_template(tiny_model, tmp / "hostile-template", HOSTILE["nested loops"])
    hostile = ServerProcess.start([str(template), "--dtype", "float32", "--max-model-len", "128"],
                                  _fresh(tmp / "template"))
    try:
        start = time.monotonic()
        chat = httpx.post(hostile.base_url + "/v1/chat/completions", timeout=TIMEOUT_S,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        outcomes["nested_loop_template"] = {"status": chat.status_code, "seconds": round(time.monotonic() - start, 1)}
        section.check(chat.status_code == 400, f"template: {chat.status_code}")
        section.check(httpx.post(hostile.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                                 timeout=TIMEOUT_S).status_code == 200, "the server stopped answering after it")
    finally:
        hostile.stop()
    shutil.rmtree(template, ignore_errors=True)
    section.attempts = 7
    section.outcomes = outcomes
    return section
