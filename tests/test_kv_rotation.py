"""A KV cache stored in a rotated basis (K·R and V·R, kvserve/cache/formats/rotation.py) leaves the
model's outputs unchanged: attention rotates the queries and un-rotates its output, on every path
(batched, lone and evicting decodes, prefill chunks). Checked with float32 storage, so any
difference comes from the rotation's bookkeeping, not from a quantizer."""
from __future__ import annotations

import torch

from kvserve.cache.formats.full_precision import FullPrecisionFormat
from kvserve.cache.formats.rotation import hadamard_rotation
from kvserve.engine import loading
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.loader import load_model

from engine_runs import greedy_tokens


class RotatedFloat32(FullPrecisionFormat):
    """float32 K/V stored as K·H and V·H."""

    def __init__(self) -> None:
        super().__init__(torch.float32)

    def rotation(self, head_dim, dtype, device):
        return hadamard_rotation(head_dim, dtype, device)

    def write(self, pool, key, value, slot_mapping):
        rotation = self.rotation(key.shape[-1], torch.float32, key.device)
        super().write(pool, key.float() @ rotation, value.float() @ rotation, slot_mapping)


def _plain_and_rotated_engines(path, monkeypatch) -> tuple[LLMEngine, LLMEngine]:
    loaded = load_model(str(path))
    args = EngineArgs(model=str(path), dtype="float32", kv_cache_dtype="float32", kv_cache_memory="4MiB",
                      max_model_len=256, max_num_batched_tokens=40)
    plain = LLMEngine(args, loaded_model=loaded)
    monkeypatch.setattr(loading, "make_kv_format", lambda name, dtype: RotatedFloat32())
    rotated = LLMEngine(args, loaded_model=loaded)
    return plain, rotated


def test_rotated_cache_gives_the_plain_cache_logits(tiny_llama, monkeypatch):
    plain, rotated = _plain_and_rotated_engines(tiny_llama, monkeypatch)
    tokens = list(range(3, 103))  # chunks of 7: prefill chunks attending to cached, rotated K/V
    expected = plain.score(tokens, chunk_size=7)
    got = rotated.score(tokens, chunk_size=7)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    # The pool really holds the rotated basis: the stored K/V differ.
    assert not torch.allclose(plain.kv_cache.layers[0]["kv"], rotated.kv_cache.layers[0]["kv"])


def test_rotated_cache_gives_the_plain_greedy_tokens(tiny_llama, monkeypatch):
    # Decodes of different lengths batched together, a lone decode once the others finish, chunked
    # prefill beside them, and a request under eviction (keys stored before RoPE, rotated when read).
    plain, rotated = _plain_and_rotated_engines(tiny_llama, monkeypatch)
    prompts = {"long": (list(range(5, 125)), None), "short": (list(range(40, 49)), None),
               "mid": (list(range(60, 110)), None),
               "evicting": (list(range(7, 87)), {"policy": "streaming", "budget": 64})}
    assert greedy_tokens(rotated, prompts) == greedy_tokens(plain, prompts)
