"""Imports point downward only: cache -> model -> engine -> entry points (README, "What is inside").

`cache` imports neither `model` nor `engine`; `model` does not import `engine`; the plain helper and
data modules at the top of the package import no layer above `cache`. The few imports that still
break the rule are listed in KNOWN with the change that removes them; the test fails on any other,
and on a listed one that is gone (so the list only shrinks).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import kvserve

PACKAGE = Path(kvserve.__file__).parent
LAYERS = {"cache": 0, "model": 1, "engine": 2}
PLAIN_MODULES = {"hardware", "disk_cache", "torch_threads", "transfers", "units", "sampling_params", "outputs"}  # use `cache` at most

KNOWN: set[tuple[str, str]] = set()  # every import follows the rule


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.split(".")[0] == "kvserve"}


def violations() -> set[tuple[str, str]]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        top = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        for module in imported_modules(path):
            target = module.split(".")[1] if "." in module else ""
            upward = top in LAYERS and target in LAYERS and LAYERS[target] > LAYERS[top]
            plain_upward = top in PLAIN_MODULES and target in LAYERS and LAYERS[target] > LAYERS["cache"]
            if upward or plain_upward:
                found.add((relative.as_posix(), module))
    return found


def test_layers_import_downward_only():
    found = violations()
    assert found - KNOWN == set(), "imports against the layer rule"
    assert KNOWN - found == set(), "fixed: remove these from KNOWN"


def test_the_rule_catches_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: an engine import added to a cache module is found."""
    fake = tmp_path / "kvserve"
    (fake / "cache").mkdir(parents=True)
    (fake / "cache" / "bad.py").write_text("from kvserve.engine.request import Request\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert violations() == {("cache/bad.py", "kvserve.engine.request")}
