"""A request's scheduling priority as vLLM takes it: the body's `priority` (chat, completions,
Responses; lower is served first under `--scheduling-policy priority`), which an
`X-Vllm-Priority` header overrides (a gateway can rank tenants without touching bodies). A header
that is not an integer is a 400 here (vLLM ignores it), so a gateway's typo is not silently
ranked 0."""
from __future__ import annotations

from starlette.requests import Request

from kvserve.server.errors import APIError

HEADER = "x-vllm-priority"


def request_priority(request: Request, body_priority: int) -> int:
    value = request.headers.get(HEADER)
    if value is None:
        return body_priority
    try:
        return int(value)
    except ValueError:
        raise APIError(400, f"The X-Vllm-Priority header must be an integer, got {value!r:.40}.") from None
