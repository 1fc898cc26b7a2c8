"""Per-request log lines, vLLM's `--enable-log-requests`, `--enable-log-outputs` and
`--max-log-len`: off by default (a prompt is a user's data). With them, every engine request
(one per prompt of an HTTP request) logs on arrival its id and sampling parameters (INFO) and its
prompt text and token ids (DEBUG, `kvserve --log-level DEBUG`), and, with outputs, each finished
choice's text and finish reason (INFO) and token ids (DEBUG). `max_len` cuts every prompt, text
and id list to that many characters or ids, as vLLM's slice does. Written from the engine thread,
which sees every request whichever route it came by."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.requests")


@dataclass(frozen=True)
class RequestLog:
    max_len: int | None = None  # None: whole prompts and outputs
    outputs: bool = False  # --enable-log-outputs

    def _cut(self, value):
        return value if self.max_len is None else value[:self.max_len]

    def received(self, request_id: str, token_ids: list[int], params: SamplingParams,
                 decode: Callable[[list[int]], str]) -> None:
        logger.info("Received request %s: params: %s", request_id, params)
        if logger.isEnabledFor(logging.DEBUG):  # decoding costs: only when the line is written
            logger.debug("Request %s details: prompt: %r, prompt_token_ids: %s", request_id,
                         self._cut(decode(token_ids)), self._cut(token_ids))

    def finished(self, output: RequestOutput) -> None:
        if not self.outputs:
            return
        for choice in output.outputs:
            name = output.request_id if len(output.outputs) == 1 else f"{output.request_id} choice {choice.index}"
            logger.info("Generated response %s: output: %r, finish_reason: %s", name, self._cut(choice.text),
                        choice.finish_reason)
            logger.debug("Generated response %s: output_token_ids: %s", name, self._cut(choice.token_ids))
