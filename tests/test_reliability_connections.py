"""Connections that send nothing, trickle, stall their body or flood the server (issue 22, item 5):
each is closed by a timeout, the connection limit never takes /health down, and the log says so
once, not per connection. Real sockets against a real `kvserve serve`."""
from __future__ import annotations

import resource
import selectors
import socket
import time

import httpx
import pytest

IDLE_CONNECTIONS = 5000
HEADER_TIMEOUT_S = 3
BODY_TIMEOUT_S = 2
MAX_CONNECTIONS = 1000


def open_connections(port: int, count: int) -> list[socket.socket]:
    sockets = []
    for i in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        sockets.append(sock)
    return sockets


def wait_closed_by_server(sockets: list[socket.socket], timeout: float) -> int:
    """How many of `sockets` the server closed (EOF or reset) within `timeout` seconds."""
    selector = selectors.DefaultSelector()
    for sock in sockets:
        selector.register(sock, selectors.EVENT_READ)
    closed = 0
    deadline = time.monotonic() + timeout
    while closed < len(sockets) and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=0.5):
            try:
                data = key.fileobj.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                selector.unregister(key.fileobj)
                closed += 1
    selector.close()
    return closed


@pytest.fixture
def more_file_descriptors():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = IDLE_CONNECTIONS + 200
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"this machine's hard RLIMIT_NOFILE ({hard}) is below the {needed} the test opens")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def guarded_server(server_factory, tiny_llama):
    return server_factory(str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "8MiB",
                          "--timeout-header", str(HEADER_TIMEOUT_S), "--timeout-body", str(BODY_TIMEOUT_S),
                          "--max-connections", str(MAX_CONNECTIONS))


def test_idle_flood_is_closed_and_health_keeps_answering(guarded_server, more_file_descriptors):
    sockets = open_connections(guarded_server.port, IDLE_CONNECTIONS)
    try:
        for sock in sockets[::7]:  # some trickle an unfinished request head
            try:
                sock.send(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            except OSError:
                pass
        # While the flood is open, a fresh client still gets through (it closes an idle connection).
        for _ in range(3):
            response = httpx.get(guarded_server.base_url + "/health", timeout=HEADER_TIMEOUT_S * 3)
            assert response.status_code == 200
        closed = wait_closed_by_server(sockets, timeout=HEADER_TIMEOUT_S + 60)
        assert closed == IDLE_CONNECTIONS, f"only {closed} of {IDLE_CONNECTIONS} idle connections were closed"
    finally:
        for sock in sockets:
            sock.close()
    assert httpx.get(guarded_server.base_url + "/health", timeout=10).status_code == 200
    log = guarded_server.log()
    assert log.count("connection limit (1000, --max-connections) reached") == 1, log
    assert log.count("sent no complete request head within") == 1, log
    assert "Traceback" not in log and "ERROR" not in log, log


def test_a_stalled_body_is_closed(guarded_server):
    with socket.create_connection(("127.0.0.1", guarded_server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        start = time.monotonic()
        data = sock.recv(4096)  # blocks until the server closes (or answers)
        waited = time.monotonic() - start
    assert data == b"" or b" 4" in data.split(b"\r\n", 1)[0], data  # closed, or a 4xx for the partial body
    assert waited < BODY_TIMEOUT_S + 20
    assert "request body paused for more than" in guarded_server.log()


def test_all_connections_busy_gets_a_503_body(server_factory, tiny_llama):
    server = server_factory(str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-connections", "2")
    busy = []
    try:
        for _ in range(2):  # each holds a request whose body never completes
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            busy.append(sock)
        time.sleep(0.5)
        response = httpx.get(server.base_url + "/health", timeout=10)
        assert response.status_code == 503
        assert "maximum of 2 connections" in response.json()["error"]["message"]
    finally:
        for sock in busy:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.get(server.base_url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
