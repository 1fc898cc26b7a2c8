"""The README's screenshot of /dashboard: `kvserve serve` (the default model unless --model) under
a load of chat clients sharing a system prompt, the page in headless Chromium (tests/chromium.py)
for a while so its time series fill, then a PNG of the page.

    python benchmarks/dashboard_screenshot.py --out docs/dashboard.png
"""
from __future__ import annotations

import argparse
import base64
import sys
import threading
import time
from pathlib import Path

import httpx

from kvserve.bench.launcher import kvserve_serve_command, running_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from chromium import Browser  # noqa: E402  (tests/chromium.py: the CDP client the browser tests use)

SYSTEM = ("You are a careful assistant for a bookshop. Answer in two or three sentences, name the book "
          "and its author, and never invent a title that does not exist.")
QUESTIONS = ["Suggest a novel about the sea.", "What should I read after Pride and Prejudice?",
             "Recommend a short book about the history of mathematics, please.", "A mystery set in a train?",
             "Which poetry collection would suit a ten-year-old who likes animals and rhymes?",
             "Something funny for a long flight.", "A classic Russian novel that is not too long.",
             "What is a good first science-fiction book for someone who usually reads biographies?"]


def client(base_url: str, index: int, stop: threading.Event) -> None:
    with httpx.Client(base_url=base_url, timeout=300) as http:
        n = index
        while not stop.is_set():
            question = QUESTIONS[n % len(QUESTIONS)]
            http.post("/v1/chat/completions", json={
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                "max_tokens": 60 + 40 * (n % 5), "ignore_eos": True})
            n += 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=40.0, help="load time before the screenshot")
    parser.add_argument("--server-args", default="--kv-cache-memory 48MiB --max-num-seqs 8")
    args = parser.parse_args()
    serve_args = ([args.model] if args.model else []) + args.server_args.split()
    with running_server(kvserve_serve_command, serve_args, Path("/tmp/kvserve-dashboard-shot.log"), 300) as url:
        stop = threading.Event()
        threads = [threading.Thread(target=client, args=(url, i, stop), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        browser = Browser(width=1280, height=1000)
        try:
            browser.goto(url + "/dashboard")
            time.sleep(args.seconds)
            browser.mouse_move(*browser.evaluate(
                "(() => { const i = kvDashboard.blocks.states.findIndex(s => (s & 3) === 3);"
                " const p = kvDashboard.cellCentre(Math.max(i, 0)); return [p.x, p.y]; })()"))
            time.sleep(0.3)
            shot = browser.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        finally:
            browser.close()
            stop.set()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(base64.b64decode(shot["data"]))
    print(f"{args.out}: {args.out.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
