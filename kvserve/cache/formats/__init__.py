"""KV storage formats, one module each. `make_kv_format` maps a --kv-cache-dtype name to one.

Adding a storage dtype means adding one module with a `KVFormat` subclass (bytes_per_block,
allocate, write, gather) and one entry in `_QUANTIZED` below; nothing else in the engine changes.
"""
from __future__ import annotations

from typing import Callable

import torch

from kvserve.cache.formats.fp8 import Fp8Format
from kvserve.cache.formats.full_precision import FullPrecisionFormat
from kvserve.cache.formats.int4 import Int4Format
from kvserve.cache.formats.int4_kivi import Int4KiviFormat
from kvserve.cache.formats.int8 import Int8Format
from kvserve.cache.formats.token_scaled import TokenScaledFormat
from kvserve.cache.kv_cache import KVFormat
from kvserve.model.cpu_attention import PagedDecodeKernel

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_QUANTIZED: dict[str, Callable[[], KVFormat]] = {
    "fp8": lambda: Fp8Format("e4m3"),  # vLLM's meaning of plain "fp8"
    "fp8_e4m3": lambda: Fp8Format("e4m3"),
    "fp8_e5m2": lambda: Fp8Format("e5m2"),
    "int8": Int8Format,
    "int4": Int4Format,
    "int4_kivi": Int4KiviFormat,
}
# Every accepted --kv-cache-dtype value.
KV_CACHE_DTYPES = ("auto", *_FLOAT_DTYPES, *_QUANTIZED)


def make_kv_format(kv_cache_dtype: str, model_dtype: torch.dtype,
                   decode_kernel: PagedDecodeKernel | None = None) -> KVFormat:
    """The storage format for a --kv-cache-dtype value ("auto" = the model dtype). The formats the
    CPU decode kernel reads (full precision in the model dtype; fp8, int8 and int4 under a bfloat16
    or float32 model) take `decode_kernel`; the others (int4_kivi) gather."""
    if kv_cache_dtype == "auto" or _FLOAT_DTYPES.get(kv_cache_dtype) == model_dtype:
        return FullPrecisionFormat(model_dtype, decode_kernel)
    if kv_cache_dtype in _FLOAT_DTYPES:  # the kernel reads the pool in the queries' dtype
        return FullPrecisionFormat(_FLOAT_DTYPES[kv_cache_dtype])
    if kv_cache_dtype in _QUANTIZED:
        kv_format = _QUANTIZED[kv_cache_dtype]()
        if isinstance(kv_format, (TokenScaledFormat, Int4Format)) and model_dtype != torch.float16:
            kv_format.decode_kernel = decode_kernel
        return kv_format
    raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
