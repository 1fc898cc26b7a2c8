"""Errors the engine raises that its callers treat specially."""
from __future__ import annotations


class FatalEngineError(RuntimeError):
    """The engine cannot run another step (e.g. a tensor-parallel worker died): a server fails
    every request and exits rather than retry."""
