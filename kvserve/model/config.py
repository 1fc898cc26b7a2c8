"""The architecture facts kvserve needs from a Hugging Face config, in one plain dataclass."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3"}
# Architectures that RMS-normalise each query and key head before RoPE (q_norm, k_norm over head_dim).
QK_NORM_ARCHITECTURES = {"qwen3"}
# RoPE variants whose frequencies do not depend on the running sequence length. "dynamic" NTK
# rescales with the current length, which a paged cache of already-rotated keys cannot follow.
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}


# More positions than any model is trained for: a context length above it is a corrupt file, and
# tables sized from it (RoPE, the KV pool) would exhaust memory before any other check.
MAX_CONTEXT_LENGTH = 2 ** 30
# Likewise for the other counts (far above any published model): something is sized from each of
# them (a tuple per layer, tensors per head) before the weights say otherwise.
MAX_COUNTS = {"vocab_size": 2 ** 24, "hidden_size": 2 ** 20, "intermediate_size": 2 ** 22,
              "num_hidden_layers": 2 ** 12, "num_attention_heads": 2 ** 12, "head_dim": 2 ** 12,
              "num_key_value_heads": 2 ** 12, "max_position_embeddings": MAX_CONTEXT_LENGTH}


class UnsupportedModelError(ValueError):
    """The model cannot be served by kvserve; the message says why."""


def _given(value: Any, default: Any) -> Any:
    """`value` unless it is missing (None): a 0 read from a file is kept, to be refused."""
    return default if value is None else value


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_values(cfg: Any, num_heads: Any, head_dim: Any, rope_theta: float, rope: dict) -> None:
    """The config's numbers are ones a model can have: positive counts whose divisions hold, a
    context length below MAX_CONTEXT_LENGTH and finite, positive RoPE and norm parameters. Checked
    before anything is sized from them; the message names the field and its value."""
    counts = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
              "num_attention_heads": num_heads, "head_dim": head_dim,
              "num_key_value_heads": _given(getattr(cfg, "num_key_value_heads", None), num_heads),
              "max_position_embeddings": cfg.max_position_embeddings}
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UnsupportedModelError(f"invalid config: {name} = {value!r} (must be a positive integer)")
    if counts["max_position_embeddings"] > MAX_CONTEXT_LENGTH:
        raise UnsupportedModelError(f"invalid config: max_position_embeddings (context length) = "
                                    f"{counts['max_position_embeddings']} is more than {MAX_CONTEXT_LENGTH} tokens")
    for name, value in counts.items():
        if value > MAX_COUNTS[name]:
            raise UnsupportedModelError(f"invalid config: {name} = {value} is more than any model has "
                                        f"({MAX_COUNTS[name]}); the file is corrupt")
    if num_heads % counts["num_key_value_heads"]:
        raise UnsupportedModelError(f"invalid config: num_key_value_heads = {counts['num_key_value_heads']} does not "
                                    f"divide num_attention_heads = {num_heads}")
    if head_dim % 2:
        raise UnsupportedModelError(f"invalid config: head_dim = {head_dim} is odd (RoPE rotates pairs)")
    floats = {"rope_theta": rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
              **{f"rope_scaling.{k}": v for k, v in rope.items() if k in ("factor", "original_max_position_embeddings")}}
    for name, value in floats.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise UnsupportedModelError(f"invalid config: {name} = {value!r} (must be a finite positive number)")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    # Per layer: the number of most recent tokens (itself included) a query may attend to, or None.
    sliding_windows: tuple[int | None, ...]
    rope_type: str
    rope_theta: float
    eos_token_ids: tuple[int, ...]
    # Qwen3: each query and key head RMS-normalised over head_dim (one weight per projection) before RoPE.
    qk_norm: bool = False
    # A GGUF's rope_freqs tensor (llama.cpp's form of Llama 3.1's RoPE scaling): each of the
    # head_dim / 2 default frequencies divided by its factor. None: the frequencies rope_type gives.
    rope_freq_factors: tuple[float, ...] | None = None
    hf_config: Any = field(repr=False, compare=False, default=None)

    @property
    def num_params(self) -> int:
        """Parameter count of the decoder (embedding and lm_head counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_hf(cls, cfg: Any) -> "ModelConfig":
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r}: kvserve serves {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or (
            cfg.hidden_size // num_heads if _is_count(num_heads) and _is_count(cfg.hidden_size) else None)
        rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported RoPE scaling {rope_type!r}: kvserve supports {sorted(SUPPORTED_ROPE_TYPES)}"
            )
        rope_theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        if getattr(cfg, "partial_rotary_factor", 1.0) not in (None, 1.0):
            raise UnsupportedModelError("partial rotary embeddings are not supported")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported activation {cfg.hidden_act!r} (SwiGLU/silu only)")

        # before anything is sized from the counts (a window per layer below)
        _check_values(cfg, num_heads, head_dim, rope_theta, rope)
        num_layers = cfg.num_hidden_layers
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if model_type in ("qwen2", "qwen3") and not getattr(cfg, "use_sliding_window", False):
            window = None
        if window and layer_types:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:
            windows = (window or None,) * num_layers

        eos = getattr(cfg, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            architecture=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=_given(getattr(cfg, "num_key_value_heads", None), num_heads),
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama, Mistral and Qwen3 say so in attention_bias.
            attention_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            sliding_windows=windows,
            rope_type=rope_type,
            rope_theta=rope_theta,
            eos_token_ids=eos_ids,
            qk_norm=model_type in QK_NORM_ARCHITECTURES,
            hf_config=cfg,
        )
