"""Tool-call parsers: turn a model's text into OpenAI `tool_calls` (`--tool-call-parser NAME`)."""
from __future__ import annotations

from kvserve.server.tool_parsers.base import CallSoFar, Parse, ToolParser
from kvserve.server.tool_parsers.hermes import HermesParser
from kvserve.server.tool_parsers.llama3_json import Llama3JsonParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}

__all__ = ["TOOL_PARSERS", "CallSoFar", "Parse", "ToolParser"]
