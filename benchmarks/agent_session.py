"""A Claude-Code-shaped agent session over Anthropic's Messages API, turn by turn: what the prefix
cache saves each turn, and what a first system block that changes on every request would cost.

The session is replayed, not generated: a long system prompt in text blocks, three tools, then
turns that each append the assistant's tool call (fixed text) and its tool result, and ask the
model for the next reply (streamed, `max_tokens` small). Two variants, the same session each:

- `billing-header`: the first system block is Claude Code's `x-anthropic-billing-header: ...;
  cch=<new every request>;`, which the server drops (README, "Anthropic Messages API");
- `changing-first-block`: the same per-request text under another name, which the server keeps,
  as a server that does not drop the header would: every prompt then differs from its first token.

Per turn: the prompt's tokens, those read from the prefix cache, and the time to the first text
delta (TTFT). The server must be running (`kvserve serve`); each variant uses its own cache_salt,
so neither reads the other's blocks.

    python benchmarks/agent_session.py --url http://127.0.0.1:8000 [--turns 6] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time

import httpx

from kvserve.bench.datasets import BOOK_PATH as BOOK

TOOLS = [{"name": name, "description": f"{name.replace('_', ' ').capitalize()} in the project.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
         for name in ("read_file", "list_directory", "search_code")]


def system_blocks(first: str) -> list[dict]:
    text = BOOK.read_text()
    return [{"type": "text", "text": first},
            {"type": "text", "text": "You are an agent that answers questions about a novel. " + text[10_000:14_000]},
            {"type": "text", "text": text[14_000:16_000], "cache_control": {"type": "ephemeral"}}]


def turn(url: str, model: str, system: list[dict], messages: list[dict], salt: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "system": system, "messages": messages, "tools": TOOLS,
            "tool_choice": {"type": "none"}, "stream": True, "temperature": 0, "cache_salt": salt}
    start = time.perf_counter()
    ttft, usage = None, {}
    with httpx.stream("POST", f"{url}/v1/messages?beta=true", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            if event["type"] == "content_block_delta" and ttft is None:
                ttft = time.perf_counter() - start
            elif event["type"] == "message_delta":
                usage = event["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    return {"prompt_tokens": prompt, "cached_tokens": usage["cache_read_input_tokens"],
            "ttft_ms": 1000 * (ttft if ttft is not None else time.perf_counter() - start)}


def session(url: str, model: str, variant: str, turns: int, max_tokens: int) -> list[dict]:
    salt = f"{variant}-{secrets.token_hex(4)}"  # a session no earlier run has cached
    messages: list[dict] = [{"role": "user", "content": "Which characters meet in the first chapters?"}]
    results = []
    for i in range(turns):
        nonce = secrets.token_hex(3)
        first = (f"x-anthropic-billing-header: cc_version=2.1.0; cch={nonce};" if variant == "billing-header"
                 else f"x-request-fingerprint: {nonce}")
        results.append(turn(url, model, system_blocks(first), messages, salt, max_tokens))
        call_id = f"toolu_{i:02d}"
        messages += [{"role": "assistant", "content": [
                         {"type": "text", "text": "Let me look that up."},
                         {"type": "tool_use", "id": call_id, "name": "search_code", "input": {"path": f"ch{i + 1}"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": call_id,
                          "content": BOOK.read_text()[20_000 + 800 * i:20_000 + 800 * (i + 1)]},
                         {"type": "text", "text": "Go on."}]}]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    report = {}
    for variant in ("billing-header", "changing-first-block"):
        rows = session(args.url, model, variant, args.turns, args.max_tokens)
        report[variant] = rows
        print(f"{variant}:")
        for i, row in enumerate(rows, 1):
            print(f"  turn {i}: prompt {row['prompt_tokens']:5d} tokens, cached {row['cached_tokens']:5d}, "
                  f"TTFT {row['ttft_ms']:7.0f} ms")
        later = rows[1:]
        print(f"  turns 2-{len(rows)}: median TTFT {statistics.median(r['ttft_ms'] for r in later):.0f} ms, "
              f"{sum(r['cached_tokens'] for r in later) / sum(r['prompt_tokens'] for r in later):.1%} of prompt "
              f"tokens from the cache")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
