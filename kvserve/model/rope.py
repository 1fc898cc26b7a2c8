"""Rotary position embeddings (Su et al. 2021), in the rotate-half convention HF Llama checkpoints use.

Frequencies for scaled variants (linear, Llama-3, YaRN, LongRoPE) come from transformers'
`ROPE_INIT_FUNCTIONS`, so kvserve rotates exactly as the reference implementation does.
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], attention_scaling) for the model's RoPE type; a GGUF's frequency
    factors divide the default frequencies (as llama.cpp applies its rope_freqs tensor)."""
    if config.rope_type == "default":
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
        inv_freq = 1.0 / (config.rope_theta**exponents)
        if config.rope_freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[config.rope_type](config.hf_config, torch.device("cpu"))


class RotaryEmbedding(nn.Module):
    """cos and signed sin tables for positions [0, max_positions), indexed by each token's
    position. signed_sin is sin with its first half negated (see apply_rotary)."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        # Computed in float32 and then cast, like the reference, so low-precision runs agree with it.
        self.register_buffer("cos", (angles.cos() * scaling).to(dtype), persistent=False)
        signed_sin = angles.sin() * scaling
        signed_sin[:, : inv_freq.shape[0]].neg_()
        self.register_buffer("signed_sin", signed_sin.to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [tokens, 1, head_dim] for the tokens' positions; computed once per
        step and shared by all layers."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] (rotate-half convention): the reference's
    x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1], is computed as
    x * cos + [x2, x1] * [-sin1, sin2]. The products are the same numbers (negation is exact),
    and swapping the halves is one `roll` instead of two slices, a negation and a concatenation
    (fewer ops matter at batch 1 on CPU; BENCHMARKS.md, "Offline throughput")."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin
