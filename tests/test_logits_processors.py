"""SamplingParams.logits_processors: per-request callables that reshape a request's logits row
before the sampler's own transformations (the seam structured outputs plug their masks into)."""
from __future__ import annotations

import logging
import threading
from collections import Counter

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.outputs import top_logprobs
from kvserve.server.protocol import CompletionRequest

PROMPTS = ["It is a truth universally acknowledged", "The quick brown fox", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")


def params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **kwargs})


def generate(llm, prompts, sampling_params):
    return llm.generate(prompts, sampling_params, use_tqdm=False)


class Ban:
    def __init__(self, token: int):
        self.token = token

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[self.token] = float("-inf")
        return logits


class Force:
    """Allows only the next token of `target`; counts its own calls (state kept per sequence)."""

    def __init__(self, target: list[int]):
        self.target, self.calls = target, 0

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        assert len(output_token_ids) == self.calls, "called once per generated token, in order"
        forced = torch.full_like(logits, float("-inf"))
        forced[self.target[self.calls]] = 0.0
        self.calls += 1
        return forced  # a new tensor, not the row


def test_banned_token_never_appears_and_the_rest_of_the_batch_is_unchanged(llm):
    alone = [o.outputs[0].token_ids for o in generate(llm, PROMPTS, params())]
    banned, count = Counter(alone[0]).most_common(1)[0]
    assert count >= 1
    batch = generate(llm, PROMPTS, [params(logits_processors=[Ban(banned)]), params(), params()])
    tokens = [o.outputs[0].token_ids for o in batch]
    assert banned not in tokens[0] and len(tokens[0]) == 12
    first_ban = alone[0].index(banned)
    assert tokens[0][:first_ban] == alone[0][:first_ban], "identical until the banned token's turn"
    assert tokens[1:] == alone[1:], "requests without processors are untouched"


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.3, top_p=0.9, top_k=50, seed=1,
                                                                repetition_penalty=1.3, presence_penalty=1.0)])
def test_a_forcing_processor_produces_its_sequence(llm, sampling, tiny_tokenizer):
    target = [5, 9, 5, 17, 3, 40]
    out = generate(llm, PROMPTS[0], params(max_tokens=len(target), logits_processors=[Force(target)], **sampling))
    assert out[0].outputs[0].token_ids == target
    assert out[0].outputs[0].finish_reason == "length"


def test_processors_run_in_order_and_logprobs_stay_raw(llm):
    greedy = generate(llm, PROMPTS[0], params(max_tokens=1, logprobs=1))[0].outputs[0]
    order = []

    def first(ids, logits):
        order.append("first")
        return logits

    def second(ids, logits):
        order.append("second")
        logits[greedy.token_ids[0]] = float("-inf")
        return logits

    banned = generate(llm, PROMPTS[0], params(max_tokens=1, logprobs=1, logits_processors=[first, second]))
    out = banned[0].outputs[0]
    assert order == ["first", "second"] and out.token_ids != greedy.token_ids
    # The model's own distribution: the banned greedy token is still its top choice.
    assert top_logprobs(out.logprobs[0], 1) == top_logprobs(greedy.logprobs[0], 1)


def test_a_failing_processor_fails_only_its_request(llm, caplog):
    def explode(ids, logits):
        if len(ids) == 3:
            raise RuntimeError("grammar has no state for this token")
        return logits

    def wrong_shape(ids, logits):
        return logits[:10]

    alone = [o.outputs[0].token_ids for o in generate(llm, PROMPTS, params())]
    with caplog.at_level(logging.WARNING, logger="kvserve.engine.sampler"):
        batch = generate(llm, PROMPTS, [params(logits_processors=[explode]), params(),
                                        params(logits_processors=[wrong_shape])])
    first, second, third = (o.outputs[0] for o in batch)
    assert first.finish_reason == "error" and first.token_ids == alone[0][:3]
    assert third.finish_reason == "error" and third.token_ids == []
    assert second.finish_reason == "length" and second.token_ids == alone[1]
    # The text holds only the tokens kept, and the output says why the request failed.
    assert first.text == generate(llm, PROMPTS[0], params(max_tokens=3))[0].outputs[0].text and third.text == ""
    assert "explode failed" in batch[0].error and "wrong_shape failed" in batch[2].error and batch[1].error is None
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "explode failed: RuntimeError: grammar has no state for this token" in messages
    assert "wrong_shape failed: TypeError: returned a tensor of shape (10,)" in messages
    assert not llm.engine.has_unfinished_requests()
    assert generate(llm, PROMPTS[:1], params())[0].outputs[0].token_ids == alone[0], "the engine goes on"


def test_each_of_n_samples_gets_its_own_copy(llm):
    target = [7, 8, 9, 10]
    template = Force(target)
    out = generate(llm, PROMPTS[0], params(n=3, max_tokens=4, logits_processors=[template]))[0]
    assert [c.token_ids for c in out.outputs] == [target] * 3, "a shared counter would skip tokens"
    assert template.calls == 0, "the caller's object is a template when n > 1"

    single = Force(target)
    generate(llm, PROMPTS[0], params(max_tokens=4, logits_processors=[single]))
    assert single.calls == 4, "with n == 1 the object given is the one called"


def test_processors_that_cannot_be_copied_are_refused_when_n_is_above_1(llm):
    class Holder:
        def __init__(self):
            self.lock = threading.Lock()

        def __call__(self, ids, logits):
            return logits

    with pytest.raises(ValueError, match="cannot be deep-copied"):
        generate(llm, PROMPTS[0], params(n=2, logits_processors=[Holder()]))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="callables"):
        SamplingParams(logits_processors=["not a function"])


def test_processors_are_not_an_api_field():
    body = CompletionRequest(prompt="hi", logits_processors=["os.system"])
    assert body.sampling_params(16, None).logits_processors == []
    assert "logits_processors" in body.unknown_fields()  # logged as ignored, like any unknown key
