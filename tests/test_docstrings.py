"""Docstrings and comments say what and why; measurements live in BENCHMARKS.md (README, standards).

A number measured on one machine (a duration, an "Nx faster", a KL, a perplexity, a passkey score)
goes stale in a docstring while BENCHMARKS.md records how it was measured. This scans every
docstring and comment in the package for such numbers; a design note keeps a pointer instead,
e.g. (BENCHMARKS.md, "KV-cache dtypes"). Files still carrying them are listed in KNOWN (the list
may only shrink). Arithmetic (bytes per token, "3.56x the tokens") and numbers a paper reports are
not measurements of this code and are not matched.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import kvserve

PACKAGE = Path(kvserve.__file__).parent

MEASUREMENT = re.compile(r"""
      \d(?:\.\d+)?\s?(?:µs|μs|us|ms)\b                        # a duration: 20 us, 2.4 ms
    | \d(?:\.\d+)?\s?[x×]\s+(?:faster|slower|cheaper|more\ expensive)\b
    | \bKL\b[^.\n]{0,40}?\d?\.\d                                # KL 0.0057, KL from ... 0.0086
    | \bperplexity\s+\(?[+\-−]\d                              # perplexity +2.35%
    | \bpasskey\b[^.\n]{0,30}?\b\d+/\d+\b                      # passkey 27/27
    | \btop-1\b[^.\n]{0,30}?\d+(?:\.\d+)?%                     # top-1 agreement 95.4%
    | \bmeasured\s+~?\d                                         # measured ~3x
    | ~\d+(?:\.\d+)?%\s+of\b                                   # ~6% of decode speed
    | \d%\s+of\s+(?:a\s+|the\s+)?(?:batch-1\s+)?decode\b          # 2% of a batch-1 decode step
""", re.VERBOSE | re.IGNORECASE)

# Files that still carry measurements, with the change that removes them (the list may only shrink).
KNOWN: set[str] = set()  # no file carries one


def docs_and_comments(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every docstring and comment."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def measurements(path: Path) -> list[str]:
    hits = []
    for line, text in docs_and_comments(path.read_text()):
        for offset, row in enumerate(text.splitlines()):
            if MEASUREMENT.search(row):
                hits.append(f"{path.relative_to(PACKAGE).as_posix()}:{line + offset}: {row.strip()}")
    return hits


def test_no_measurements_in_docstrings_or_comments():
    by_file: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if hits := measurements(path):
            by_file[path.relative_to(PACKAGE).as_posix()] = hits
    new = {name: hits for name, hits in by_file.items() if name not in KNOWN}
    assert not new, "measurements belong in BENCHMARKS.md (leave a pointer):\n" + "\n".join(
        hit for hits in new.values() for hit in hits)
    assert KNOWN - set(by_file) == set(), "clean now: remove these from KNOWN"


@pytest.mark.parametrize("text, measured", [
    ("costs ~300 us a layer", True),
    ("decode steps 1.25x faster", True),
    ("KL from the full-precision cache went 0.0086 -> 0.0057", True),
    ("perplexity +2.35% -> +0.67%", True),
    ("passkey retrieval 27/27 -> 23/27", True),
    ("top-1 agreement 94.8% -> 95.4%", True),
    ("(measured ~3x on CPU)", True),
    ("the rotation's matmuls cost ~6% of decode speed", True),
    ("about 2% of a batch-1 decode step on CPU", True),
    ("3.56x the tokens (36 bytes against 128)", False),
    ("KL divergence and top-1 agreement through the paged cache", False),
    ("Llama 3 (arXiv:2407.21783), section 2.1", False),
    ("e.g. 0.004 = +0.4%", False),
    ("/%68ealth-style tricks", False),
    ("(BENCHMARKS.md, \"KV-cache dtypes\")", False),
])
def test_the_pattern(text, measured):
    assert bool(MEASUREMENT.search(text)) == measured
