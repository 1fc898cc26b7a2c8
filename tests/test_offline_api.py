"""The offline `LLM` API given careless input: a one-line ValueError, and nothing half-queued."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")


def test_a_bad_prompt_in_a_batch_queues_none_of_it(llm):
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate(["a", "b", [10 ** 9]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    outputs = llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].finished and outputs[0].outputs[0].finished()  # vLLM: a method there


@pytest.mark.parametrize("prompt, message", [
    ({}, "'prompt' or 'prompt_token_ids'"),
    ("a\ud800b", "lone surrogate"),
    (3.5, "text, a list of token ids or a dict"),
])
def test_malformed_prompts_are_value_errors(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_chat_content_none_is_empty_text(llm):
    [none] = llm.chat([{"role": "user", "content": None}], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    [empty] = llm.chat([{"role": "user", "content": ""}], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert none.prompt_token_ids == empty.prompt_token_ids and none.outputs[0].token_ids == empty.outputs[0].token_ids
    with pytest.raises(ValueError, match="string 'role'"):
        llm.chat([{"content": "hi"}], use_tqdm=False)
