"""`kvserve router` under abuse and failing backends, as real processes: the router over a stand-in
backend (tests/fake_backend.py) that can hang, die or freeze on cue. The router holds connections
as `kvserve serve` does (header timeout, a connection limit under its descriptor limit), ends a
request whose backend dies, freezes or passes the deadline with a 502 or 504 at once, refuses
unparseable nesting itself, and tokenizes only a prompt's routing prefix."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvserve.router.prompt_hashes import ROUTING_PREFIX_CHARS
from kvserve.server.connections import install_loop_error_throttle
from router_process import RouterProcess
from server_process import free_port, stop_process

HANG_BOUND_S = 30  # an answer slower than this is a hang


class FakeBackend:
    def __init__(self, log_dir: Path, *options: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / "backend.log", "wb")
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).parent / "fake_backend.py"), str(self.port),
                                         *options], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and self.process.poll() is None, "the fake backend did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
        stop_process(self.process)
        self.log.close()


@pytest.fixture
def backend(tmp_path):
    fake = FakeBackend(tmp_path)
    yield fake
    fake.stop()


def start_router(backend: FakeBackend, log_dir: Path, *args: str, max_fds: int | None = None) -> RouterProcess:
    router = RouterProcess.start([backend.url], log_dir, "--routing-policy", "least_loaded", *args, max_fds=max_fds)
    router.wait_until(lambda s: all(x["up"] for x in s["backends"]), timeout=30, what="the backend up")
    return router


def post(router: RouterProcess, body: dict | bytes, timeout: float = HANG_BOUND_S) -> httpx.Response:
    content = body if isinstance(body, bytes) else None
    return httpx.post(f"{router.base_url}/v1/completions", json=None if content else body, content=content,
                      headers={"content-type": "application/json"}, timeout=timeout)


def assert_openai_error(response: httpx.Response, status: int, fragment: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] and fragment in error["message"], error


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(4096) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


def test_a_request_head_that_never_completes_is_closed(backend, tmp_path):
    router = start_router(backend, tmp_path, "--timeout-header", "1")
    try:
        with socket.create_connection(("127.0.0.1", router.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            assert closed_by_peer(sock, within_s=10)
        assert post(router, {"prompt": "hi"}).status_code == 200
    finally:
        router.stop()


def test_an_idle_connection_flood_leaves_the_router_answering_with_a_short_log(backend, tmp_path):
    # 256 descriptors: the default limit is (256 - 128 reserved) / 2 client connections. A flood of
    # three times as many idle connections closes the oldest idle ones instead of exhausting them.
    router = start_router(backend, tmp_path, max_fds=256)
    idle = []
    try:
        for _ in range(200):
            idle.append(socket.create_connection(("127.0.0.1", router.port)))
        time.sleep(1)
        assert httpx.get(f"{router.base_url}/health", timeout=HANG_BOUND_S).status_code == 200
        assert post(router, {"prompt": "after the flood"}).json()["choices"][0]["text"] == "15"
        closed = sum(closed_by_peer(sock, within_s=0.01) for sock in idle)
        assert closed >= 200 - 64
    finally:
        for sock in idle:
            sock.close()
        router.stop()
    log = router.log_path.read_text()
    assert "Too many open files" not in log and "Traceback" not in log, log[-3000:]
    assert log.count("connection limit (64, --max-connections) reached") == 1, log[-3000:]


def test_a_backend_that_dies_while_answering_is_a_502(backend, tmp_path):
    router = start_router(backend, tmp_path)
    try:
        assert_openai_error(post(router, {"prompt": "die"}), 502, "failed before answering")
    finally:
        router.stop()


def test_a_frozen_backend_ends_the_request_in_flight_with_a_502_once_it_is_taken_out(backend, tmp_path):
    """...and the router's own calls to it (its /metrics page, /v1/models) give up on it too."""
    router = start_router(backend, tmp_path)
    try:
        result = {}
        thread = threading.Thread(target=lambda: result.update(response=post(router, {"prompt": "slow:120"})))
        thread.start()
        time.sleep(0.5)
        backend.process.send_signal(signal.SIGSTOP)  # alive, silent: its health checks time out
        frozen_at = time.monotonic()
        side = {}
        calls = [threading.Thread(target=lambda p=p: side.update({p: httpx.get(f"{router.base_url}{p}",
                                                                              timeout=HANG_BOUND_S)}))
                 for p in ("/metrics", "/v1/models")]
        for call in calls:
            call.start()
        thread.join(HANG_BOUND_S)
        assert not thread.is_alive(), "the request on the frozen backend still had no answer"
        assert_openai_error(result["response"], 502, "taken out of service")
        assert router.state()["backends"][0]["up"] is False
        assert time.monotonic() - frozen_at < HANG_BOUND_S
        for call in calls:
            call.join(HANG_BOUND_S)
        assert side["/metrics"].status_code == 200 and side["/v1/models"].status_code == 503, side
    finally:
        router.stop()


def test_a_client_that_leaves_a_request_not_streamed_ends_it_on_the_backend(backend, tmp_path):
    """The client gives up on a non-streamed completion: the router closes its connection to the
    backend (which aborts the request, as kvserve serve does) instead of waiting out the answer."""
    router = start_router(backend, tmp_path)
    try:
        with pytest.raises(httpx.ReadTimeout):
            post(router, {"prompt": "slow:60"}, timeout=1)
        deadline = time.monotonic() + 10
        while "slow:60" not in httpx.get(f"{backend.url}/left", timeout=5).json():
            assert time.monotonic() < deadline, "the backend still computes the request its client left"
            time.sleep(0.2)
        router.wait_until(lambda s: s["backends"][0]["in_flight"] == 0, timeout=10, what="no request in flight")
    finally:
        router.stop()


def test_a_backend_refusing_the_stored_response_lookup_is_answered_as_it_answered(backend, tmp_path):
    """previous_response_id makes the router ask the backends which holds it; a 401 (the client's
    key is wrong) is the client's answer, not a 503 "cannot be asked, retry later"."""
    router = start_router(backend, tmp_path)
    try:
        body = {"model": "m", "input": "hi", "previous_response_id": "resp_x"}
        refused = httpx.post(f"{router.base_url}/v1/responses", json=body, headers={"Authorization": "Bearer wrong"},
                             timeout=HANG_BOUND_S)
        assert refused.status_code == 401 and "Invalid API key" in refused.text, refused.text
        lookup = httpx.get(f"{router.base_url}/v1/responses/resp_x", headers={"Authorization": "Bearer wrong"},
                           timeout=HANG_BOUND_S)
        assert lookup.status_code == 401
    finally:
        router.stop()


class ListenerProxy:
    """A TCP relay in front of a backend whose listening socket can be closed and opened again
    while the connections it relays stay up: a backend that refuses new connections for a moment
    (a full accept queue, no descriptors) while its event stream lives on."""

    def __init__(self, target_port: int):
        self.target_port, self.port = target_port, free_port()
        self.listener: socket.socket | None = None
        self.listen()

    def listen(self) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", self.port))
        self.listener.listen(16)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def close_listener(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread: the port refuses from now on
        self.listener.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def test_a_replica_a_request_could_not_reach_is_back_once_it_accepts_again(tmp_path):
    """A request that cannot connect takes its backend out; the replica's event stream, which
    outlived the failure, never says Hello again, so the router follows it afresh: the backend is
    back within seconds of accepting connections again (it had stayed out for good)."""
    backend = FakeBackend(tmp_path, "--kv-events")
    proxy = ListenerProxy(backend.port)
    router = RouterProcess.start([f"http://127.0.0.1:{proxy.port}"], tmp_path, "--routing-policy", "least_loaded")
    try:
        router.wait_until(lambda s: s["backends"][0]["up"], timeout=30, what="the backend up")
        proxy.close_listener()  # new connections refused; the event stream relayed on
        assert_openai_error(post(router, {"prompt": "refused"}), 503, "No backend is available")
        proxy.listen()
        router.wait_until(lambda s: s["backends"][0]["up"], timeout=15, what="the backend back in service")
        assert post(router, {"prompt": "accepted"}).status_code == 200
    finally:
        router.stop()
        backend.stop()
    log = router.log_path.read_text()
    assert "taken out: connection failed" in log and "Traceback" not in log, log[-3000:]


def test_a_replica_shutting_down_finishes_its_requests_in_flight_and_gets_no_new_ones(tmp_path):
    """A replica's event stream ends with Draining when it shuts down (a rolling restart): the
    router sends it nothing new, but the request it is answering finishes there (it was cut with a
    502, "taken out of service", as for a broken stream)."""
    backend = FakeBackend(tmp_path, "--kv-events")
    router = RouterProcess.start([backend.url], tmp_path, "--routing-policy", "least_loaded")
    try:
        router.wait_until(lambda s: s["backends"][0]["up"], timeout=30, what="the backend up")
        result = {}
        thread = threading.Thread(target=lambda: result.update(response=post(router, {"prompt": "slow:3"})))
        thread.start()
        time.sleep(0.5)
        httpx.post(f"{backend.url}/drain", timeout=5)
        router.wait_until(lambda s: s["backends"][0]["draining"] and not s["backends"][0]["up"], timeout=10,
                          what="the backend draining")
        assert_openai_error(post(router, {"prompt": "new"}), 503, "No backend is available")
        thread.join(HANG_BOUND_S)
        assert result["response"].status_code == 200, result["response"].text
    finally:
        router.stop()
        backend.stop()
    log = router.log_path.read_text()
    assert "is shutting down: no new requests" in log and "taken out" not in log, log[-3000:]


def test_a_request_past_the_request_timeout_is_a_504_and_a_stream_ends_with_an_error_event(backend, tmp_path):
    router = start_router(backend, tmp_path, "--request-timeout", "1")
    try:
        assert_openai_error(post(router, {"prompt": "hang"}), 504, "--request-timeout")
        streamed = post(router, {"prompt": "fast", "stream": True})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert post(router, {"prompt": "slow:0.2"}).status_code == 200  # within the deadline
    finally:
        router.stop()


def test_json_nested_too_deeply_to_parse_is_a_400(backend, tmp_path):
    router = start_router(backend, tmp_path)
    try:
        body = b'{"prompt": "x", "user": ' + b"[" * 20000 + b"]" * 20000 + b"}"
        assert_openai_error(post(router, body), 400, "nested too deeply")
        assert post(router, {"prompt": "still here"}).status_code == 200
    finally:
        router.stop()


def test_the_router_tokenizes_only_the_routing_prefix_of_a_huge_prompt(backend, tiny_llama, tmp_path):
    router = RouterProcess.start([backend.url], tmp_path, "--tokenizer", str(tiny_llama))
    try:
        router.wait_until(lambda s: s["tokenizer_loaded"] and s["backends"][0]["up"], timeout=60,
                          what="the tokenizer loaded and the backend up")
        huge = "the quick brown fox jumps over the lazy dog " * 70_000  # 3 MB
        # A request whose prefix the router cannot tokenize within TOKENIZE_WAIT_S is routed by load
        # and counts no tokens (on a busy 2-core machine the first try can be): a few tries.
        for _ in range(5):
            assert post(router, {"prompt": huge}).json()["choices"][0]["text"] == str(len(huge))
            metrics = httpx.get(f"{router.base_url}/metrics", timeout=10).text
            counted = float(re.search(r"^kvserve_router:prompt_tokens_total (\S+)$", metrics, re.M).group(1))
            if counted > 0:
                break
        assert 0 < counted <= ROUTING_PREFIX_CHARS, counted  # the prefix's tokens, not the 3 MB prompt's
    finally:
        router.stop()


def test_out_of_descriptor_loop_errors_are_one_line_per_interval(caplog):
    loop = asyncio.new_event_loop()
    try:
        install_loop_error_throttle(loop, interval_s=3600)
        with caplog.at_level(logging.WARNING, logger="kvserve.server"):
            for _ in range(1000):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(errno.EMFILE, "Too many open files")})
        lines = [r for r in caplog.records if "out of system resource" in r.getMessage()]
        assert len(lines) == 1 and lines[0].exc_info is None
        assert "(1 times" in lines[0].getMessage()
    finally:
        loop.close()
