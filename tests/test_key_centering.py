"""Key centring (kvserve/engine/key_centering.py): subtracting a constant from every cached key of a
head leaves attention unchanged, the int4 cache calibrates its constants deterministically at
start-up, and the other formats store keys as they are."""
from __future__ import annotations

import torch

from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.loader import load_model


def _engine(path, loaded, **options) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(path), dtype="float32", kv_cache_memory="4MiB", max_model_len=256,
                                **options), loaded_model=loaded)


def _plain_and_offset_engines(path, seed: int) -> tuple[LLMEngine, LLMEngine]:
    """Two float32-cache engines on one checkpoint; the second subtracts a random vector
    (5 x standard normal) per layer and KV head from the keys it caches."""
    loaded = load_model(str(path))
    plain = _engine(path, loaded, kv_cache_dtype="float32")
    shifted = _engine(path, loaded, kv_cache_dtype="float32")
    cfg = shifted.model_config
    gen = torch.Generator().manual_seed(seed)
    shifted.model.set_key_centers([5 * torch.randn(cfg.num_kv_heads, cfg.head_dim, generator=gen)
                                   for _ in range(cfg.num_layers)])
    return plain, shifted


def test_any_constant_key_offset_leaves_the_logits_unchanged(tiny_llama):
    plain, shifted = _plain_and_offset_engines(tiny_llama, seed=1)
    tokens = list(range(3, 103))  # 100 tokens in chunks of 7: prefill chunks over cached, shifted keys
    expected = plain.score(tokens, chunk_size=7)
    got = shifted.score(tokens, chunk_size=7)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    # The offset really reached the cache: the stored keys (the first kv_heads rows) differ.
    kv_heads = shifted.model_config.num_kv_heads
    assert not torch.allclose(plain.kv_cache.layers[0]["kv"][:kv_heads], shifted.kv_cache.layers[0]["kv"][:kv_heads])


def test_int4_calibrates_key_centers_once_and_deterministically(tiny_llama):
    loaded = load_model(str(tiny_llama))
    first = _engine(tiny_llama, loaded, kv_cache_dtype="int4")
    second = _engine(tiny_llama, loaded, kv_cache_dtype="int4")
    cfg = first.model_config
    for a, b in zip(first.model.layers, second.model.layers):
        center = a.self_attn.key_center
        assert center is not None and center.shape == (cfg.num_kv_heads, cfg.head_dim)
        assert torch.isfinite(center).all() and center.abs().sum() > 0
        assert torch.equal(center, b.self_attn.key_center)
    # The calibration pass leaves the pool free for requests.
    assert first.num_free_blocks == first.num_blocks
    for dtype in ("float32", "fp8", "int8", "int4_kivi"):
        engine = _engine(tiny_llama, loaded, kv_cache_dtype=dtype)
        assert all(layer.self_attn.key_center is None for layer in engine.model.layers), dtype


def test_keys_stored_before_rope_under_eviction_are_not_centred(tiny_llama):
    # A request under KV eviction stores its keys before RoPE and rotates them when gathered;
    # centring those would not cancel in the softmax, so its scores must not depend on the centres.
    plain, shifted = _plain_and_offset_engines(tiny_llama, seed=2)
    tokens = list(range(3, 83))
    eviction = {"policy": "streaming", "budget": 128}  # nothing is evicted from 80 tokens
    expected = torch.cat(list(plain.score_chunks(tokens, 9, kv_eviction=eviction)))
    got = torch.cat(list(shifted.score_chunks(tokens, 9, kv_eviction=eviction)))
    assert torch.equal(got, expected)


def test_calibration_records_the_key_heads_rope_takes_under_qk_norm(tiny_model_factory):
    """Qwen3 norms each key head before RoPE: the calibration pass (which fits int4's key centres and
    fp8's key bases) records the normed heads, so its keys rotated are the keys the pool holds."""
    from kvserve.cache.block_pool import leading_block_ids
    from kvserve.engine.calibration import record_projections
    from kvserve.model.rope import apply_rotary

    path = tiny_model_factory("qwen3")
    engine = _engine(path, load_model(str(path)), kv_cache_dtype="float32")
    cfg, tokens = engine.model_config, 40
    recorded = record_projections(engine.runner, max_tokens=256, num_tokens=tokens)
    cos, signed_sin = engine.model.rope(torch.arange(tokens))
    heads, kv_heads, block_size = cfg.num_heads, cfg.num_kv_heads, engine.kv_cache.spec.block_size
    blocks = leading_block_ids(-(-tokens // block_size))
    for layer, qkv in enumerate(recorded):
        keys = apply_rotary(qkv[:, heads:heads + kv_heads], cos, signed_sin)  # [tokens, kv_heads, dim]
        pool = engine.kv_cache.layers[layer]["kv"][:kv_heads, blocks].reshape(kv_heads, -1, cfg.head_dim)
        assert torch.allclose(pool[:, :tokens].transpose(0, 1), keys, atol=1e-5), layer
