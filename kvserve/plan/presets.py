"""Published architectures as data, so `kvserve plan llama-3-70b` needs no network.

Each preset is the part of the model's `config.json` on the Hugging Face hub that decides the KV
cache and the parameter count (the URL is beside it), plus the parameter count. Dense counts equal
`ModelConfig.num_params` of the same fields (tests/test_plan.py checks it); the MoE and MLA counts
are the published totals (Mixtral's 46.7B; DeepSeek-V3's 671B main model, without the 14B
multi-token-prediction module), which are also what their shapes multiply out to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preset:
    config: dict[str, Any]  # config.json fields
    num_params: int
    source: str  # where the numbers come from


def _llama(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int, max_pos: int,
           **extra: Any) -> dict[str, Any]:
    return dict(model_type="llama", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                max_position_embeddings=max_pos, **extra)


def _qwen3(hidden: int, inter: int, layers: int, heads: int, tie_word_embeddings: bool) -> dict[str, Any]:
    """Qwen3's dense models: 8 KV heads of 128 at every width, 151,936 tokens, 40,960 positions."""
    return dict(model_type="qwen3", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                max_position_embeddings=40960, rope_theta=1000000.0, use_sliding_window=False, sliding_window=None,
                tie_word_embeddings=tie_word_embeddings)


PRESETS: dict[str, Preset] = {
    "llama-2-7b": Preset(_llama(4096, 11008, 32, 32, 32, 32000, 4096), 6_738_415_616,
                         "https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json"),
    "llama-2-13b": Preset(_llama(5120, 13824, 40, 40, 40, 32000, 4096), 13_015_864_320,
                          "https://huggingface.co/meta-llama/Llama-2-13b-hf/blob/main/config.json"),
    "llama-2-70b": Preset(_llama(8192, 28672, 80, 64, 8, 32000, 4096), 68_976_648_192,
                          "https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json"),
    "llama-3-8b": Preset(_llama(4096, 14336, 32, 32, 8, 128256, 8192, rope_theta=500000.0), 8_030_261_248,
                         "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json"),
    "llama-3-70b": Preset(_llama(8192, 28672, 80, 64, 8, 128256, 8192, rope_theta=500000.0), 70_553_706_496,
                          "https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json"),
    "llama-3.2-1b": Preset(
        _llama(2048, 8192, 16, 32, 8, 128256, 131072, rope_theta=500000.0, tie_word_embeddings=True,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        1_235_814_400, "https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json"),
    "llama-3.1-405b": Preset(
        _llama(16384, 53248, 126, 128, 8, 128256, 131072, rope_theta=500000.0,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        405_853_388_800, "https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json"),
    "mistral-7b": Preset(
        dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
             sliding_window=4096),
        7_241_732_096, "https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json"),
    "mixtral-8x7b": Preset(
        dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
             num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
        46_702_792_704, "https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json"),
    "qwen2.5-7b": Preset(
        dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
             num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072,
             rope_theta=1000000.0, use_sliding_window=False, sliding_window=131072, tie_word_embeddings=False),
        7_615_616_512, "https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json"),
    "qwen2.5-72b": Preset(
        dict(model_type="qwen2", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
             num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, max_position_embeddings=131072,
             rope_theta=1000000.0, use_sliding_window=False, sliding_window=131072, tie_word_embeddings=False),
        72_706_203_648, "https://huggingface.co/Qwen/Qwen2.5-72B/blob/main/config.json"),
    # Qwen3: heads of 128 whatever the width (16 x 128 over a 1,024-wide 0.6B), and q/k norms.
    "qwen3-0.6b": Preset(_qwen3(1024, 3072, 28, 16, tie_word_embeddings=True), 596_049_920,
                         "https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json"),
    "qwen3-8b": Preset(_qwen3(4096, 12288, 36, 32, tie_word_embeddings=False), 8_190_735_360,
                       "https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json"),
    # Gemma 2 alternates local (sliding, 4,096 tokens) and global attention layers, starting local.
    "gemma-2-9b": Preset(
        dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
             num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
             max_position_embeddings=8192, sliding_window=4096, tie_word_embeddings=True),
        9_241_705_984, "https://huggingface.co/google/gemma-2-9b/blob/main/config.json"),
    # MLA: each layer caches a 512-dim latent plus a 64-dim RoPE key per token (DeepSeek-V3 report,
    # arXiv:2412.19437, section 2.1.1), instead of 128 heads of K (192) and V (128).
    "deepseek-v3": Preset(
        dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
             num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
             max_position_embeddings=163840, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
             first_k_dense_replace=3),
        671_026_419_200, "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json"),
    "smollm2-135m": Preset(
        _llama(576, 1536, 30, 9, 3, 49152, 8192, rope_theta=100000.0, tie_word_embeddings=True),
        134_515_008, "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json"),
}
