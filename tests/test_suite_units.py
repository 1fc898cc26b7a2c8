"""The two units of test files the xdist workers take (conftest.py): every file the side unit names
exists, so a renamed file cannot fall silently into the other unit and unbalance the run."""
from __future__ import annotations

from pathlib import Path

from conftest import SIDE_UNIT_FILES

TESTS = Path(__file__).resolve().parent


def test_every_side_unit_file_exists():
    assert sorted(name for name in SIDE_UNIT_FILES if not (TESTS / name).is_file()) == []
