"""KV storage formats, one module each. `make_kv_format` maps a --kv-cache-dtype name to one.

Adding a storage dtype means one module with a `KVFormat` subclass (sizes, allocate, write,
gather; `in_place_layout` if a decode kernel can read it) and one entry in `FORMATS` below: the
engine, the planner (`value_bits`, `bytes_per_block`), the kernel choice (`in_place_layout`) and
eviction's compaction (`copies_token_rows`) all ask the format.
"""
from __future__ import annotations

from typing import Callable

import torch

from kvserve.cache.formats.fp8 import Fp8Format
from kvserve.cache.formats.full_precision import FullPrecisionFormat
from kvserve.cache.formats.int4 import Int4Format
from kvserve.cache.formats.int4_kivi import Int4KiviFormat
from kvserve.cache.formats.int8 import Int8Format
from kvserve.cache.kv_cache import KVFormat

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --kv-cache-dtype name -> the format ("auto" stores the model dtype).
FORMATS: dict[str, Callable[[], KVFormat]] = {
    **{name: (lambda dtype=dtype: FullPrecisionFormat(dtype)) for name, dtype in _FLOAT_DTYPES.items()},
    "fp8": lambda: Fp8Format("e4m3"),  # vLLM's meaning of plain "fp8"
    "fp8_e4m3": lambda: Fp8Format("e4m3"),
    "fp8_e5m2": lambda: Fp8Format("e5m2"),
    "int8": Int8Format,
    "int4": Int4Format,
    "int4_kivi": Int4KiviFormat,
}
# Every accepted --kv-cache-dtype value.
KV_CACHE_DTYPES = ("auto", *FORMATS)


def make_kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """The storage format for a --kv-cache-dtype value ("auto" = the model dtype)."""
    if kv_cache_dtype == "auto":
        return FullPrecisionFormat(model_dtype)
    if kv_cache_dtype not in FORMATS:
        raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    return FORMATS[kv_cache_dtype]()
