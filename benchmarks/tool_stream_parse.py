"""Cost of streaming tool calls: the server re-parses a choice's whole text after every step
(kvserve/server/tool_stream.py), so the parse of a long call must stay cheap next to a decode step.

Streams a `hermes` call and a `tool_choice: "required"` array whose arguments hold a generated
file of growing size, a few characters per step (about one token), and reports the parse time per
step and in total. Pure Python, no model.

    python benchmarks/tool_stream_parse.py [--chars-per-step 4]
"""
from __future__ import annotations

import argparse
import json
import time

from kvserve.server.tool_parsers import TOOL_PARSERS
from kvserve.server.tool_parsers.forced import RequiredCallsReader
from kvserve.server.tool_stream import ToolDeltas


def arguments_of_size(chars: int) -> str:
    line = "def f(x):\n    return {'a': [x, x], \"b\": x}\n"
    content = (line * (chars // len(line) + 1))[:chars]
    return json.dumps({"path": "f.py", "content": content, "mode": [1, 2, 3]})


def stream(parser, text: str, step: int) -> tuple[int, float, str]:
    tracker, sent = ToolDeltas(parser), []
    start = time.perf_counter()
    ends = list(range(step, len(text), step)) + [len(text)]
    for end in ends:
        _, deltas = tracker.step(text[:end], final=end == len(text))
        sent.extend(d.function.arguments or "" for d in deltas)
    return len(ends), time.perf_counter() - start, "".join(sent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars-per-step", type=int, default=4)
    args = parser.parse_args()
    print("| format | arguments (chars) | steps | parse per step (us) | total (ms) |")
    print("|---|---|---|---|---|")
    for size in (1_000, 10_000, 50_000):
        arguments = arguments_of_size(size)
        cases = {"hermes": (TOOL_PARSERS["hermes"](),
                            '<tool_call>\n{"name": "write_file", "arguments": ' + arguments + "}\n</tool_call>"),
                 "required": (RequiredCallsReader(), '[{"name":"write_file","parameters":' + arguments + "}]")}
        for name, (reader, text) in cases.items():
            steps, seconds, sent = stream(reader, text, args.chars_per_step)
            assert sent == arguments, "the streamed arguments must reassemble"
            print(f"| {name} | {len(arguments):,} | {steps:,} | {seconds / steps * 1e6:.0f} | {seconds * 1e3:.0f} |")


if __name__ == "__main__":
    main()
