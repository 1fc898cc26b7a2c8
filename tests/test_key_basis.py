"""Key bases (kvserve/engine/key_basis.py): keys cached as k·T with queries turned by T^-T leave the
model's outputs unchanged on every attention path; fp8 (e4m3) fits T at start-up, deterministically
(keeping the Hadamard rotation when there are too few calibration tokens), and the fitted T really
shrinks the score error of fp8 rounding."""
from __future__ import annotations

import torch

from kvserve.cache.formats.rotation import hadamard_rotation
from kvserve.engine.key_basis import fit_transforms, modelled_score_error
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.loader import load_model

from engine_runs import greedy_tokens


def _engine(path, loaded, kv_cache_dtype: str = "float32") -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(path), dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory="4MiB",
                                max_model_len=256, max_num_batched_tokens=40), loaded_model=loaded)


def _plain_and_transformed_engines(path) -> tuple[LLMEngine, LLMEngine]:
    """Two float32-cache engines on one checkpoint; the second caches keys in a random basis
    (identity + 0.3 x standard normal: far from orthogonal) per layer and KV head."""
    loaded = load_model(str(path))
    plain, transformed = _engine(path, loaded), _engine(path, loaded)
    cfg = transformed.model_config
    gen = torch.Generator().manual_seed(3)
    transformed.model.set_key_bases([
        torch.eye(cfg.head_dim) + 0.3 * torch.randn(cfg.num_kv_heads, cfg.head_dim, cfg.head_dim, generator=gen)
        for _ in range(cfg.num_layers)])
    return plain, transformed


def test_any_key_basis_leaves_the_logits_unchanged(tiny_llama):
    plain, transformed = _plain_and_transformed_engines(tiny_llama)
    tokens = list(range(3, 103))  # chunks of 7: prefill chunks attending to cached, transformed keys
    expected = plain.score(tokens, chunk_size=7)
    got = transformed.score(tokens, chunk_size=7)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    kv_heads = plain.model_config.num_kv_heads  # the keys really were stored in another basis
    assert not torch.allclose(plain.kv_cache.layers[0]["kv"][:kv_heads], transformed.kv_cache.layers[0]["kv"][:kv_heads])


def test_key_basis_gives_the_plain_greedy_tokens_on_every_path(tiny_llama):
    # Decodes of different lengths batched together, a lone decode once the others finish, chunked
    # prefill beside them, and a request under eviction (its keys stay in the plain basis).
    plain, transformed = _plain_and_transformed_engines(tiny_llama)
    prompts = {"long": (list(range(5, 125)), None), "short": (list(range(40, 49)), None),
               "mid": (list(range(60, 110)), None),
               "evicting": (list(range(7, 87)), {"policy": "streaming", "budget": 64})}
    assert greedy_tokens(transformed, prompts) == greedy_tokens(plain, prompts)


def test_fp8_e4m3_fits_its_key_bases_deterministically_and_other_formats_keep_none(tiny_llama):
    loaded = load_model(str(tiny_llama))
    first, second = _engine(tiny_llama, loaded, "fp8_e4m3"), _engine(tiny_llama, loaded, "fp8")
    for a, b in zip(first.model.layers, second.model.layers):
        assert a.self_attn.key_basis is not None
        key_transform, query_transform = a.self_attn.key_basis
        # The query transform is T^-T, so q·k is unchanged.
        eye = torch.eye(key_transform.shape[-1]).expand_as(key_transform)
        assert torch.allclose(query_transform.mT @ key_transform, eye, atol=1e-4)
        assert torch.equal(key_transform, b.self_attn.key_basis[0])  # same calibration tokens, same fit
    for dtype in ("float32", "fp8_e5m2", "int8", "int4"):
        engine = _engine(tiny_llama, loaded, dtype)
        assert all(layer.self_attn.key_basis is None for layer in engine.model.layers), dtype


def _fp8_score_error(query: torch.Tensor, key: torch.Tensor, transform: torch.Tensor) -> float:
    """Mean squared error of q·k when k·T is rounded to e4m3 with a power-of-two scale per key."""
    stored = key @ transform
    scale = torch.exp2(torch.ceil(torch.log2(stored.abs().amax(-1, keepdim=True) / 448)))
    rounded = (stored / scale).to(torch.float8_e4m3fn).float() * scale
    error = (query @ torch.linalg.inv(transform).mT) @ (rounded - stored).T
    return error.pow(2).mean().item()


def test_fitted_basis_shrinks_the_measured_fp8_score_error():
    # Queries and keys with a few large channels in common, as RoPE's slow pairs give real models.
    gen = torch.Generator().manual_seed(0)
    dim = 32
    spread = torch.ones(dim)
    spread[:3] = torch.tensor([12.0, 8.0, 5.0])
    mixing = torch.linalg.qr(torch.randn(dim, dim, generator=gen))[0] * 0.3 + torch.eye(dim)
    query = torch.randn(4096, dim, generator=gen) * spread @ mixing
    key = torch.randn(4096, dim, generator=gen) * spread @ mixing.T + 2.0
    query_moment, key_moment = query.T @ query / len(query), key.T @ key / len(key)
    hadamard = hadamard_rotation(dim, torch.float32, torch.device("cpu"))
    fitted = fit_transforms(query_moment, key_moment, hadamard)
    modelled = (modelled_score_error(fitted, query_moment, key_moment)
                / modelled_score_error(hadamard, query_moment, key_moment)).item()
    measured = _fp8_score_error(query, key, fitted) / _fp8_score_error(query, key, hadamard)
    assert modelled < 0.8, modelled
    assert measured < 0.8, measured
    # A per-channel scale on top changes neither: relative rounding makes it cancel.
    scaled = fitted * torch.exp2(torch.randint(-3, 4, (dim,), generator=gen).float())
    assert torch.allclose(modelled_score_error(scaled, query_moment, key_moment),
                          modelled_score_error(fitted, query_moment, key_moment), rtol=1e-3)


def test_too_few_calibration_tokens_keep_the_hadamard_rotation(tiny_llama):
    # max-model-len 32 allows a 32-token calibration prefill: too few for head_dim-sized moments.
    loaded = load_model(str(tiny_llama))
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_dtype="fp8", kv_cache_memory="4MiB",
                                  max_model_len=32), loaded_model=loaded)
    dim = engine.model_config.head_dim
    hadamard = hadamard_rotation(dim, torch.float32, torch.device("cpu"))
    assert 32 < 4 * dim
    for layer in engine.model.layers:
        assert torch.equal(layer.self_attn.key_basis[0], hadamard.expand_as(layer.self_attn.key_basis[0]))
