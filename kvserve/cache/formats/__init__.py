"""KV storage formats, one module each. `make_kv_format` maps a --kv-cache-dtype name to one."""
from __future__ import annotations

import torch

from kvserve.cache.formats.full_precision import FullPrecisionFormat
from kvserve.cache.kv_cache import KVFormat

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Every accepted --kv-cache-dtype value.
KV_CACHE_DTYPES = ("auto", *_FLOAT_DTYPES)


def make_kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """The storage format for a --kv-cache-dtype value ("auto" = the model dtype)."""
    if kv_cache_dtype == "auto":
        return FullPrecisionFormat(model_dtype)
    if kv_cache_dtype in _FLOAT_DTYPES:
        return FullPrecisionFormat(_FLOAT_DTYPES[kv_cache_dtype])
    raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}")
