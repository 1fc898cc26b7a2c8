"""`/v1/embeddings` (OpenAI's API, vLLM's pooling of a decoder model): the engine's pooled vectors
against HF transformers' hidden states, then through the openai client against a real server:
float and base64 encodings, `dimensions`, `normalize`, `truncate_prompt_tokens`, the KV pool given back at
once, and on the default model paraphrases closer than unrelated sentences."""
from __future__ import annotations

import base64
import re

import httpx
import numpy as np
import openai
import pytest
import torch

from kvserve import LLM

TEXTS = ["It is a truth universally acknowledged", "Mr. Darcy"]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_embed_pools_hf_final_hidden_states(tiny_llama, pooling_type):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=4,
              pooling_type=pooling_type)  # chunks of 4 tokens: pooled across chunks
    free_before = llm.engine.kv_manager.pool.num_free_blocks
    for text in TEXTS:
        ids = llm.engine.tokenize(text)[1]
        with torch.no_grad():
            states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        pooled = states[-1] if pooling_type == "LAST" else states.mean(dim=0)
        expected = torch.nn.functional.normalize(pooled, dim=0)
        assert torch.allclose(llm.engine.embed(ids), expected, atol=1e-4)
    assert llm.engine.kv_manager.pool.num_free_blocks == free_before  # the blocks went back at once


def test_an_embedding_waits_for_a_busy_pool_instead_of_being_refused(tiny_llama):
    """With generation holding every block, an embedding was a 400 ("not enough free KV blocks"):
    now new requests wait (Scheduler.held_for) while the running ones finish and free the blocks,
    then it is computed; an input that can never fit is still refused at once."""
    from kvserve import SamplingParams

    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="128KiB", max_model_len=200)  # 15 blocks
    engine = llm.engine
    ids = engine.tokenize(TEXTS[0])[1] * 8
    for i in range(3):
        engine.add_request(list(range(5 + i, 85 + i)), SamplingParams(max_tokens=60, ignore_eos=True), f"gen{i}")
    while engine.num_free_blocks >= 4:
        engine.step()
    assert engine.embed_when_room(ids, True, "w") is None and engine.scheduler.held_for == {"w"}
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), "late")
    vector = None
    while vector is None:
        engine.step()
        assert not any(r.request_id == "late" for r in engine.scheduler.running)  # held back meanwhile
        vector = engine.embed_when_room(ids, True, "w")
    assert engine.scheduler.held_for == set()
    assert torch.allclose(vector, engine.embed(ids), atol=1e-5)
    while engine.has_unfinished_requests():  # the held-back request runs afterwards
        engine.step()
    with pytest.raises(ValueError, match="maximum context length"):
        engine.embed_when_room(list(range(5, 205)) * 2, True, "big")
    assert engine.scheduler.held_for == set()


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_embeddings_through_the_openai_client(tiny_server, client):
    response = client.embeddings.create(model="tiny", input=TEXTS)
    vectors = [np.array(d.embedding) for d in response.data]
    assert [d.index for d in response.data] == [0, 1] and all(v.shape == (64,) for v in vectors)
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
    assert response.usage.prompt_tokens == response.usage.total_tokens > 0
    # base64: float32 bytes, what the client decodes by default too
    raw = httpx.post(f"{tiny_server.base_url}/v1/embeddings",
                     json={"model": "tiny", "input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype=np.float32)
    assert np.allclose(decoded, vectors[0], atol=1e-6)
    ids = httpx.post(f"{tiny_server.base_url}/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    by_ids = client.embeddings.create(model="tiny", input=[ids], encoding_format="float").data[0].embedding
    assert np.allclose(by_ids, vectors[1], atol=1e-6)
    for dimensions in (64, 32):  # vLLM refuses any for a model without a Matryoshka representation
        with pytest.raises(openai.BadRequestError, match="does not support matryoshka representation"):
            client.embeddings.create(model="tiny", input="x", dimensions=dimensions)
    raw = client.embeddings.create(model="tiny", input=TEXTS[0], extra_body={"normalize": False}).data[0].embedding
    assert abs(np.linalg.norm(raw) - 1) > 1e-3 and np.allclose(raw / np.linalg.norm(raw), vectors[0], atol=1e-5)
    metrics = httpx.get(f"{tiny_server.base_url}/metrics").text
    assert float(re.search(r"^kvserve:kv_cache_usage_perc\S* (\S+)$", metrics, re.M).group(1)) == 0.0


def test_truncate_prompt_tokens_embeds_the_inputs_last_tokens(tiny_server, client):
    """vLLM's left truncation: the last k tokens (-1: max-model-len, 1024 here), so an input longer
    than the context is embedded instead of refused; 0, or more than max-model-len, is a 400."""
    ids = [5 + i % 300 for i in range(1100)]
    truncated = client.embeddings.create(model="tiny", input=[ids], extra_body={"truncate_prompt_tokens": 10})
    assert truncated.usage.prompt_tokens == 10
    assert np.allclose(truncated.data[0].embedding,
                       client.embeddings.create(model="tiny", input=[ids[-10:]]).data[0].embedding, atol=1e-6)
    whole = client.embeddings.create(model="tiny", input=[ids], extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == 1024
    text = client.embeddings.create(model="tiny", input="word " * 5000, extra_body={"truncate_prompt_tokens": 4})
    assert text.usage.prompt_tokens == 4
    for bad in (0, 2000):
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            client.embeddings.create(model="tiny", input="x", extra_body={"truncate_prompt_tokens": bad})
    with pytest.raises(openai.BadRequestError) as empty:
        client.embeddings.create(model="tiny", input=[])
    assert empty.value.body["param"] == "input"


@pytest.mark.slow
def test_default_model_paraphrases_are_closer_than_unrelated_sentences(server_factory):
    server = server_factory("--kv-cache-memory", "256MiB", "--max-model-len", "2048")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    triples = [("The cat sat on the mat.", "A cat was sitting on the rug.", "Interest rates rose sharply."),
               ("How do I bake bread at home?", "What is a recipe for homemade bread?", "The train leaves at noon."),
               ("She is reading a novel in the garden.", "In the garden, a woman reads a book.",
                "Stock markets fell on Monday.")]
    for triple in triples:
        a, b, c = (np.array(d.embedding) for d in client.embeddings.create(model=client.models.list().data[0].id,
                                                                         input=list(triple)).data)
        assert a @ b > a @ c, triple
