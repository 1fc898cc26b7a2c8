"""The few model facts the engine checks before it loads weights: context length and KV cache shape.

`load_model_config` gives them too, but for a Hugging Face directory it builds a transformers
config, and importing transformers takes seconds. Here config.json is read as plain JSON; where a
value is missing (a transformers default would apply) or the file is unexpected, `read_model_shape`
falls back to `load_model_config`. A GGUF's header is read as the loader reads it (milliseconds).
The engine compares this shape with the loaded config's afterwards.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from kvserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError


@dataclass(frozen=True)
class ModelShape:
    max_position_embeddings: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int  # query heads and the MLP width: what tensor parallelism splits
    intermediate_size: int
    # the sliding window every layer attends to (Mistral v0.1); None: full attention, or windows
    # that differ between layers (the KV manager then releases nothing)
    sliding_window: int | None = None

    @classmethod
    def of(cls, config: ModelConfig) -> "ModelShape":
        windows = set(config.sliding_windows)
        return cls(config.max_position_embeddings, config.num_layers, config.num_kv_heads, config.head_dim,
                   config.num_heads, config.intermediate_size, windows.pop() if len(windows) == 1 else None)


def read_model_shape(model: str | os.PathLike | None) -> ModelShape:
    """The shape of `model` (a path, hub id or None = the default) without loading weights.
    Raises the loader's errors (ModelLoadError, UnsupportedModelError) for a bad model."""
    from kvserve.model.loader import load_model_config, resolve_model_path

    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        return ModelShape.of(_gguf_config(path))
    try:
        shape = _config_json_shape(path / "config.json")
    except (OSError, ValueError):  # the loader's reader names the problem
        shape = None
    return shape or ModelShape.of(load_model_config(path)[0])


def _gguf_config(path: Path) -> ModelConfig:
    """load_model_config for a GGUF, with the loader's message for a file it cannot parse."""
    from kvserve.model.gguf_file import read_gguf
    from kvserve.model.loader import ModelLoadError, _gguf_hf_config

    try:
        gguf_file = read_gguf(path)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF file ({type(exc).__name__}: {exc}); is it truncated?") from None
    has_output = any(t.name == "output.weight" for t in gguf_file.tensors)
    try:
        return ModelConfig.from_hf(_gguf_hf_config(gguf_file, has_output))
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{path}: {exc}") from None


def _config_json_shape(path: Path) -> ModelShape | None:
    """The shape from config.json's own values; None where one is missing or odd."""
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict) or raw.get("model_type") not in SUPPORTED_ARCHITECTURES:
        return None
    if raw.get("sliding_window") and (raw.get("use_sliding_window") or raw["model_type"] not in ("qwen2", "qwen3")):
        return None  # which layers the window applies to is ModelConfig's to say
    heads, hidden = raw.get("num_attention_heads"), raw.get("hidden_size")
    head_dim = raw.get("head_dim")
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads
    values = (raw.get("max_position_embeddings"), raw.get("num_hidden_layers"),
              raw.get("num_key_value_heads") or heads, head_dim, heads, raw.get("intermediate_size"))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    return ModelShape(*values)
