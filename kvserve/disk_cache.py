"""An on-disk cache for what kvserve derives at start-up (a GGUF's converted tokenizer, calibrated
key transforms), so that the next start with the same inputs skips that work.

Entries live under $KVSERVE_CACHE_DIR (default $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve;
set it to an empty string to turn the cache off). An entry's name is a hash of everything its
content depends on (model file, options, library versions), so a changed input never finds an
old entry. Entries are written under a temporary name and renamed into place, so a reader never
sees half of one; an entry that cannot be read is reported and recomputed, and failing to write
(a read-only home) only means the next start does the work again.

A plain module (it imports nothing from kvserve at import time) that every layer may use.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "KVSERVE_CACHE_DIR"
_EDGE_BYTES = 1 << 20  # a file fingerprint hashes its first and last MiB


def cache_root() -> Path | None:
    """The cache directory, or None when the cache is turned off."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured is not None:
        return Path(configured).expanduser() if configured.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvserve"


def entry_path(kind: str, key: dict[str, Any], suffix: str = "") -> Path | None:
    """Where the entry of `kind` for `key` (JSON-serialisable) lives, or None with the cache off.
    The kvserve version is part of every key."""
    root = cache_root()
    if root is None:
        return None
    from kvserve import __version__

    text = json.dumps({"kvserve": __version__, **key}, sort_keys=True, default=str)
    return root / kind / (hashlib.sha256(text.encode()).hexdigest()[:32] + suffix)


def file_fingerprint(path: Path) -> dict[str, Any]:
    """Identifies a checkpoint without reading all of it: resolved path, size, mtime and a hash of
    the first and last MiB. A directory (Hugging Face checkpoint) fingerprints each file in it."""
    path = Path(path).resolve()
    if path.is_dir():
        return {"dir": str(path), "files": [file_fingerprint(f) for f in sorted(path.iterdir()) if f.is_file()]}
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_EDGE_BYTES))
        if stat.st_size > _EDGE_BYTES:
            f.seek(max(_EDGE_BYTES, stat.st_size - _EDGE_BYTES))
            digest.update(f.read())
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "edges": digest.hexdigest()}


@functools.cache
def source_digest(*packages: str) -> str:
    """A hash of the source files of these kvserve subpackages ("cache", "model"): an entry
    computed by code that has since changed (a development checkout keeps its version number)
    must not be reused."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for package in packages:
        for file in sorted((root / package).rglob("*")):
            if file.suffix in (".py", ".cpp", ".h"):
                digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def write_atomically(path: Path, write: Callable[[Path], None], is_dir: bool = False) -> bool:
    """Let `write` fill a temporary file (or directory) next to `path`, then rename it into place.
    False, with a warning, when the entry could not be written (the caller goes on without it)."""
    temp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if is_dir:
            temp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
        else:
            handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            os.close(handle)
            temp = Path(name)
        write(temp)
        if is_dir and path.exists():  # a directory cannot replace a non-empty one: drop the stale entry
            shutil.rmtree(path, ignore_errors=True)
        os.replace(temp, path)
        return True
    except Exception as exc:  # a cache must never stop the start-up it speeds up
        logger.warning("kvserve cache: could not write %s (%s: %s); continuing without it",
                       path, type(exc).__name__, exc)
        return False
    finally:
        if temp is not None and temp.is_dir():
            shutil.rmtree(temp, ignore_errors=True)
        elif temp is not None:
            temp.unlink(missing_ok=True)


def save_tensors(path: Path | None, value: Any) -> None:
    """Store tensors (in lists, dicts, tuples) at `path` (None: cache off)."""
    if path is None:
        return
    import torch

    write_atomically(path, lambda temp: torch.save(value, temp))


def load_tensors(path: Path | None) -> Any | None:
    """The tensors stored at `path`, or None when absent or unreadable (then with a warning)."""
    if path is None or not path.is_file():
        return None
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file surfaces as many exception types
        logger.warning("kvserve cache: ignoring unreadable entry %s (%s: %s); recomputing",
                       path, type(exc).__name__, exc)
        return None
