"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a packed token batch and a paged KV cache.

RMSNorm, RoPE, grouped-query attention, SwiGLU MLP; Qwen3 adds an RMSNorm of each query and key
head before RoPE (QK-norm, arXiv:2505.09388). q/k/v and gate/up projections are fused into one
matmul each (fewer, larger matmuls: what a batch-1 decode step on CPU is bound by).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.cache.kv_cache import KVCache
from kvserve.model.attention import AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.cpu_linear import prepack_linears, prepacking_available
from kvserve.model.lean_decode import LeanDecoder
from kvserve.model.rope import RotaryEmbedding
from kvserve.model.weight_check import expected_weight_shapes


def _fused(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along rows; a meta stand-in for parts not read (torch.cat on meta tensors
    would import torch._dynamo and Triton: a second of every start)."""
    if any(part.is_meta for part in parts):
        return torch.empty((sum(part.shape[0] for part in parts), *parts[0].shape[1:]), device="meta")
    return torch.cat(parts)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fixed_order = False  # --deterministic (batch_invariant.py): one row as any other

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and not self.fixed_order:
            # One row (batch-1 decode): layer_norm over [x, -x], whose mean is 0 and variance
            # mean(x^2), is RMSNorm in one fused kernel (float32 inside, rounded once to x's
            # dtype, as below). torch's rms_norm runs as several small ops, which at one row cost
            # more than the arithmetic (BENCHMARKS.md, "Offline throughput"). At 32 rows the
            # doubled width made it slower, so batches keep rms_norm.
            size = x.shape[-1]
            normed = F.layer_norm(torch.cat((x, -x), dim=-1), (2 * size,), None, None, self.eps)
            return self.weight * normed[..., :size]
        # Normalise in float32, cast back, then scale: the reference's order of operations.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.window = config.sliding_windows[layer_idx]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        # Qwen3's per-head norms over head_dim (one weight shared by every head), before RoPE; else None.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # [kv_heads, head_dim] subtracted from every key before it is cached, or None
        # (kvserve/engine/key_centering.py: attention is unchanged, quantization error shrinks).
        self.key_center: torch.Tensor | None = None
        # float32 key and query transforms T, T^-T [kv_heads, head_dim, head_dim]: keys cached as k·T, or
        # None (kvserve/engine/key_basis.py: scores are unchanged, fp8 rounding disturbs them less).
        self.key_basis: tuple[torch.Tensor, torch.Tensor] | None = None
        # Under tensor parallelism (parallel.py): the sum over ranks of o_proj's partial outputs.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.fused: ModuleType | None = None  # fused_ops, where the platform installs it (CUDA)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """qkv -> the attention backend (RoPE, the store, attention: model/attention/) -> o_proj."""
        heads = self.qkv_proj(x).view(x.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            heads = self.norm_heads(heads)
        out = self.o_proj(meta.backend.forward(self, heads, rope, kv_cache, meta))
        return out if self.reduce is None else self.reduce(out)

    def norm_heads(self, heads: torch.Tensor) -> torch.Tensor:
        """[tokens, heads + 2 kv_heads, head_dim] with the query and key heads RMS-normalised (Qwen3)."""
        q, k, v = heads.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=1)
        # every head of every token one row of the norm
        return torch.cat((self.q_norm(q.reshape(-1, self.head_dim)).view_as(q),
                          self.k_norm(k.reshape(-1, self.head_dim)).view_as(k), v), dim=1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # as Attention.reduce
        self.fused: ModuleType | None = None  # as Attention.fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            out = self.down_proj(self.fused.silu_mul(self.gate_up_proj(x)))
            return out if self.reduce is None else self.reduce(out)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # An uninitialised table (the checkpoint's replaces it): on the meta device nn.Embedding's
        # random init runs through torch's reference ops, whose import pulls in torch._dynamo.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope: RotaryEmbedding | None = None
        # Decode-only steps through fused C++ ops (lean_decode.py), set by the CPU platform where it applies.
        self.lean: LeanDecoder | None = None
        # fused_ops (Triton: residual add + RMSNorm, SiLU x up, RoPE), set by the CUDA platform.
        self.fused: ModuleType | None = None
        # Every layer on its fixed-order path (--deterministic, batch_invariant.py).
        self.batch_invariant = False

    @classmethod
    def from_hf_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                        dtype: torch.dtype, device: torch.device,
                        shard: Callable[["LlamaForCausalLM"], None] | None = None,
                        prepack: bool = True,
                        replace_linears: Callable[[nn.Module], None] | None = None,
                        weights_cut: bool = False,
                        unread: Callable[["LlamaForCausalLM"], Collection[str]] | None = None) -> "LlamaForCausalLM":
        """Build on the meta device (no throw-away random init), then adopt the checkpoint tensors.
        `shard` (tensor parallelism, parallel.shard_model) cuts the model down before it moves to
        `device` (`weights_cut`: the checkpoint tensors are the shard's already, so it cuts the
        empty model before they load); `replace_linears` may swap linear layers (quantization)
        before the rest are prepacked; `prepack=False` leaves the linears plain, to be sharded
        later (`prepack()`). `unread(model)`: HF names of weights `replace_linears` replaces without
        reading them (served from a checkpoint's quantized blocks): not read from `weights` at all."""
        with torch.device("meta"):
            model = cls(config)
        if shard is not None and weights_cut:
            shard(model)
        model.load_hf_state_dict(weights, unread(model) if unread is not None else ())
        if shard is not None and not weights_cut:
            shard(model)
        model.rope = RotaryEmbedding(config, max_positions, dtype)
        # Linears are swapped where the checkpoint lies, before the move: on an accelerator the
        # dense weights of quantized layers never arrive (a QuantizedLinear takes its codes to
        # `device` itself, and the move leaves them be).
        if replace_linears is not None:
            replace_linears(model)
        left = [name for name, p in model.named_parameters() if p.is_meta]
        if left:
            raise RuntimeError(f"weights {left[:3]} were neither read nor replaced")
        model = model.to(device=device, dtype=dtype).eval()
        if prepack:
            model.prepack()
        return model

    def prepack(self) -> None:
        """Hold the linears' weights in oneDNN's layout where that runs faster (cpu_linear.py)."""
        weight = self.embed_tokens.weight
        if prepacking_available(weight.device, weight.dtype):
            prepack_linears(self)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [tokens] -> float32 logits [len(logits_rows), vocab].

        Only the rows that will be sampled go through the LM head (a prefill chunk needs none
        or one): for a 135M model the head is a fifth of the weights."""
        return self.compute_logits(self.final_hidden(input_ids, positions, kv_cache, meta, logits_rows))

    @torch.inference_mode()
    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                     meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        """The decoder stack over the packed batch: the final-normed hidden states of `rows`
        [len(rows), hidden] (the LM head's input), so a caller can take logits a slice at a time."""
        x = self.embed_tokens(input_ids)
        rope = self.rope(positions)
        if self.lean is not None and self.lean.applies(x.shape[0], kv_cache, meta):
            x = self.lean.run(x, rope, kv_cache, meta)
        elif self.fused is not None:
            return self._fused_layers(x, rope, kv_cache, meta, rows)
        else:
            for layer in self.layers:
                x = layer(x, rope, kv_cache, meta)
        return self.norm(x[rows])

    def _fused_layers(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                      meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        """The decoder stack with the residual stream carried between fused add + RMSNorm launches
        (vLLM's pattern): the same sums, rounded the same way, as DecoderLayer.forward."""
        add_rms_norm, residual = self.fused.add_rms_norm, None
        for layer in self.layers:
            normed, residual = add_rms_norm(x, residual, layer.input_layernorm.weight, layer.input_layernorm.eps)
            attended = layer.self_attn(normed, rope, kv_cache, meta)
            normed, residual = add_rms_norm(attended, residual, layer.post_attention_layernorm.weight,
                                            layer.post_attention_layernorm.eps)
            x = layer.mlp(normed)
        return add_rms_norm(x[rows], residual[rows], self.norm.weight, self.norm.eps)[0]

    def use_fused_ops(self, fused: ModuleType | None) -> None:
        """Run the layers' small steps through `fused` (fused_ops), or torch ops with None."""
        self.fused = fused
        for layer in self.layers:
            layer.self_attn.fused = layer.mlp.fused = fused

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [rows, hidden] -> float32 logits [rows, vocab]."""
        return self.lm_head(hidden).float()

    def set_key_centers(self, centers: list[torch.Tensor] | None) -> None:
        """One [kv_heads, head_dim] vector per layer to subtract from the keys it caches, or None."""
        weight = self.embed_tokens.weight
        for i, layer in enumerate(self.layers):
            layer.self_attn.key_center = None if centers is None else centers[i].to(weight.device, weight.dtype)

    def set_key_bases(self, transforms: list[torch.Tensor] | None) -> None:
        """One key transform T [kv_heads, head_dim, head_dim] per layer (keys cached as k·T,
        queries turned by T^-T), or None."""
        for i, layer in enumerate(self.layers):
            if transforms is None:
                layer.self_attn.key_basis = None
            else:
                # applied in float32 (attention.base.change_key_basis), on the model's device
                transform = transforms[i].to(self.embed_tokens.weight.device, torch.float32)
                layer.self_attn.key_basis = (transform, torch.linalg.inv(transform).mT.contiguous())

    def load_hf_state_dict(self, weights: Mapping[str, torch.Tensor], unread: Collection[str] = ()) -> None:
        """Load HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...), fusing q/k/v and gate/up.
        The names in `unread` are not read: meta tensors of their shapes stand in, for the caller to replace."""
        shapes = expected_weight_shapes(self.config) if unread else {}
        weights = {k.removeprefix("model."): torch.empty(shapes[k], device="meta") if k in unread else weights[k]
                   for k in weights}
        own = {}
        for i in range(self.config.num_layers):
            p = f"layers.{i}."
            for kind in ("weight", "bias"):
                parts = [weights.pop(f"{p}self_attn.{n}_proj.{kind}", None) for n in "qkv"]
                if all(t is not None for t in parts):
                    own[f"{p}self_attn.qkv_proj.{kind}"] = _fused(parts)
            own[f"{p}mlp.gate_up_proj.weight"] = _fused(
                [weights.pop(f"{p}mlp.gate_proj.weight"), weights.pop(f"{p}mlp.up_proj.weight")])
        own.update(weights)
        if self.config.tie_word_embeddings:
            own.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)
        missing = [k for k in missing if not (k == "lm_head.weight" and self.config.tie_word_embeddings)]
        unexpected = [k for k in unexpected if "rotary_emb" not in k]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the architecture: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
