"""The attention-backend registry: a new backend is one module plus one registry entry, `auto`
says what it chose and why, and an explicit choice that cannot serve is a one-line error."""
from __future__ import annotations

import logging

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVCacheSpec
from kvserve.model.attention import attention_backend_names, make_attention_backend, registry

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPTS = ["It is a truth universally acknowledged", "Hello"]


def test_a_new_backend_is_one_module_and_one_registry_entry(monkeypatch, tiny_llama):
    from counting_backend import CountingBackend

    monkeypatch.setitem(registry.BACKENDS, "counting", "counting_backend:CountingBackend")
    assert "counting" in attention_backend_names()
    CountingBackend.calls = 0
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="4MiB", attention_backend="counting")
    assert llm.engine.attention_backend.name == "counting"
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert CountingBackend.calls > 0
    reference = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="4MiB", attention_backend="torch")
    assert got == [o.outputs[0].token_ids for o in reference.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_auto_logs_its_choice_and_what_it_passed_over(caplog):
    spec = KVCacheSpec(1, 2, 64, 16)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        backend = make_attention_backend("auto", make_kv_format("int4_kivi", torch.bfloat16), spec, torch.bfloat16,
                                         None, torch.device("cpu"))
    assert backend.name == "torch"
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Attention backend:")]
    assert line.startswith("Attention backend: torch ops (gathered blocks) (auto; not cpu_paged: ")
    assert "int4_kivi" in line


def test_an_unknown_backend_is_refused_with_the_names():
    with pytest.raises(ValueError, match="--attention-backend must be one of auto, torch, cpu_paged, triton"):
        LLM("unused", attention_backend="flash")
