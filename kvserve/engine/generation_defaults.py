"""The model creator's sampling defaults, from its `generation_config.json` (vLLM's
`--generation-config`, default `auto`).

A request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets the
value the model ships (Qwen's temperature 0.7, top_p 0.8, ...) instead of the engine's own. The
file's `max_new_tokens` bounds a request without max_tokens (up to the context otherwise), caps
every HTTP request's max_tokens (vLLM's server-wide limit) and is `LLM.generate`'s default;
offline SamplingParams that set max_tokens keep it, as in vLLM. A value equal to transformers'
classic default (temperature 1.0, top_p 1.0, top_k 50, repetition_penalty 1.0) is not applied:
vLLM reads the file through `GenerationConfig.to_diff_dict`, which drops those on transformers 4
(on 5 the defaults are unset, and a shipped `top_k: 50` would otherwise switch top-k on). `do_sample`
is not read: a model that ships a temperature samples with it. `vllm` reads nothing (the
engine's defaults); a directory reads its generation_config.json. `--override-generation-config`
(a JSON object of the same six keys) is laid over either. A GGUF carries no generation config.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.sampling_params import SamplingParams

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_CLASSIC_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
GENERATION_KEYS = (*SAMPLING_KEYS, "max_new_tokens")
ENGINE_DEFAULTS = "vllm"  # vLLM's name for "the engine's own defaults"
# Commands whose workloads set every sampling field themselves do not take the two flags (and read
# no generation config: ENGINE_DEFAULTS).
GENERATION_CONFIG_ARGS = ("generation_config", "override_generation_config")


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, Any] = field(default_factory=dict)  # SAMPLING_KEYS the model sets
    max_tokens: int | None = None  # max_new_tokens (module docstring)

    def cap(self, max_tokens: int) -> int:
        return max_tokens if self.max_tokens is None else min(max_tokens, self.max_tokens)


def parse_overrides(value: str | dict | None) -> dict[str, Any]:
    """--override-generation-config as a dict of GENERATION_KEYS; ValueError naming the problem."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"--override-generation-config must be a JSON object such as "
                             f"'{{\"temperature\": 0.5}}', got {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--override-generation-config must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(GENERATION_KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config keys are {', '.join(GENERATION_KEYS)}; "
                         f"{', '.join(map(repr, unknown))} would do nothing")
    return value


def _read(directory: Path) -> dict[str, Any]:
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config: cannot read {directory / 'generation_config.json'}: {exc}") from None
    return {k: v for k, v in config.to_diff_dict().items() if k not in _CLASSIC_DEFAULTS or v != _CLASSIC_DEFAULTS[k]}


def load_generation_defaults(setting: str, model_path: Path, overrides: str | dict | None) -> GenerationDefaults:
    """The defaults `setting` (auto, vllm or a directory) and the overrides give; ValueError for a
    directory without generation_config.json or a value SamplingParams refuses."""
    if setting == "auto":
        found = model_path.is_dir() and (model_path / "generation_config.json").is_file()
        values = _read(model_path) if found else {}
    elif setting == ENGINE_DEFAULTS:
        values = {}
    else:
        directory = Path(setting).expanduser()
        if not (directory / "generation_config.json").is_file():
            raise ValueError(f"--generation-config {setting!r}: no generation_config.json there "
                             f"(use auto, {ENGINE_DEFAULTS} or a directory holding one)")
        values = _read(directory)
    values = {k: v for k, v in {**values, **parse_overrides(overrides)}.items()
              if k in GENERATION_KEYS and v is not None}
    max_tokens = values.pop("max_new_tokens", None)
    try:
        SamplingParams(**values, max_tokens=max_tokens)  # the same range checks as a request's
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the generation config's defaults are refused: {exc}") from None
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"the generation config's max_new_tokens must be at least 1, got {max_tokens}")
    return GenerationDefaults(values, max_tokens)
