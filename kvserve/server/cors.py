"""Cross-origin requests from browsers (CORS), with vLLM's options and defaults.

A web page served from another origin may call the API only if the server says so: a browser
first sends a preflight OPTIONS request (never with the API key) and reads the
`Access-Control-Allow-*` headers of the answer. Starlette's CORSMiddleware answers preflights and
adds the headers to every response, errors included; it is the outermost middleware, so a
preflight is answered before the API-key check and a 401 or 413 still reaches the page readable.
Like vLLM, SGLang and llama.cpp's server, every origin is allowed by default (no credentials);
`--allowed-origins '[]'` turns cross-origin access off.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CorsOptions:
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])


def add_cors(app: FastAPI, options: CorsOptions | None) -> None:
    """Add the CORS middleware; call it last, so that it is outermost. None or no allowed origin: none."""
    if options is None or not options.allowed_origins:
        return
    app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins,
                       allow_credentials=options.allow_credentials, allow_methods=options.allowed_methods,
                       allow_headers=options.allowed_headers)
