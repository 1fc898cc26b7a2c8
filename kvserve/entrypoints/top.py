"""`kvserve top [URL]`: the dashboard's view in a terminal (rich Live), for servers reached over
SSH. Polls GET URL/dashboard/state twice a second; Ctrl-C exits with status 0. An unreachable
server or a refused key before the first view is one line and exit status 2; later the view
stays up and says what went wrong until the server answers again."""
from __future__ import annotations

import argparse
import os
import signal
import time

DEFAULT_URL = "http://127.0.0.1:8000"
API_KEY_ENV = "KVSERVE_API_KEY"


def register(subparsers) -> None:
    parser = subparsers.add_parser("top", help="watch a running server's KV cache and requests in the terminal")
    parser.add_argument("url", nargs="?", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"the server's --api-key (default: ${API_KEY_ENV})")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between polls (default 0.5)")
    parser.set_defaults(func=run)


class StateError(Exception):
    """Why the state could not be read, in one line."""


def fetch_state(client, url: str) -> dict:
    import httpx

    try:
        response = client.get(url + "/dashboard/state")
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise StateError(f"cannot reach {url} ({type(exc).__name__}: {exc or 'no answer'})") from None
    if response.status_code == 401:
        raise StateError(f"{url} refused the API key: pass the server's key with --api-key or ${API_KEY_ENV}")
    if response.status_code == 404:
        raise StateError(f"{url} has no /dashboard/state: is it a kvserve server?")
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = response.text[:200]
        raise StateError(f"{url} answered {response.status_code}: {message}")
    state = response.json()
    if state.get("version") != 1:
        raise StateError(f"{url} sends state version {state.get('version')!r}; this kvserve top reads version 1")
    return state


def run(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console
    from rich.live import Live

    from kvserve.cli import UserError
    from kvserve.entrypoints.top_view import TopView

    if not 0 < args.interval < 86400:  # (NaN and inf are neither)
        raise UserError(f"--interval must be a positive number of seconds under a day, got {args.interval}")
    url = args.url.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # Ctrl-C is how top ends, so it must raise KeyboardInterrupt even where SIGINT came ignored from
    # the parent (a background job of a non-interactive shell ignores it, and Python keeps that).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    console = Console()
    view = TopView()
    with httpx.Client(headers=headers, timeout=10) as client:
        try:
            state = fetch_state(client, url)
        except StateError as exc:
            raise UserError(str(exc)) from None
        view.add(state)
        notice = ""
        try:
            with Live(console=console, auto_refresh=False, screen=False, transient=False) as live:
                while True:
                    rows = max(3, console.size.height - 12)
                    live.update(view.render(state, console.size.width, rows, notice), refresh=True)
                    time.sleep(args.interval)
                    try:
                        state = fetch_state(client, url)
                        view.add(state)
                        notice = ""
                    except StateError as exc:
                        notice = str(exc)
        except KeyboardInterrupt:
            return 0
