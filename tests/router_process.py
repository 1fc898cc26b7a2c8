"""A real `kvserve router` process for tests, on a free port, stopped with SIGTERM; and helpers that
read its /router/state."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from server_process import free_port, stop_process


@dataclass
class RouterProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, backends: list[str], log_dir: Path, *args: str, max_fds: int | None = None) -> "RouterProcess":
        """`max_fds`: the process's file-descriptor limit (soft and hard)."""
        port = free_port()
        log_path = log_dir / "router.log"
        command = [sys.executable, "-m", "kvserve.cli", "router", *[x for b in backends for x in ("--backend", b)],
                   *args, "--host", "127.0.0.1", "--port", str(port)]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                       preexec_fn=None if max_fds is None else lambda: resource.setrlimit(
                                           resource.RLIMIT_NOFILE, (max_fds, max_fds)))
        api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        return cls(process, port, log_path, api_key)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def state(self, hashes: bool = False) -> dict:
        return httpx.get(f"{self.base_url}/router/state", params={"hashes": hashes}, headers=self.headers(),
                         timeout=10).json()

    def wait_until(self, condition, timeout: float = 60, what: str = "the router state") -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvserve router exited:\n{self.log()}")
            try:
                state = self.state()
                if condition(state):
                    return state
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached in {timeout} s: {state}\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        stop_process(self.process)
