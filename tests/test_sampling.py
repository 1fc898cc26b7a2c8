"""SamplingParams (vLLM's names, defaults, validation) and what each knob does on a real model."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.request import Request
from kvserve.outputs import top_logprobs
from kvserve.engine.sampler import Sampler, row_argmax


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(stop="x").stop == ["x"]


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature=math.nan), dict(top_p=0), dict(top_p=1.5), dict(n=0),
    dict(max_tokens=-1), dict(top_k=-2), dict(min_p=2), dict(presence_penalty=3), dict(repetition_penalty=0),
    dict(logprobs=-2), dict(prompt_logprobs=-2), dict(stop=[""]), dict(stop=["x"] * 65), dict(seed=2 ** 64), dict(top_k=2 ** 64),
    dict(min_tokens=5, max_tokens=2),
])
def test_invalid_values_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")


PROMPT = "It is a truth universally acknowledged"


def tokens(llm, **kwargs) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, **kwargs),
                        use_tqdm=False)[0].outputs[0].token_ids


def test_greedy_and_top_k_1_agree_and_seeds_reproduce(llm):
    greedy = tokens(llm, temperature=0)
    assert tokens(llm, temperature=1.0, top_k=1, seed=3) == greedy
    assert tokens(llm, temperature=1.5, seed=7) == tokens(llm, temperature=1.5, seed=7)
    draws = {tuple(tokens(llm, temperature=1.5, seed=s)) for s in range(4)}
    assert len(draws) > 1, "different seeds should give different samples at temperature 1.5"


def test_tiny_temperatures_are_greedy_not_nan(llm):
    """Logits divided by 1e-38 overflow; vLLM samples greedily below 1e-5, and so does kvserve."""
    greedy = tokens(llm, temperature=0)
    for temperature in (1e-38, 1e-40, 1e-6):
        assert tokens(llm, temperature=temperature, seed=1) == greedy


def test_seeded_request_does_not_depend_on_its_batch(llm):
    alone = tokens(llm, temperature=1.2, seed=11)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.2, seed=11)] + \
             [SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.2)] * 3
    batched = llm.generate([PROMPT] * 4, params, use_tqdm=False)[0].outputs[0].token_ids
    assert batched == alone


def test_logit_bias_forces_and_bans_tokens_and_logprobs_stay_raw(llm):
    greedy = tokens(llm, temperature=0)
    forced = 7 if greedy[0] != 7 else 8
    assert tokens(llm, temperature=0, logit_bias={forced: 100.0}) == [forced] * 12
    banned = tokens(llm, temperature=0, logit_bias={greedy[0]: -100.0})
    assert banned[0] != greedy[0]
    # in a batch, a bias changes only its own request
    outs = llm.generate([PROMPT] * 2, [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0),
                                       SamplingParams(max_tokens=12, ignore_eos=True, temperature=0,
                                                      logit_bias={forced: 100.0})], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [greedy, [forced] * 12]
    with pytest.raises(ValueError, match=r"token_id\(s\) \[100000\] in logit_bias contain out-of-vocab"):
        llm.generate([PROMPT], SamplingParams(logit_bias={100000: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias values must be finite"):
        SamplingParams(logit_bias={1: math.inf})


def test_allowed_token_ids_keep_sampling_among_them_and_only_for_their_request(llm):
    """vLLM's allowed_token_ids: every token sampled (hot temperature) or picked (greedy) is one of
    them; the request beside it in the batch is untouched; ids out of the vocabulary and an empty
    list are refused."""
    greedy = tokens(llm, temperature=0)
    allowed = [t for t in range(5, 40) if t not in greedy][:3]
    hot = tokens(llm, temperature=2.0, seed=5, allowed_token_ids=allowed)
    assert set(hot) <= set(allowed) and len(set(hot)) > 1
    outs = llm.generate([PROMPT] * 2, [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0),
                                       SamplingParams(max_tokens=12, ignore_eos=True, temperature=0,
                                                      allowed_token_ids=allowed)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == greedy and set(outs[1].outputs[0].token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids contains out-of-vocab token ids"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[5, 10 ** 6]), use_tqdm=False)
    with pytest.raises(ValueError, match="must not be empty"):
        SamplingParams(allowed_token_ids=[])
    # A long list costs its request once, not every step of the batch: each id kept once, the
    # sampler's row of the vocabulary made on the first step and dropped when the request ends.
    assert SamplingParams(allowed_token_ids=[9, 5, 9] * 1000).allowed_token_ids == [5, 9]
    assert llm.engine.runner.sampler._allowed_rows == {}


def test_bad_words_are_never_generated_bare_or_after_a_space(llm):
    """vLLM's bad_words: a word of one token is never sampled; a word of several never completed
    (its last token is banned right after the rest); each also in its spaced form."""
    from kvserve.engine.token_bans import bad_word_sequences, banned_next

    tokenizer = llm.engine.tokenizer
    greedy = tokens(llm, temperature=0)
    word = next(w for w in (tokenizer.decode([t]).strip() for t in greedy)
                if w and any(len(s) == 1 and s[0] in greedy for s in bad_word_sequences(tokenizer, [w])))
    singles = {s[0] for s in bad_word_sequences(tokenizer, [word]) if len(s) == 1}
    assert not singles & set(tokens(llm, temperature=0, bad_words=[word]))
    # A two-token word: among the two tokens alone (allowed_token_ids), the pair never follows.
    pair = next(ids for text in (a + b for a in "qxzjkv" for b in "qxzjkv") if len(ids := tokenizer.encode(
        text, add_special_tokens=False)) == 2 and ids[0] != ids[1])
    text = tokenizer.decode(pair)
    hot = llm.generate([PROMPT] * 4, [SamplingParams(max_tokens=40, ignore_eos=True, temperature=3.0, seed=s,
                                                     allowed_token_ids=pair, bad_words=[text]) for s in range(4)],
                       use_tqdm=False)
    for out in hot:
        ids = out.outputs[0].token_ids
        assert not any(ids[i:i + 2] == pair for i in range(len(ids) - 1)) and pair[0] in ids
    assert banned_next([(1, 2, 3), (4,)], [9, 1, 2]) == [3, 4] and banned_next([(1, 2, 3)], [2]) == []
    with pytest.raises(ValueError, match="ban every token of allowed_token_ids"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=sorted(singles), bad_words=[word]), use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words must be a list of words"):
        SamplingParams(bad_words=["ok", "  "])


def test_invalid_request_is_rejected_before_it_is_queued(llm):
    with pytest.raises(ValueError, match="maximum context length"):  # (a max_tokens past it is cut offline)
        llm.generate([{"prompt_token_ids": [5] * llm.engine.max_model_len}], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([{"prompt_token_ids": [10 ** 7]}], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([PROMPT], SamplingParams(stop_token_ids=[-1]), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="min_tokens must be less than or equal to max_tokens="):
        llm.generate([PROMPT], SamplingParams(max_tokens=None, min_tokens=10 ** 12), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_stop_string_truncates_and_reports_reason(llm):
    full = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = full.text[5:8]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_and_max_tokens_finish_reasons(llm):
    greedy = tokens(llm, temperature=0)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[greedy[3]]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[: greedy.index(greedy[3]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == greedy[3]
    assert llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_logprobs_are_raw_model_log_probabilities(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, logprobs=5, ignore_eos=True),
                       use_tqdm=False)[0]
    prompt_ids = out.prompt_token_ids
    logits = llm.engine.score(prompt_ids + out.outputs[0].token_ids)
    expected = torch.log_softmax(logits[len(prompt_ids) - 1], dim=-1)
    completion = out.outputs[0]
    first, token = completion.logprobs[0], completion.token_ids[0]
    # vLLM's shape: {token id: Logprob(logprob, rank, decoded_token)}, the sampled token first
    assert next(iter(first)) == token and len(first) == 5  # greedy: the sampled token is among the top 5
    assert first[token].logprob == pytest.approx(expected[token].item(), abs=1e-4)
    assert first[token].rank == 1 and first[token].decoded_token == llm.get_tokenizer().decode([token])
    assert [t for t, _ in top_logprobs(first, 5)] == expected.topk(5).indices.tolist()
    assert [e.rank for _, e in top_logprobs(first, 5)] == [1, 2, 3, 4, 5]
    assert len(completion.logprobs) == 3
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(completion.logprobs,
                                                                                           completion.token_ids)))
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].cumulative_logprob is None


# ---------------------------------------------------------------------------- sampler unit tests
def _sample(logits: torch.Tensor, **kwargs) -> int:
    request = Request("r", [0, 1], SamplingParams(**kwargs))
    tokens, _ = Sampler(logits.shape[-1], torch.device("cpu")).sample_on_device(logits[None].clone(), [request])
    return int(tokens[0])


@pytest.mark.parametrize("width", [49152, 1024, 1000, 300])
def test_row_argmax_is_argmax_with_its_ties_and_nans(width):
    """The greedy token is argmax's: the first of tied maxima, NaN as the maximum, row 0 of -inf."""
    torch.manual_seed(0)
    x = torch.randn(8, width)
    x[1, 5] = x[1, width - 3] = 1e9  # a tie in different blocks: the first wins
    x[2, 7] = x[2, 9] = 1e9  # a tie in one block
    x[3, width // 2] = float("nan")
    x[3, width - 1] = float("nan")
    x[4] = float("-inf")
    x[5, width - 1] = 1e9  # the last column
    x[6] = x[6].round()  # many ties
    expected = x.argmax(dim=-1)
    assert row_argmax(x).tolist() == expected.tolist()
    assert row_argmax(x.bfloat16().float()).tolist() == x.bfloat16().float().argmax(dim=-1).tolist()


def test_top_p_and_min_p_cut_the_tail():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    for seed in range(20):
        assert _sample(logits, temperature=1.0, top_p=0.5, seed=seed) == 0
        assert _sample(logits, temperature=1.0, min_p=0.4, seed=seed) in (0, 1)


def test_a_row_is_truncated_and_penalised_the_same_alone_or_beside_rows_that_ask_more():
    """--deterministic's promise, in the sampler: a row without top_p kept its whole tail only when
    no other row asked for top_p (float32's cumulative mass rounds to 1 before a peaked row's end,
    and the mask dropped what followed: a seeded draw could change); a row whose tokens are all
    masked picked another token when another row had penalties (the clamp made -inf finite)."""
    vocab = 32000
    peaked = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 4.0  # as a model's
    other = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(vocab, torch.device("cpu"))
    plain, nucleus = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)
    assert torch.equal(sampler._truncate(torch.cat([peaked, other]), [plain, nucleus])[0], peaked[0])
    masked = torch.full((1, vocab), float("-inf"))
    rows = [Request("a", [1, 2, 3], SamplingParams(temperature=0), (0,)),
            Request("b", [1, 2, 3], SamplingParams(temperature=0, repetition_penalty=1.2), (0,))]
    assert torch.equal(sampler._apply_penalties(torch.cat([masked, other]), rows)[0], masked[0])


def test_a_request_that_could_generate_nothing_is_refused(llm):
    eos = llm.engine.eos_token_ids[0]
    with pytest.raises(ValueError, match="min_tokens holds back every token of allowed_token_ids"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[eos], min_tokens=3), use_tqdm=False)
    assert llm.generate([PROMPT], SamplingParams(allowed_token_ids=[eos, 7], min_tokens=3, max_tokens=4),
                        use_tqdm=False)[0].outputs[0].token_ids[:3] == [7, 7, 7]


def test_extreme_repetition_penalties_stay_finite():
    """1e-308 is 0 in float32 (a division by zero gave inf logits and NaN probabilities); every
    accepted penalty must still give its meaning: below 1 favours seen tokens, above 1 avoids them."""
    logits = torch.tensor([-1.0, 0.5, 1.5, 2.0])  # the prompt is [0, 1]
    for seed in range(5):
        assert _sample(logits, temperature=1.0, repetition_penalty=1e-308, seed=seed) == 1
        assert _sample(logits, temperature=1.0, repetition_penalty=1e308, seed=seed) in range(4)
    assert _sample(logits, temperature=0, repetition_penalty=1e-308) == 1
    assert _sample(logits, temperature=0, repetition_penalty=1e308) == 3


def test_penalties_push_away_from_seen_tokens():
    logits = torch.tensor([2.0, 0.5, 1.5, -1.0])
    assert _sample(logits, temperature=0) == 0
    # Token 0 is in the prompt ([0, 1]); a repetition penalty of 2 halves its positive logit.
    assert _sample(logits, temperature=0, repetition_penalty=2.0) == 2


def test_the_detokenizers_direct_decoder_matches_the_tokenizers_decode(tiny_tokenizer):
    """engine/detokenizer.ids_decoder calls a fast tokenizer's Rust decoder directly: the same text
    as tokenizer.decode for any ids, special tokens skipped or not; with clean-up of spaces on it
    goes through tokenizer.decode."""
    import copy
    import random

    from kvserve.engine.detokenizer import ids_decoder

    cleaning = copy.deepcopy(tiny_tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    rng = random.Random(0)
    for tokenizer in (tiny_tokenizer, cleaning):
        decode = ids_decoder(tokenizer)
        specials = list(tokenizer.all_special_ids)
        for _ in range(300):
            ids = [rng.choice(specials) if rng.random() < 0.2 else rng.randrange(len(tokenizer))
                   for _ in range(rng.randrange(1, 10))]
            for skip in (False, True):
                assert decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_the_cuda_profiling_step_samples_max_num_seqs_rows_with_every_option(tiny_llama):
    """The CUDA budget's profiling pass (pool_sizing.profile_cuda_budget) measures the sampler at
    its widest: a step of --max-num-seqs rows, penalties, top-k/p, min-p and logprobs on. The step
    is valid input for the runner (here on CPU) and samples every row, with logprobs."""
    from kvserve.engine.pool_sizing import widest_sampling_step

    engine = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_num_seqs=12, max_logprobs=-1).engine
    scheduled, tables = widest_sampling_step(engine.args)
    assert len(scheduled) == 12
    params = scheduled[0].request.params
    assert params.has_penalties and params.top_k and params.top_p < 1 and params.min_p > 0 and params.logprobs == 20
    step = engine.runner.execute(scheduled, tables)
    assert len(step.result.token_ids) == 12
    assert all(entry is not None and len(entry[2]) == 20 for entry in step.result.logprobs)


def test_top_logprobs_of_an_entry_are_the_k_best_when_the_sampled_token_ties():
    """A sampled token tied with the k-th best but left out of the top k has that rank too (rank =
    1 + the tokens strictly more likely): the top k are still k, those the top-k pick made."""
    from kvserve.outputs import Logprob
    entry = {5: Logprob(-0.7, 1), 7: Logprob(-0.7, 1), 9: Logprob(-2.0, 2)}  # 5 sampled, 7 picked as best
    assert [token for token, _ in top_logprobs(entry, 1)] == [7]
    assert [token for token, _ in top_logprobs(entry, 2)] == [7, 5]
    assert top_logprobs({5: Logprob(-0.1, 1)}, 0) == []
