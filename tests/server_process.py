"""A real `kvserve serve` process on 127.0.0.1 for tests: started on a free port, waited on via
/health, stopped with SIGTERM (then SIGKILL). Its log goes to a file that failures quote."""
from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

START_TIMEOUT_S = 120


def _ephemeral_ports() -> range:
    """The range the kernel hands out as clients' source ports (Linux's default when unreadable)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port() -> int:
    """A port free now, outside the ephemeral range: a port the kernel picked for a bind to port 0
    is one it also gives any outgoing connection as its source port, so between this call and the
    server's bind a client could take it ("Address already in use", seen in CI)."""
    ephemeral = _ephemeral_ports()
    candidates = [p for p in range(15000, 32768) if p not in ephemeral] or list(range(1024, 15000))
    for _ in range(200):
        port = random.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found outside the ephemeral range")


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 15 s; returns once the process is gone."""
    stop_processes([process])


def stop_processes(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to all at once, then SIGKILL to those still running 15 s later: a session's servers
    shut down side by side, not one after another."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def raw_request_status(port: int, request: bytes) -> int:
    """Send `request` as is over a fresh socket (no client library normalises the path or headers)
    and return the HTTP status of the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    return int(reply.split(b" ", 2)[1])


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, args: list[str], log_dir: Path, env: dict[str, str] | None = None, port: int | None = None,
              wait: bool = True, new_session: bool = False) -> "ServerProcess":
        """A port the caller did not name is chosen here, and chosen again (up to three times) when
        another process took it before the server bound it. `new_session`: the server leads a
        process group of its own (for a signal to the whole group, as a service manager sends it)."""
        for attempt in range(3):
            server = cls._launch(args, log_dir, env, port or free_port(), new_session)
            if not wait:
                return server
            try:
                server.wait_healthy()
                return server
            except RuntimeError:
                if port or attempt == 2 or "Address already in use" not in server.log():
                    raise

    @classmethod
    def _launch(cls, args: list[str], log_dir: Path, env: dict[str, str] | None, port: int,
                new_session: bool = False) -> "ServerProcess":
        log_path = log_dir / "server.log"
        command = [sys.executable, "-m", "kvserve.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
        full_env = {**os.environ, **(env or {})}
        api_key = args[args.index("--api-key") + 1] if "--api-key" in args else full_env.get("KVSERVE_API_KEY")
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                       start_new_session=new_session)
        return cls(process, port, log_path, api_key)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kvserve serve did not become healthy in {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {"name{labels}": value} (labels without model_name)."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        samples = {}
        for name, labels, value in re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)$", text, re.M):
            labels = ",".join(x for x in labels.split(",") if x and not x.startswith("model_name="))
            samples[f"{name}{{{labels}}}" if labels else name] = float(value)
        return samples

    def stop(self) -> None:
        stop_process(self.process)


# The configuration of the shared `tiny_server` fixture; offline comparisons use the same engine options.
TINY_ENGINE_OPTIONS = {"dtype": "float32", "kv_cache_memory": "16MiB"}
TINY_SERVER_ARGS = ("--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-request-body-bytes", "1MiB",
                    "--served-model-name", "tiny", "tiny-alias")
# The tiny server with the response-shaping flags that are off by default (one process for their tests).
FLAGGED_SERVER_ARGS = (*TINY_SERVER_ARGS, "--return-tokens-as-token-ids", "--enable-request-id-headers")
