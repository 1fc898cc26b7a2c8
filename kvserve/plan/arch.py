"""What a model caches per token, layer by layer: the facts the KV-cache formula needs.

Calculators that multiply one `num_heads × head_dim` by the layer count get modern models wrong.
This description keeps, for every layer, the KV heads it really caches (grouped-query attention,
per-layer head counts), its sliding window, and for multi-head latent attention (MLA, DeepSeek-V2
paper, arXiv:2405.04434) the compressed latent and decoupled RoPE key that replace K and V.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kvserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig


class ConfigError(ValueError):
    """A model config lacks a field the planner needs, or holds an impossible value."""


@dataclass(frozen=True)
class AttentionLayer:
    """The per-token cache of one layer."""

    num_kv_heads: int  # heads whose K and V are both cached (0 for MLA)
    head_dim: int
    sliding_window: int | None = None  # tokens a query sees (itself included); None = all
    # MLA: one vector per token shared by all heads: kv_lora_rank latent + qk_rope_head_dim key.
    latent_dim: int = 0
    # Values per token the same layer would cache as plain multi-head attention (one K and V per
    # query head), for the GQA/MLA-vs-MHA comparison.
    mha_values_per_token: int = 0

    @property
    def values_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim + self.latent_dim

    def cached_tokens(self, seq_len: int) -> int:
        """Tokens whose K/V this layer must keep for a sequence of `seq_len` tokens."""
        return seq_len if self.sliding_window is None else min(seq_len, self.sliding_window)


@dataclass(frozen=True)
class ModelArch:
    name: str
    source: str  # "preset", "config" (a config.json) or "gguf"
    architecture: str  # the HF model_type
    layers: tuple[AttentionLayer, ...]
    num_attention_heads: int
    max_position_embeddings: int
    num_params: int | None  # None when the config alone cannot tell (and no weights are at hand)
    file_bytes: int | None = None  # checkpoint size on disk (GGUF file or safetensors files)
    path: str | None = None
    # GGUF only, per tensor: (role "embedding", "lm_head" or "other", values, whether a matrix, bits
    # --quantization auto keeps it at: 4, 8 or None); tied: the embedding also serves as LM head.
    gguf_tensors: tuple[tuple[str, int, bool, int | None], ...] | None = None
    tied_embedding: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_mla(self) -> bool:
        return any(layer.latent_dim for layer in self.layers)

    @property
    def uniform_kv_heads(self) -> int | None:
        """The KV head count if every layer has the same one (None for MLA or mixed layers)."""
        heads = {layer.num_kv_heads for layer in self.layers}
        return heads.pop() if len(heads) == 1 and not self.is_mla else None

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "mla"
        kv = self.uniform_kv_heads
        if kv == self.num_attention_heads:
            return "mha"
        return "mqa" if kv == 1 else "gqa"

    @property
    def has_sliding_window(self) -> bool:
        return any(layer.sliding_window is not None for layer in self.layers)

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer attends to the same one (Mistral v0.1); None otherwise."""
        windows = {layer.sliding_window for layer in self.layers}
        return windows.pop() if len(windows) == 1 else None

    @property
    def served_by_kvserve(self) -> bool:
        return self.architecture in SUPPORTED_ARCHITECTURES

    def layer_groups(self) -> list[tuple[AttentionLayer, int]]:
        """Distinct layer kinds with how many layers have each, in first-seen order."""
        return list(Counter(self.layers).items())


def _positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


def _require(cfg: Any, key: str) -> Any:
    value = getattr(cfg, key, None)
    if value is None:
        raise ConfigError(f"config has no {key!r}")
    return value


def _per_layer(value: Any, num_layers: int, key: str) -> list[int]:
    """A config value that is one int for all layers or a list with one per layer."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_layers:
            raise ConfigError(f"config field {key!r} lists {len(value)} values for {num_layers} layers")
        return [_positive(v, key) for v in value]
    return [_positive(value, key)] * num_layers


def _sliding_windows(cfg: Any, num_layers: int) -> list[int | None]:
    """The same rule the engine applies (kvserve.model.config.ModelConfig.from_hf), for any family:
    a window applies to the layers `layer_types` marks as sliding, or to all layers without it."""
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return [None] * num_layers
    window = _positive(window, "sliding_window")
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        if len(layer_types) != num_layers:
            raise ConfigError(f"config lists {len(layer_types)} layer_types for {num_layers} layers")
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * num_layers


def hf_config_object(data: dict) -> Any:
    """A config dict as transformers reads it (filling family defaults such as Gemma-2's
    alternating sliding layers); the dict itself for families transformers does not know or
    rejects (e.g. per-layer head-count lists)."""
    from transformers import AutoConfig

    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError("config has no 'model_type'")
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in data.items() if k != "model_type"})
    except Exception:
        return SimpleNamespace(**data)


def _count_params(cfg: Any) -> int | None:
    """The engine's parameter count for the families it serves; None for others."""
    if getattr(cfg, "model_type", None) not in SUPPORTED_ARCHITECTURES:
        return None
    try:
        return ModelConfig.from_hf(cfg).num_params
    except Exception:  # e.g. a RoPE variant the engine refuses; the count is then unknown
        return None


def arch_from_hf_config(cfg: Any, name: str, source: str, num_params: int | None = None,
                        file_bytes: int | None = None, path: str | None = None) -> ModelArch:
    """Describe any decoder from its HF config (a transformers config or a namespace of config.json)."""
    num_layers = _positive(_require(cfg, "num_hidden_layers"), "num_hidden_layers")
    num_heads = _per_layer(_require(cfg, "num_attention_heads"), num_layers, "num_attention_heads")
    windows = _sliding_windows(cfg, num_layers)
    kv_lora_rank = getattr(cfg, "kv_lora_rank", None)
    layers = []
    if kv_lora_rank:  # MLA caches the latent c_KV and the shared RoPE key k_R per token
        rope = _positive(_require(cfg, "qk_rope_head_dim"), "qk_rope_head_dim")
        nope = _positive(_require(cfg, "qk_nope_head_dim"), "qk_nope_head_dim")
        v_dim = _positive(_require(cfg, "v_head_dim"), "v_head_dim")
        latent = _positive(kv_lora_rank, "kv_lora_rank") + rope
        for heads, window in zip(num_heads, windows):
            layers.append(AttentionLayer(0, 0, window, latent, heads * (nope + rope + v_dim)))
    else:
        kv_value = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_kv_heads", None)
        kv_heads = _per_layer(kv_value, num_layers, "num_key_value_heads") if kv_value else num_heads
        head_dim = getattr(cfg, "head_dim", None)
        if head_dim is None:
            hidden = _positive(_require(cfg, "hidden_size"), "hidden_size")
            head_dims = [hidden // h for h in num_heads]
        else:
            head_dims = _per_layer(head_dim, num_layers, "head_dim")
        for heads, kv, dim, window in zip(num_heads, kv_heads, head_dims, windows):
            if kv > heads or heads % kv:
                raise ConfigError(f"{heads} attention heads cannot be grouped over {kv} KV heads")
            layers.append(AttentionLayer(kv, dim, window, 0, 2 * heads * dim))
    max_pos = _positive(_require(cfg, "max_position_embeddings"), "max_position_embeddings")
    return ModelArch(name=name, source=source, architecture=str(getattr(cfg, "model_type", "unknown")),
                     layers=tuple(layers), num_attention_heads=max(num_heads), max_position_embeddings=max_pos,
                     num_params=num_params if num_params is not None else _count_params(cfg),
                     file_bytes=file_bytes, path=path)


def arch_from_model_config(config: ModelConfig, name: str, source: str, file_bytes: int | None,
                           path: str | None, gguf_tensors: tuple[tuple[str, int, bool, int | None], ...] | None = None
                           ) -> ModelArch:
    """Describe a model the engine has already parsed (e.g. from GGUF metadata)."""
    mha = 2 * config.num_heads * config.head_dim
    layers = tuple(AttentionLayer(config.num_kv_heads, config.head_dim, w, 0, mha) for w in config.sliding_windows)
    return ModelArch(name=name, source=source, architecture=config.architecture, layers=layers,
                     num_attention_heads=config.num_heads, max_position_embeddings=config.max_position_embeddings,
                     num_params=config.num_params, file_bytes=file_bytes, path=path, gguf_tensors=gguf_tensors,
                     tied_embedding=config.tie_word_embeddings)
