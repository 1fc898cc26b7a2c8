"""Byte sizes as users write them (4GiB, 512MiB, 8GB) and as logs print them; every layer may use it."""
from __future__ import annotations

import re

GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """'4GiB', '4 GB', '512MiB', '1e9', 4294967296 -> bytes. GB is 10^9, GiB is 2^30."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"cannot parse size {text!r}: use bytes or a unit like 512MiB, 4GiB, 8GB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def format_size(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.2f} GB ({num_bytes / GiB:.2f} GiB)"
