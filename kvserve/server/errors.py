"""Every error the server returns has OpenAI's body, `{"error": {message, type, param, code}}`,
whatever raised it: our own checks, FastAPI's request validation (422 -> 400), routing (404,
405) or an unexpected exception (500; the traceback goes to the log, never to the client). On
Anthropic's Messages API paths (/v1/messages...) the same errors have Anthropic's body,
`{"type": "error", "error": {type, message}}`, which its clients read."""
from __future__ import annotations

import json
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_MAX_MESSAGE_CHARS = 2000
ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


class APIError(Exception):
    """An error for the client: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)


def error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    if status == 401:
        return "authentication_error"
    return "invalid_request_error"


TOO_DEEP = "The request body is not valid JSON: it is nested too deeply."  # json.loads' RecursionError


def dispatched_path(scope: dict) -> str:
    """The path routing dispatches on: the request's, less the app's root path (`--root-path`,
    behind a path-based proxy) when it starts with it, by Starlette's rule."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path


def speaks_anthropic(path: str) -> bool:
    """Whether errors on `path` take Anthropic's body (kvserve/server/messages.py)."""
    path = path.rstrip("/")
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None, path: str = "") -> dict:
    """The error's body for a request to `path`."""
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "..."
    if speaks_anthropic(path):
        return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
    return {"error": {"message": message, "type": type or error_type(status), "param": param, "code": code}}


def error_json(status: int, message: str, **fields) -> bytes:
    return json.dumps(error_body(status, message, **fields)).encode()


def error_response(exc: APIError, path: str = "") -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code, exc.type, path),
                        status_code=exc.status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, e.g. "temperature: Input should be a valid number"."""
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return f"Invalid JSON in the request body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        where = ".".join(loc)
        param = param or where or None
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "Invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    # An error body's shape follows the route (Anthropic's on its paths), read without --root-path.
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, dispatched_path(request.scope))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param, path=dispatched_path(request.scope)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"Not found: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            detail = f"Method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(error_body(exc.status_code, detail, path=dispatched_path(request.scope)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response is sent, so uvicorn logs the traceback.
        body = error_body(500, f"Internal server error ({type(exc).__name__})", path=dispatched_path(request.scope))
        return JSONResponse(body, status_code=500)
