"""Structured outputs in the engine (SamplingParams.structured_outputs, llguidance): what a
constrained request generates is always valid, whatever else the engine does to it (batching with
unconstrained requests, n > 1, stop strings, each KV dtype, prefix-cache hits, eviction,
preemption), and a constraint that does not compile is refused before anything is queued."""
from __future__ import annotations

import json
import re

import pytest
import torch

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.cache.formats import KV_CACHE_DTYPES
from kvserve.engine.structured_output import GrammarMasks, unpack_banned
from kvserve.outputs import top_logprobs

PROMPTS = ["It is a truth universally acknowledged", "The quick brown fox", "Once upon a time",
           "My dear Mr. Bennet"]
# Bounded: every path through it ends within a few tokens, so even random weights complete it.
SCHEMA = {"type": "object",
          "properties": {"size": {"type": "integer", "minimum": 0, "maximum": 99},
                         "colour": {"enum": ["red", "green", "blue"]},
                         "ok": {"type": "boolean"}},
          "required": ["size", "colour", "ok"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-c]{2}"
SMALL_POOL = "96KiB"  # too small for four sequences of the preemption test at once
CHOICES = ["Elizabeth", "Darcy", "Jane"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")


def constrained(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def params(so: StructuredOutputsParams | None = None, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 48, "structured_outputs": so, **kwargs})


def generate(llm, prompts, sampling_params):
    return llm.generate(prompts, sampling_params, use_tqdm=False)


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"size", "colour", "ok"}, text
    assert isinstance(value["size"], int) and 0 <= value["size"] <= 99, text
    assert value["colour"] in ("red", "green", "blue") and isinstance(value["ok"], bool), text
    assert text == json.dumps(value), "no free whitespace: one space after ':' and ',' (disable_any_whitespace)"


KINDS = {
    "json": (lambda: constrained(json=SCHEMA), check_schema),
    "regex": (lambda: constrained(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    "choice": (lambda: constrained(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(t)),
    "json_object": (lambda: constrained(json_object=True, disable_any_whitespace=True),
                    lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
    "grammar": (lambda: constrained(grammar='start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'),
                lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t) or pytest.fail(t)),
}


def check_bounded(output, kind: str) -> None:
    """A bounded constraint's output: complete, valid, finished with stop."""
    completion = output.outputs[0]
    assert completion.finish_reason == "stop", (kind, completion)
    KINDS[kind][1](completion.text)


def test_constrained_and_unconstrained_requests_batch_together(llm):
    """Every kind is valid in a batch with unconstrained requests, whose greedy output is the one
    they get alone."""
    alone = [o.outputs[0].token_ids for o in generate(llm, PROMPTS, params(ignore_eos=True, max_tokens=16))]
    kinds = list(KINDS)
    prompts = PROMPTS + [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    batch = generate(llm, prompts, [params(ignore_eos=True, max_tokens=16)] * len(PROMPTS)
                     + [params(KINDS[k][0]()) for k in kinds])
    assert [o.outputs[0].token_ids for o in batch[:len(PROMPTS)]] == alone
    for output, kind in zip(batch[len(PROMPTS):], kinds):
        check_bounded(output, kind)


def test_constraint_changes_what_an_unconstrained_run_generates(llm):
    """The mask is really applied: the random model's free output does not match, the constrained does."""
    free = generate(llm, PROMPTS[0], params(max_tokens=12, ignore_eos=True))[0].outputs[0].text
    assert not re.fullmatch(REGEX, free)
    check_bounded(generate(llm, PROMPTS[0], params(constrained(regex=REGEX)))[0], "regex")


def test_each_of_n_samples_follows_its_own_grammar_state(llm):
    outputs = generate(llm, PROMPTS[:2], params(constrained(json=SCHEMA), n=6, temperature=1.0, seed=3))
    texts = set()
    for output in outputs:
        assert len(output.outputs) == 6
        for completion in output.outputs:
            assert completion.finish_reason == "stop"
            check_schema(completion.text)
            texts.add(completion.text)
    assert len(texts) > 1, "sampling at temperature 1 gives different valid objects"


def test_streamed_steps_are_prefixes_of_the_final_valid_output(llm):
    engine = llm.engine
    request_id = engine.add_request(PROMPTS[1], params(constrained(json=SCHEMA)))
    seen = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                seen.append(output.outputs[0].text)
    final = seen[-1]
    check_schema(final)
    assert len(seen) > 3 and all(final.startswith(text) for text in seen)


def test_stop_string_ends_a_constrained_output(llm):
    out = generate(llm, PROMPTS[0], params(constrained(regex="abc-[0-9]{4}-xyz"), stop=["-"]))[0].outputs[0]
    assert out.text == "abc" and out.finish_reason == "stop" and out.stop_reason == "-"


def test_max_tokens_cut_finishes_with_length_and_a_valid_prefix(llm):
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}}, "required": ["story"]}
    out = generate(llm, PROMPTS[0], params(constrained(json=schema), max_tokens=16))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 16
    assert out.text.startswith('{"story": "') and '"}' not in out.text


def test_eos_is_allowed_only_where_the_grammar_accepts(llm):
    """A model that wants nothing but EOS still completes the constraint, then stops: EOS is masked
    until the grammar accepts (`[0-9]+` accepts after one digit, so the output is one digit)."""
    eos = llm.engine.eos_token_ids[0]

    def want_eos(output_token_ids, logits):
        logits[eos] += 1000.0
        return logits

    for regex, pattern in ((REGEX, REGEX), ("[0-9]+", "[0-9]")):
        out = generate(llm, PROMPTS[0], params(constrained(regex=regex), logits_processors=[want_eos]))[0].outputs[0]
        assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop", (regex, out)


def test_ignore_eos_and_min_tokens_cannot_push_past_a_completed_grammar(llm):
    for extra in ({"ignore_eos": True}, {"min_tokens": 20}):
        out = generate(llm, PROMPTS[2], params(constrained(choice=CHOICES), max_tokens=40, **extra))[0].outputs[0]
        assert out.text in CHOICES and out.finish_reason == "stop", extra


def test_free_whitespace_only_when_asked(llm):
    """disable_any_whitespace (the default) allows exactly json.dumps' form; off, any JSON whitespace."""
    tokenizer = llm.get_tokenizer()

    def accepts(text: str, disable_any_whitespace: bool) -> bool:
        matcher = llm.engine.grammars.matcher(constrained(json=SCHEMA, disable_any_whitespace=disable_any_whitespace))
        return all(matcher.accept(t) is None for t in tokenizer.encode(text)) and matcher.matcher.is_accepting()

    canonical = json.dumps({"size": 7, "colour": "red", "ok": True})
    padded = '{ "size" :  7 ,\n "colour": "red", "ok": true }'
    compact = json.dumps({"size": 7, "colour": "red", "ok": True}, separators=(",", ":"))
    assert accepts(canonical, True) and not accepts(padded, True) and not accepts(compact, True)
    assert accepts(canonical, False) and accepts(padded, False) and accepts(compact, False)


@pytest.mark.parametrize("kv_cache_dtype", [d for d in KV_CACHE_DTYPES if d != "auto"])
def test_every_kv_cache_dtype(tiny_llama, kv_cache_dtype):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory="4MiB")
    kinds = list(KINDS)
    outputs = generate(llm, PROMPTS[:len(kinds)] + PROMPTS[:1], [params(KINDS[k][0]()) for k in kinds])
    for output, kind in zip(outputs, kinds):
        check_bounded(output, kind)


def test_prefix_cache_hit_gives_the_same_constrained_output(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=True)
    prompt = " ".join(PROMPTS * 4)  # several blocks
    first = generate(llm, prompt, params(constrained(json=SCHEMA)))[0]
    second = generate(llm, prompt, params(constrained(json=SCHEMA)))[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    check_bounded(second, "json")


def test_kv_eviction_keeps_the_output_valid(llm):
    out = generate(llm, " ".join(PROMPTS * 6), params(constrained(json=SCHEMA),
                                                      kv_eviction={"policy": "streaming", "budget": 48,
                                                                   "sink_tokens": 4}))[0]
    assert len(out.prompt_token_ids) > 2 * 48, "the prompt does not fit the budget: tokens are evicted"
    check_bounded(out, "json")


def test_preemption_recompute_does_not_disturb_the_grammar(llm, tiny_llama):
    """A pool too small for the batch preempts and recomputes sequences; the matcher follows the
    output tokens, so the constrained outputs equal those of an engine with room for everyone."""
    small = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_POOL, max_model_len=160)
    long_schema = {"type": "object", "properties": {"words": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]},
                                                              "minItems": 8, "maxItems": 8}},
                   "required": ["words"], "additionalProperties": False}
    prompts = [p + " " + p for p in PROMPTS]
    sp = params(constrained(json=long_schema), max_tokens=100)
    expected = [o.outputs[0].token_ids for o in generate(llm, prompts, sp)]
    outputs = generate(small, prompts, sp)
    assert small.engine.scheduler.num_preemptions > 0, "the small pool must preempt for this test to mean anything"
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for o in outputs:
        assert o.outputs[0].finish_reason == "stop" and len(json.loads(o.outputs[0].text)["words"]) == 8


def test_padded_vocabulary_rows_are_masked(tiny_model_factory):
    """A model vocabulary larger than the tokenizer's: its padded rows are never sampled under a
    grammar, even when a logits processor makes one the most likely."""
    path = tiny_model_factory("llama", vocab_size=600)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="4MiB")
    tokenizer_size = len(llm.get_tokenizer())
    assert tokenizer_size < 600

    def boost_padding(output_token_ids, logits):
        logits[tokenizer_size:] += 1000.0
        return logits

    free = generate(llm, PROMPTS[0], params(max_tokens=4, ignore_eos=True, logits_processors=[boost_padding]))
    assert all(t >= tokenizer_size for t in free[0].outputs[0].token_ids)
    out = generate(llm, PROMPTS[0], params(constrained(json_object=True), max_tokens=24,
                                           logits_processors=[boost_padding]))[0].outputs[0]
    assert out.token_ids and all(t < tokenizer_size for t in out.token_ids)
    assert out.text.startswith("{")


def test_logprobs_stay_those_of_the_raw_distribution(llm):
    free = generate(llm, PROMPTS[0], params(max_tokens=1, logprobs=3))[0].outputs[0]
    masked = generate(llm, PROMPTS[0], params(constrained(choice=CHOICES), max_tokens=1, logprobs=3))[0].outputs[0]
    raw, entry = free.logprobs[0], masked.logprobs[0]
    token = masked.token_ids[0]
    assert token != free.token_ids[0], "the constraint picked another token than the free argmax"
    assert [t for t, _ in top_logprobs(entry, 3)] == [t for t, _ in top_logprobs(raw, 3)]
    assert [e.logprob for _, e in top_logprobs(entry, 3)] == pytest.approx([e.logprob for _, e in top_logprobs(raw, 3)])
    assert entry[token].logprob < raw[free.token_ids[0]].logprob and entry[token].rank > 1
    if entry[token].rank > 3:  # a sampled token outside the top 3 comes first, beside them (vLLM's k + 1)
        assert next(iter(entry)) == token and len(entry) == 4


def test_a_schema_is_compiled_once(llm):
    grammars = llm.engine.grammars
    schema = {"type": "object", "properties": {"only_here": {"type": "boolean"}}, "required": ["only_here"]}
    generate(llm, PROMPTS[0], params(constrained(json=schema)))
    cached = grammars.num_cached
    generate(llm, PROMPTS, params(constrained(json=json.dumps(schema))))  # same schema as text
    assert grammars.num_cached == cached


@pytest.mark.parametrize("so, message", [
    (dict(regex="[a-"), "unclosed character class"),
    (dict(grammar="start: missing_rule"), "unknown name"),
    (dict(json="{not json"), "Invalid grammar specification"),
    (dict(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "not"),
    (dict(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (dict(json={"$ref": "#/definitions/missing"}), "missing"),
    (dict(json={"type": "strange"}), "strange"),
])
def test_constraints_that_do_not_compile_are_refused_before_queueing(llm, so, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.engine.add_request(PROMPTS[0], params(constrained(**so)))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, message", [
    (dict(regex="a", choice=["a"]), "only use one kind"),
    (dict(), "must use one kind"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["a", 1]), "non-empty list"),
    (dict(json=3), "JSON schema"),
])
def test_malformed_structured_outputs_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_mask_unpacking_matches_llguidance_bit_order(llm):
    """GrammarMasks' table unpacking agrees bit for bit with the bitmask llguidance writes."""
    import llguidance.torch as llg_torch

    grammars = llm.engine.grammars
    matcher = grammars.matcher(StructuredOutputsParams(regex="[a-z]+ ?[0-9]"))
    vocab = llm.engine.model_config.vocab_size
    allowed = GrammarMasks(vocab, torch.device("cpu")).allowed([matcher])[0]
    words = llg_torch.allocate_token_bitmask(1, grammars.ll_tokenizer.vocab_size)
    llg_torch.fill_next_token_bitmask(matcher.matcher, words, 0)
    expected = torch.tensor([bool((int(words[0, t // 32]) >> (t % 32)) & 1) for t in range(vocab)])
    assert torch.equal(allowed, expected) and 0 < int(allowed.sum()) < vocab


def test_the_device_path_unpacks_and_applies_as_the_cpu_path(llm):
    """What a CUDA engine runs (torch shifts on the device, masked_fill on a row subset), checked on
    CPU against the numpy path: same banned tokens, unconstrained rows untouched."""
    import llguidance.torch as llg_torch

    matchers = [llm.engine.grammars.matcher(StructuredOutputsParams(choice=CHOICES)),
                llm.engine.grammars.matcher(StructuredOutputsParams(regex="[0-9]+"))]
    vocab = llm.engine.model_config.vocab_size
    masks = GrammarMasks(vocab, torch.device("cpu"))
    words = llg_torch.allocate_token_bitmask(2, llm.engine.grammars.ll_tokenizer.vocab_size)
    for i, m in enumerate(matchers):
        llg_torch.fill_next_token_bitmask(m.matcher, words, i)
    assert torch.equal(unpack_banned(words, vocab), masks.banned(matchers))
    logits = torch.zeros(vocab, 4).t()  # not contiguous: apply takes the torch path
    masks.apply(logits, [0, 2], matchers)
    assert torch.equal(torch.isinf(logits[[0, 2]]), masks.banned(matchers))
    assert bool(torch.isfinite(logits[[1, 3]]).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_masks_apply_on_cuda(llm):
    matcher = llm.engine.grammars.matcher(StructuredOutputsParams(choice=CHOICES))
    vocab = llm.engine.model_config.vocab_size
    masks = GrammarMasks(vocab, torch.device("cuda"))
    logits = torch.zeros(3, vocab, device="cuda")
    masks.apply(logits, [1], [matcher])
    cpu = GrammarMasks(vocab, torch.device("cpu")).allowed([matcher])[0]
    assert torch.equal(torch.isfinite(logits[1]).cpu(), cpu)
    assert bool(torch.isfinite(logits[0]).all()) and bool(torch.isfinite(logits[2]).all())
