"""Turn the MODEL argument of `kvserve plan` into a `ModelArch`: a preset name, a config.json, a
model directory, a GGUF file, or nothing (the bundled default model). Reads metadata only."""
from __future__ import annotations

import json
import math
from pathlib import Path

from kvserve.model.loader import ModelLoadError, load_model_config, resolve_model_path
from kvserve.plan.arch import ConfigError, ModelArch, arch_from_hf_config, arch_from_model_config, hf_config_object
from kvserve.plan.presets import PRESETS


def load_arch(model: str | None) -> ModelArch:
    if model is not None and model.lower() in PRESETS:
        name = model.lower()
        preset = PRESETS[name]
        return arch_from_hf_config(hf_config_object(preset.config), name, "preset", num_params=preset.num_params)
    if model is not None and not Path(model).expanduser().exists():
        try:  # a hub id already in the local Hugging Face cache
            path = resolve_model_path(model)
        except ModelLoadError:
            raise ConfigError(f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}) nor an existing "
                              "config.json, model directory or GGUF file") from None
    else:
        path = resolve_model_path(model)  # None -> the bundled default GGUF
    if path.suffix == ".gguf":
        config, file_bytes = load_model_config(path)
        return arch_from_model_config(config, path.stem, "gguf", file_bytes, str(path), _gguf_tensors(path))
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ConfigError(f"{path}: not a config.json, a directory holding one, or a .gguf file")
    return _arch_from_config_file(config_file)


def _arch_from_config_file(config_file: Path) -> ModelArch:
    try:
        data = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{config_file}: malformed config: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{config_file}: malformed config: expected a JSON object")
    weights = sorted(config_file.parent.glob("*.safetensors"))
    try:
        return arch_from_hf_config(hf_config_object(data), config_file.parent.name, "config",
                                   num_params=_safetensors_params(weights) if weights else None,
                                   file_bytes=sum(f.stat().st_size for f in weights) or None,
                                   path=str(config_file))
    except ConfigError as exc:
        raise ConfigError(f"{config_file}: {exc}") from None


def _safetensors_params(files: list[Path]) -> int:
    """Exact parameter count from the safetensors headers (shapes only; no tensor is read)."""
    from safetensors import safe_open

    total = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        except Exception as exc:
            raise ConfigError(f"{file}: cannot read the safetensors header ({exc})") from None
    return total


def _gguf_tensors(path) -> tuple[tuple[str, int, bool, int | None], ...]:
    """Each tensor of a GGUF as (role, values, whether a matrix, bits --quantization auto keeps it
    at): Q4_0/Q4_1/Q4_K 4, every other quantized type 8 (gguf_file.served_bits), float types
    None (served at --dtype). A fused layer whose parts differ in bits is served at 8; counted here
    at its parts' own. Reads the tensor table only."""
    from kvserve.model.gguf_file import read_gguf, served_bits

    rows = []
    for tensor in read_gguf(path).tensors:
        role = {"token_embd.weight": "embedding", "output.weight": "lm_head"}.get(tensor.name, "other")
        values = 1
        for dim in tensor.shape:
            values *= dim
        is_matrix = len(tensor.shape) == 2
        rows.append((role, values, is_matrix, served_bits(tensor.type_id) if is_matrix else None))
    return tuple(rows)
