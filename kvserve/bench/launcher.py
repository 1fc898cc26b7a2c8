"""Start a server process on 127.0.0.1, wait until /health answers, stop it afterwards."""
from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx

# httpx logs every request at INFO; the health check polls.
logging.getLogger("httpx").setLevel(logging.WARNING)

# (port, extra args) -> argv of a server listening on 127.0.0.1:port
ServerCommand = Callable[[int, list[str]], list[str]]


def kvserve_serve_command(port: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(ValueError):
    """The server exited or stayed unhealthy; the message quotes the end of its log."""


def _last_line(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = process.poll()
        if code is not None:
            raise ServerStartError(f"the server exited with code {code} before it was ready: "
                                   f"{_last_line(log) or 'no output'} (log: {log})")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise ServerStartError(f"the server did not answer {url} within {timeout:.0f} s (log: {log})")


def _stop(process: subprocess.Popen) -> None:
    """Ctrl-C first (a graceful shutdown), then SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if process.poll() is not None:
            return
        process.send_signal(sig)
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def running_server(command: ServerCommand, args: list[str], log: Path, timeout: float) -> Iterator[str]:
    """`with running_server(...) as base_url:` a server started with `args`, healthy, and stopped
    on exit (also on errors and Ctrl-C). Its stdout and stderr go to `log`."""
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as sink:
        # Own session: a Ctrl-C in the terminal reaches only the benchmark, which then stops the server.
        process = subprocess.Popen(command(port, args), stdout=sink, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base_url + "/health", process, log, timeout)
        yield base_url
    finally:
        _stop(process)
