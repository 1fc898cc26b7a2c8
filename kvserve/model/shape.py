"""The few model facts the engine checks before it loads weights: context length and KV cache shape.

`load_model_config` gives them too, but builds a transformers config (importing transformers takes
seconds) and, for a GGUF file, parses the whole tokenizer from its metadata. Here config.json is
read as JSON and a GGUF header with `struct`, arrays skipped, in milliseconds. Where a value is
missing (a transformers default would apply) or config.json is unexpected, `read_model_shape`
falls back to `load_model_config`. The engine compares this shape with the loaded config's afterwards.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig


@dataclass(frozen=True)
class ModelShape:
    max_position_embeddings: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: ModelConfig) -> "ModelShape":
        return cls(config.max_position_embeddings, config.num_layers, config.num_kv_heads, config.head_dim)


def read_model_shape(model: str | os.PathLike | None) -> ModelShape:
    """The shape of `model` (a path, hub id or None = the default) without loading weights.
    Raises the loader's errors (ModelLoadError, UnsupportedModelError) for a bad model."""
    from kvserve.model.loader import ModelLoadError, load_model_config, resolve_model_path

    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        try:
            shape = _gguf_shape(path)
        except (OSError, ValueError, struct.error) as exc:
            raise ModelLoadError(f"{path}: cannot read GGUF file ({type(exc).__name__}: {exc}); "
                                 f"is it truncated?") from None
    else:
        try:
            shape = _config_json_shape(path / "config.json")
        except (OSError, ValueError):  # the loader's reader names the problem
            shape = None
    return shape or ModelShape.of(load_model_config(path)[0])


def _shape(max_len: Any, layers: Any, heads: Any, kv_heads: Any, head_dim: Any, hidden: Any) -> ModelShape | None:
    """A shape from raw values, or None unless every needed one is a positive int."""
    kv_heads = kv_heads or heads
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads
    values = (max_len, layers, kv_heads, head_dim)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    return ModelShape(*values)


def _config_json_shape(path: Path) -> ModelShape | None:
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict) or raw.get("model_type") not in SUPPORTED_ARCHITECTURES:
        return None
    return _shape(raw.get("max_position_embeddings"), raw.get("num_hidden_layers"), raw.get("num_attention_heads"),
                  raw.get("num_key_value_heads"), raw.get("head_dim"), raw.get("hidden_size"))


def _gguf_shape(path: Path) -> ModelShape | None:
    """The keys and defaults of the loader's GGUF -> HF config mapping."""
    meta = read_gguf_scalars(path)
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        return None
    heads = meta.get(f"{arch}.attention.head_count")
    return _shape(meta.get(f"{arch}.context_length", 2048), meta.get(f"{arch}.block_count"), heads,
                  meta.get(f"{arch}.attention.head_count_kv", heads), meta.get(f"{arch}.rope.dimension_count"),
                  meta.get(f"{arch}.embedding_length"))


# GGUF value types -> struct format (little-endian); 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_scalars(path: Path) -> dict[str, Any]:
    """Every scalar and string metadata value of a GGUF v2/v3 file (arrays, such as the
    tokenizer's vocabulary, are skipped)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, _, num_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (big-endian or too old)")
        offset, values = 24, {}
        for _ in range(num_fields):
            key, offset = _read_string(buf, offset)
            (value_type,) = struct.unpack_from("<I", buf, offset)
            offset += 4
            if value_type in _SCALARS:
                values[key] = struct.unpack_from(_SCALARS[value_type], buf, offset)[0]
            elif value_type == _STRING:
                values[key] = _read_string(buf, offset)[0]
            offset = _skip_value(buf, offset, value_type)
        return values


def _read_string(buf: mmap.mmap, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, offset)
    end = offset + 8 + length
    return buf[offset + 8:end].decode("utf-8"), end


def _skip_value(buf: mmap.mmap, offset: int, value_type: int) -> int:
    """The offset after a value, reading only the lengths inside it."""
    if value_type in _SCALARS:
        return offset + struct.calcsize(_SCALARS[value_type])
    if value_type == _STRING:
        return offset + 8 + struct.unpack_from("<Q", buf, offset)[0]
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, offset)
        offset += 12
        if item_type in _SCALARS:
            return offset + count * struct.calcsize(_SCALARS[item_type])
        for _ in range(count):
            offset = _skip_value(buf, offset, item_type)
        return offset
    raise ValueError(f"unknown GGUF value type {value_type}")
