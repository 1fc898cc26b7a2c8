"""The offline `LLM` API given careless input: a one-line ValueError, and nothing half-queued."""
from __future__ import annotations

import dataclasses

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


def test_chat_takes_openai_text_parts_and_refuses_other_content(llm):
    """Text parts are their texts joined by newlines, as the server (and vLLM) read them."""
    greedy = SamplingParams(max_tokens=3, temperature=0)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    [from_parts] = llm.chat([{"role": "user", "content": parts}], greedy, use_tqdm=False)
    [from_text] = llm.chat([{"role": "user", "content": "Hello\nthere"}], greedy, use_tqdm=False)
    assert from_parts.prompt_token_ids == from_text.prompt_token_ids
    for content, message in [([{"type": "image_url", "image_url": {"url": "x"}}], "only text content parts"),
                             (7, "content must be text")]:
        with pytest.raises(ValueError, match=message):
            llm.chat([{"role": "user", "content": content}], greedy, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("params", [{"max_tokens": 4}, 5, [None]])
def test_sampling_params_of_another_type_are_a_type_error(llm, params):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate("hello", params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_token_ids_may_be_numpy_integers_but_not_floats(llm):
    np = pytest.importorskip("numpy")
    ids = llm.get_tokenizer().encode("The capital of France is")
    greedy = SamplingParams(max_tokens=4, temperature=0)
    [plain] = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
    for prompt in ({"prompt_token_ids": list(np.array(ids))}, {"prompt_token_ids": np.array(ids)},
                   np.array(ids), list(np.array(ids))):
        [numpy] = llm.generate(prompt, greedy, use_tqdm=False)
        assert numpy.prompt_token_ids == ids and numpy.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="token ids are integers"):
        llm.generate([[1, 2.0]], greedy, use_tqdm=False)


def test_prompt_dicts_take_a_cache_salt_and_refuse_keys_kvserve_would_ignore(llm):
    """vLLM's prompt dicts: `cache_salt` namespaces the prefix cache; multimodal keys are refused
    (kvserve's models read text only) rather than dropped."""
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 2
    params = SamplingParams(max_tokens=1)
    llm.generate({"prompt": text, "cache_salt": "a"}, params, use_tqdm=False)
    [same] = llm.generate({"prompt": text, "cache_salt": "a"}, params, use_tqdm=False)
    [other] = llm.generate({"prompt": text, "cache_salt": "b"}, params, use_tqdm=False)
    assert same.num_cached_tokens > 0 and other.num_cached_tokens == 0
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": "x"}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt": text, "cache_salt": ""}, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_use_tqdm_may_be_the_progress_class(llm):
    made = []

    class Progress:
        def __init__(self, total, desc):  # what vLLM passes such a class, less its display options
            made.append(total)
            self.updates = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def update(self, n):
            self.updates += n

    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=Progress)
    assert made == [2]


def test_vllm_seed_spellings(tiny_llama):
    """`LLM(seed=None)` seeds the global generator at random; a request's seed -1 is no seed."""
    assert SamplingParams(seed=-1).seed is None
    # a sample whose seed + index is -1 keeps that seed (it is not "no seed")
    assert [SamplingParams(seed=-2, n=3).for_child(i).seed for i in range(3)] == [-2, -1, 0]
    unseeded = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", seed=None)
    assert unseeded.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    unseeded.close()


def test_the_token_that_ends_the_sequence_is_not_in_its_text(llm):
    """vLLM's detokenizer: the stop token (EOS, or one of stop_token_ids, special or not) is not
    in the text, with skip_special_tokens=False too, unless include_stop_str_in_output (the token
    stays in token_ids)."""
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    ordinary = tokenizer.encode(" the")[-1]

    def first_forced(token: int, **options) -> tuple[str, list[int]]:
        params = SamplingParams(max_tokens=4, temperature=0, logit_bias={token: 100.0}, skip_special_tokens=False,
                                **options)
        completion = llm.generate("hello", params, use_tqdm=False)[0].outputs[0]
        assert completion.finish_reason == "stop"
        return completion.text, completion.token_ids
    assert first_forced(eos) == ("", [eos])
    assert first_forced(eos, include_stop_str_in_output=True) == (tokenizer.decode([eos]), [eos])
    assert first_forced(ordinary, stop_token_ids=[ordinary]) == ("", [ordinary])
    assert first_forced(ordinary, stop_token_ids=[ordinary], include_stop_str_in_output=True) == \
        (tokenizer.decode([ordinary]), [ordinary])


def test_embed_gives_vllms_shape_and_the_engines_pooled_vectors(llm):
    import torch
    outputs = llm.embed(["hello there", {"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)
    ids = llm.get_tokenizer().encode("hello there")
    assert [o.prompt_token_ids for o in outputs] == [ids, [1, 2, 3]] and all(o.finished for o in outputs)
    first = torch.tensor(outputs[0].outputs.embedding)
    assert first.shape == (llm.engine.model_config.hidden_size,)
    assert torch.allclose(first, llm.engine.embed(ids)) and abs(first.norm().item() - 1) < 1e-5
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.embed(["fine", [10 ** 9]], use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.num_blocks  # embeddings hold no KV blocks


def test_max_tokens_past_max_model_len_ends_the_sequence_there(llm):
    """vLLM's offline LLM: a prompt plus max_tokens longer than max-model-len is not refused; the
    sequence ends at max-model-len with "length" (a batch with such a prompt runs whole). A prompt
    that leaves no room is still refused (and the server's 400 stays: test_server)."""
    limit = llm.engine.max_model_len
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    near, short = llm.generate([{"prompt_token_ids": [7] * (limit - 4)}, "hello"], params, use_tqdm=False)
    assert [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in (near, short)] == \
        [(4, "length"), (16, "length")]
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([{"prompt_token_ids": [7] * limit}], params, use_tqdm=False)


def test_an_interrupted_generate_leaves_nothing_for_the_next_call(llm):
    """Ctrl-C (here a progress bar that raises after the first prompt) in the middle of generate():
    its unfinished requests are aborted, so the next call does not first compute them."""
    class Interrupting:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def update(self, n: int) -> None:
            raise KeyboardInterrupt

    long = SamplingParams(max_tokens=500, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", {"prompt_token_ids": [5] * 10}], [SamplingParams(max_tokens=1), long], use_tqdm=Interrupting)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == llm.engine.num_blocks
    [out] = llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """vLLM's SamplingParams.truncate_prompt_tokens: left truncation; -1 is max-model-len."""
    ids = list(range(10, 40))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    [cut, last] = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids[-5:]}],
                               [dataclasses.replace(params, truncate_prompt_tokens=5), params], use_tqdm=False)
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs[0].token_ids == last.outputs[0].token_ids
    [whole] = llm.generate([{"prompt_token_ids": ids}], dataclasses.replace(params, truncate_prompt_tokens=-1),
                           use_tqdm=False)
    assert whole.prompt_token_ids == ids
    for bad in (0, -2, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.generate([{"prompt_token_ids": ids}], dataclasses.replace(params, truncate_prompt_tokens=1 << 20),
                     use_tqdm=False)


def test_a_closed_llm_refuses_work_in_one_line(tiny_llama):
    """After close() (or a `with` block) the tiers are flushed and the tensor-parallel workers gone:
    generate/embed/score say so, where a TP engine failed deep in a collective."""
    with LLM(str(tiny_llama), dtype="float32", kv_cache_memory="4MiB") as llm:
        assert llm.generate(["Hi"], SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids
    for call in (lambda: llm.generate(["Hi"], use_tqdm=False), lambda: llm.embed(["Hi"], use_tqdm=False),
                 lambda: llm.engine.score([5, 6, 7])):
        with pytest.raises(RuntimeError, match="this engine is closed"):
            call()
