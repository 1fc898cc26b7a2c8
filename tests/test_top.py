"""`kvserve top` (issue 25) in a pseudo-terminal against a real server: it draws the pool bar and
the request table, and Ctrl-C (the terminal's interrupt character, not a signal sent by hand)
ends it with status 0. An unreachable server and a refused key are one line and exit status 2."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import httpx

TOP = [sys.executable, "-m", "kvserve.cli", "top"]
KEY = "sk-test-0123456789"


def read_until(fd: int, needles: list[bytes], timeout: float) -> bytes:
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline and not all(n in out for n in needles):
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                out += os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
    return out


def test_top_draws_the_table_and_exits_0_on_ctrl_c(tiny_server):
    # A request long enough to be running while top draws.
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            httpx.post(tiny_server.base_url + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": "hello there", "max_tokens": 300, "ignore_eos": True})

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    pid, fd = pty.fork()
    if pid == 0:  # the child: its controlling terminal is the pty
        # As a background job of a non-interactive shell (a CI script) gets it: SIGINT ignored,
        # which Python keeps unless top installs its own handler.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.execvpe(TOP[0], [*TOP, tiny_server.base_url], {**os.environ, "TERM": "xterm-256color"})
    try:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
        screen = read_until(fd, [b"KV pool:", b"blocks", b"cmpl-"], timeout=60)
        text = screen.decode(errors="replace")
        assert "KV pool:" in text and "blocks" in text and "KV usage" in text, text[-2000:]
        assert "cmpl-" in text, "the running request is not in the table"
        os.write(fd, b"\x03")  # Ctrl-C as typed
        rest, status = b"", None
        deadline = time.monotonic() + 30
        while status is None and time.monotonic() < deadline:  # keep reading: a full pty blocks its writes
            rest += read_until(fd, [b"\x00never"], timeout=0.5)
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = code
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"kvserve top did not exit within 30 s of Ctrl-C: {rest[-500:]!r}")
    finally:
        stop.set()
        os.close(fd)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, rest[-500:])
    assert b"Traceback" not in screen + rest


def test_top_says_in_one_line_when_the_server_is_unreachable(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([*TOP, f"http://127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "cannot reach" in done.stderr, done.stderr


def test_top_says_in_one_line_when_the_key_is_wrong(server_factory, tiny_llama):
    # The configuration of test_server_auth.py: one process serves these modules.
    keyed = server_factory(str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "8MiB",
                           "--served-model-name", "tiny", env={"KVSERVE_API_KEY": KEY})
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_API_KEY"}
    for extra in ([], ["--api-key", "wrong"]):
        done = subprocess.run([*TOP, keyed.base_url, *extra], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 2
        assert done.stderr.strip().count("\n") == 0 and "refused the API key" in done.stderr, done.stderr
