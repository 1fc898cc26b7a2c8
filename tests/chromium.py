"""A headless Chromium for tests, driven over the DevTools protocol (CDP) with a small client.

Uses the system's browser (Debian's `chromium` package; `.ci/run` installs it), never downloads
one. Launched with the flags that keep it off the network (no component updates, no background
requests), so it cannot stall on a look-up on an offline machine. `CHROMIUM_MISSING` is the skip
reason when there is no browser.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMIUM_MISSING = None if CHROMIUM else "no chromium executable (Debian: apt-get install chromium)"
FLAGS = ["--headless=new", "--no-sandbox", "--disable-background-networking", "--disable-component-update",
         "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
         "--disable-extensions", "--disable-sync", "--mute-audio", "--hide-scrollbars"]
START_TIMEOUT_S = 60


class PageError(RuntimeError):
    """A script evaluated in the page threw."""


class Browser:
    """One Chromium process with one page; `errors` collects the page's console errors."""

    def __init__(self, width: int = 1280, height: int = 900):
        import websockets.sync.client

        self._profile = tempfile.mkdtemp(prefix="kvserve-chromium-")
        profile = Path(self._profile)
        self.process = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (port_file.exists() and len(port_file.read_text().split()) >= 2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = json.loads(_http_get(port, "/json/list"))
        page = next(t for t in targets if t["type"] == "page")
        self._stack = contextlib.ExitStack()
        self._ws = self._stack.enter_context(
            websockets.sync.client.connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30))
        self._ids = itertools.count(1)
        self.errors: list[str] = []
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")

    def send(self, method: str, timeout: float = 60, **params) -> dict:
        """One CDP command; returns its result (events read meanwhile are checked for errors)."""
        cid = next(self._ids)
        self._ws.send(json.dumps({"id": cid, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self._ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if message.get("id") == cid:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self._on_event(message)

    def _on_event(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append(details.get("exception", {}).get("description") or details["text"])
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append(f"{params['entry'].get('url', '')}: {params['entry']['text']}")

    def evaluate(self, expression: str, timeout: float = 60):
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.send("Runtime.evaluate", timeout=timeout, expression=expression, awaitPromise=True,
                           returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise PageError(details.get("exception", {}).get("description") or details["text"])
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def wait_for(self, expression: str, timeout: float = 30):
        """Poll a JavaScript expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout} s: {expression}")
            time.sleep(0.1)

    def mouse_move(self, x: float, y: float) -> None:
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def close(self) -> None:
        if hasattr(self, "_stack"):
            self._stack.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        # Chromium's helper processes (renderer, utility, crashpad) can outlive the browser process
        # and still write into the profile: end its whole process group, then remove the profile,
        # retrying while the last writers die (an rmtree racing them fails with "Directory not empty").
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:
            try:
                shutil.rmtree(self._profile)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def _http_get(port: int, path: str) -> str:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10).text
