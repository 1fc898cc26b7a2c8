"""The checkpoint's tensors against its own config, before any of them is used: every tensor the
model needs is present with the shape the config implies, so a config that disagrees with its
weights (a wrong hidden size, one layer too many) is one line naming the tensor, not a shape error
or KeyError from deep inside the model."""
from __future__ import annotations

import zlib
from typing import Callable

import torch

from kvserve.model.config import ModelConfig

DUMMY_STD = 0.02  # transformers' initializer_range


def dummy_weights(config: ModelConfig, cut: Callable[[str], "tuple[int, int, int] | None"] | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random weights of the config's shapes (vLLM's `--load-format dummy`): to measure a model's
    shapes without its checkpoint. Norm weights are ones, every other tensor is normal(0, 0.02),
    each from a seed of its own name (the same config gives the same weights, and a cut is a slice
    of them). `cut` as the loader's: only that part of a tensor (a tensor-parallel rank's)."""
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=dtype)
        else:
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            tensor = torch.randn(shape, generator=generator).mul_(DUMMY_STD).to(dtype)
        part = cut(name) if cut is not None else None
        if part is not None:  # rows of a matrix or a bias (dim 0), or columns of a matrix
            dim, start, stop = part
            tensor = (tensor[start:stop] if dim == 0 else tensor[:, start:stop]).clone()
        weights[name] = tensor
    return weights


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, for every tensor LlamaForCausalLM loads."""
    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            f"{p}input_layernorm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,),
            f"{p}self_attn.q_proj.weight": (q, h), f"{p}self_attn.k_proj.weight": (kv, h),
            f"{p}self_attn.v_proj.weight": (kv, h), f"{p}self_attn.o_proj.weight": (h, q),
            f"{p}mlp.gate_proj.weight": (inter, h), f"{p}mlp.up_proj.weight": (inter, h),
            f"{p}mlp.down_proj.weight": (h, inter),
        })
        if config.attention_bias:
            shapes.update({f"{p}self_attn.q_proj.bias": (q,), f"{p}self_attn.k_proj.bias": (kv,),
                           f"{p}self_attn.v_proj.bias": (kv,)})
        if config.qk_norm:
            shapes.update({f"{p}self_attn.q_norm.weight": (d,), f"{p}self_attn.k_norm.weight": (d,)})
    return shapes


def check_weight_shapes(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """`shapes`: the checkpoint's tensor names (HF's) and shapes. Raise ValueError naming the first
    missing tensor or the first whose shape the config does not imply (with the config values it
    follows from)."""
    for name, shape in expected_weight_shapes(config).items():
        found = shapes.get(name)
        if found is None:
            raise ValueError(f"the config says {config.num_layers} layers but the weights have no {name}"
                             if ".layers." in name else f"the weights have no {name}")
        if tuple(found) != shape:
            raise ValueError(
                f"tensor {name} has shape {list(found)} but the config implies {list(shape)} "
                f"(hidden_size={config.hidden_size}, intermediate_size={config.intermediate_size}, "
                f"num_attention_heads={config.num_heads}, num_key_value_heads={config.num_kv_heads}, "
                f"head_dim={config.head_dim}, vocab_size={config.vocab_size})")
