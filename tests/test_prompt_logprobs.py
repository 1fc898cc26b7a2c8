"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers' teacher-forced
float32 log-softmax: chunked prefill, a prefix the cache holds, top-k entries, prefill-only
requests (max_tokens=0) and the --max-logprobs bound."""
from __future__ import annotations

import pytest
import torch

import kvserve.engine.logprobs as logprobs_module
from kvserve import LLM, SamplingParams

TOLERANCE = 1e-3


def hf_log_softmax(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: row i is the distribution of token i + 1 given tokens <= i."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def rank_bounds(row: torch.Tensor, logprob: float) -> tuple[int, int]:
    """The ranks a token with `logprob` may have in `row`, ties within the tolerance either way."""
    return int((row > logprob + TOLERANCE).sum()) + 1, int((row > logprob - TOLERANCE).sum()) + 1


def check_against_hf(entries, token_ids: list[int], ref: torch.Tensor, k: int) -> None:
    """Every entry of a prompt's RequestOutput.prompt_logprobs against HF's log-softmax rows:
    the prompt token's logprob and rank, then the k best tokens, ranked 1..k."""
    assert len(entries) == len(token_ids) and entries[0] is None
    for i in range(1, len(token_ids)):
        row, token, entry = ref[i - 1], token_ids[i], entries[i]
        assert list(entry)[0] == token  # the prompt's own token comes first
        ours = entry[token]
        assert abs(ours.logprob - row[token].item()) <= TOLERANCE, i
        low, high = rank_bounds(row, ours.logprob)
        assert low <= ours.rank <= high
        top = sorted((e.rank, t, e) for t, e in entry.items() if e.rank <= k and (t != token or e.rank <= k))
        assert [rank for rank, _, _ in top] == list(range(1, k + 1))
        assert len(entry) == k + (token not in {t for _, t, _ in top})
        best = row.topk(k).values if k else []
        for (rank, t, e), value in zip(top, best):
            assert abs(e.logprob - value.item()) <= TOLERANCE and abs(row[t].item() - e.logprob) <= TOLERANCE
        assert all(isinstance(e.decoded_token, str) for e in entry.values())


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture
def tiny_llm(tiny_llama):
    # 16 tokens per step: every prompt below is prefilled in several chunks.
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16)


PROMPTS = [list(range(10, 50)), list(range(10, 42)) + [300 + j for j in range(21)], [7, 8], [5]]


@pytest.mark.torch_path
def test_tiny_model_prompt_logprobs_match_hf_across_chunks_and_cache_hits(tiny_llm, tiny_hf, monkeypatch):
    # Three rows per LM-head slice, so a chunk's rows are scored in several slices.
    monkeypatch.setattr(logprobs_module, "SLICE_ELEMENTS", 3 * tiny_llm.engine.model_config.vocab_size)
    # Warm the prefix cache with the first 32 tokens that the first two prompts share.
    tiny_llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=1), use_tqdm=False)
    engine = tiny_llm.engine
    hits_before = engine.kv_manager.stats.hits
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k) for k in (0, 4, 2, 1)]
    outputs = tiny_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out, prompt, sp in zip(outputs, PROMPTS, params):
        assert out.num_cached_tokens == 0  # a cached prefix would have no logits: recomputed
        check_against_hf(out.prompt_logprobs, prompt, hf_log_softmax(tiny_hf, prompt), sp.prompt_logprobs)
    assert engine.kv_manager.stats.hits == hits_before
    # Their blocks are still published: a plain request with the same prompt hits them.
    again = tiny_llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert again[0].num_cached_tokens == 48 and again[0].prompt_logprobs is None
    assert engine.num_free_blocks == engine.num_blocks


def test_prefill_only_request_and_n_samples(tiny_llm, tiny_hf):
    prompt = PROMPTS[1]
    [out] = tiny_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0, prompt_logprobs=1),
                              use_tqdm=False)
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
    check_against_hf(out.prompt_logprobs, prompt, hf_log_softmax(tiny_hf, prompt), 1)
    # n > 1: one list of prompt logprobs for the request, every sample generated.
    [out] = tiny_llm.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=0),
                              use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [4, 4, 4]
    check_against_hf(out.prompt_logprobs, prompt, hf_log_softmax(tiny_hf, prompt), 0)
    assert tiny_llm.engine.num_free_blocks == tiny_llm.engine.num_blocks


def test_preempted_request_reports_each_prompt_logprob_once(tiny_llama, tiny_hf):
    roomy = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    per_block = roomy.engine.kv_cache.nbytes // roomy.engine.num_blocks
    # 12 blocks of 16 tokens for six requests that grow to 100 tokens each: preemption.
    tight = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=str(12 * per_block), max_model_len=160,
                max_num_batched_tokens=32)
    prompts = [[20 + i] + list(range(30, 70)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, prompt_logprobs=0)
    outputs = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for out, prompt in zip(outputs, prompts):
        check_against_hf(out.prompt_logprobs, prompt, hf_log_softmax(tiny_hf, prompt), 0)


def test_prompt_logprobs_under_kv_eviction(tiny_llama, tiny_hf):
    """An evicting request scores its prompt against what its cache keeps: every entry is there,
    and the first chunk (budget - sinks tokens, nothing evicted yet) matches HF."""
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False)
    prompt = list(range(10, 90))
    params = SamplingParams(max_tokens=2, prompt_logprobs=0, kv_eviction={"policy": "streaming", "budget": 32})
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(out.prompt_logprobs) == len(prompt) and len(out.outputs[0].token_ids) == 2
    first_chunk = 32 - 4
    check_against_hf(out.prompt_logprobs[:first_chunk + 1], prompt[:first_chunk + 1],
                     hf_log_softmax(tiny_hf, prompt[:first_chunk + 1]), 0)
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_max_logprobs_bounds_both_kinds(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_logprobs=3)
    with pytest.raises(ValueError, match="Requested prompt logprobs of 4, which is greater than max allowed: 3"):
        llm.generate("Hello", SamplingParams(prompt_logprobs=4), use_tqdm=False)
    with pytest.raises(ValueError, match="Requested sample logprobs of 4, which is greater than max allowed: 3"):
        llm.generate("Hello", SamplingParams(logprobs=4), use_tqdm=False)
    assert llm.generate("Hello", SamplingParams(logprobs=3, prompt_logprobs=3), use_tqdm=False)[0].finished
    unbounded = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_logprobs=-1)
    [out] = unbounded.generate("Hello world", SamplingParams(max_tokens=1, prompt_logprobs=100), use_tqdm=False)
    assert all(len(entry) >= 100 for entry in out.prompt_logprobs[1:])
    # -1: the whole vocabulary (vLLM's), sampled and prompt tokens; over a bound it is refused
    vocab = unbounded.engine.model_config.vocab_size
    [out] = unbounded.generate("Hello world", SamplingParams(max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                               use_tqdm=False)
    assert [len(entry) for entry in out.outputs[0].logprobs] == [vocab] * 2
    assert all(len(entry) == vocab for entry in out.prompt_logprobs[1:])
    with pytest.raises(ValueError, match=f"Requested sample logprobs of {vocab}, which is greater than max allowed: 3"):
        llm.generate("Hello", SamplingParams(logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="or -1 for the whole vocabulary, got -2"):
        SamplingParams(logprobs=-2)
    with pytest.raises(ValueError, match="--max-logprobs must be at least -1"):
        LLM(str(tiny_llama), max_logprobs=-2)


@pytest.mark.slow
def test_default_model_prompt_logprobs_match_hf_float32(default_fp32, hf_default_fp32):
    from tiny_models import BOOK

    llm, hf = default_fp32, hf_default_fp32
    ids = llm.get_tokenizer().encode(BOOK.read_text()[5000:7000])[:200]
    # The first 128 tokens cached by a plain request; the prompt-logprobs request recomputes them.
    llm.generate([{"prompt_token_ids": ids[:130]}], SamplingParams(max_tokens=1), use_tqdm=False)
    [out] = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=0, prompt_logprobs=5),
                         use_tqdm=False)
    assert out.num_cached_tokens == 0
    check_against_hf(out.prompt_logprobs, ids, hf_log_softmax(hf, ids), 5)
