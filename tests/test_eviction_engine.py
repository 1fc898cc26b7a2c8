"""KV eviction through the real engine on tiny random checkpoints: the keys-before-RoPE layout is
exact, attention after eviction equals a dense run over the kept tokens, H2O's received attention
matches transformers', token moves in every KV format, generation past max-model-len with
bounded blocks (every KV dtype, n > 1, preemption), request validation, prefix-cache layouts."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.eviction.moves import move_tokens
from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVCache, KVCacheSpec
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from tiny_models import BOOK

BS = 8


@pytest.fixture(scope="module")
def book_ids(tiny_tokenizer) -> list[int]:
    return tiny_tokenizer.encode(BOOK.read_text()[20_000:40_000])


def engine(path, **options) -> LLMEngine:
    defaults = dict(dtype="float32", block_size=BS, kv_cache_memory="8MiB", max_model_len=256)
    return LLMEngine(EngineArgs(model=str(path), **{**defaults, **options}))


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def run(eng: LLMEngine, watch_blocks: bool = True) -> tuple[dict, int]:
    """Step until done; returns (request id -> output, most blocks any sequence held)."""
    outputs, most = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out
        if watch_blocks and eng.kv_manager.req_blocks:
            most = max(most, max(len(b) for b in eng.kv_manager.req_blocks.values()))
    return outputs, most


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_keys_before_rope_change_nothing_until_tokens_are_evicted(tiny_llama, book_ids, policy):
    eng = engine(tiny_llama, max_num_batched_tokens=40)  # chunked prefill and decodes in one batch
    prompts = [book_ids[:150], book_ids[300:333]]
    for i, prompt in enumerate(prompts):
        eng.add_request(prompt, greedy(30), f"plain-{i}")
        eng.add_request(prompt, greedy(30, kv_eviction={"policy": policy, "budget": 256}), f"evicting-{i}")
    outputs, _ = run(eng)
    for i in range(len(prompts)):
        assert outputs[f"evicting-{i}"].outputs[0].token_ids == outputs[f"plain-{i}"].outputs[0].token_ids


@pytest.mark.parametrize("policy, chunk", [("streaming", 1), ("streaming", 5), ("h2o", 1), ("h2o", 5)])
def test_attention_after_eviction_equals_a_dense_run_over_the_kept_tokens(tiny_model_factory, book_ids, policy,
                                                                          chunk):
    """With one layer a token's K/V (stored before RoPE) do not depend on its context, so after
    any eviction the logits must be those of a fresh sequence made of the kept tokens, at
    positions 0, 1, ... (position = place in the cache)."""
    eng = engine(tiny_model_factory("llama", num_hidden_layers=1))
    kept_history: list[int] = []  # history index of each cached token, in cache order
    select = eng.evictor.select

    def recording_select(request_id, config, cache_len, num_new):
        kept = select(request_id, config, cache_len, num_new)
        if kept is not None and request_id.startswith("score"):
            kept_history[:] = [kept_history[i] for i in kept]
        return kept

    eng.evictor.select = recording_select
    tokens = book_ids[:90]
    spec = {"policy": policy, "budget": 24, "sink_tokens": 3, **({"recent_tokens": 6} if policy == "h2o" else {})}
    done, evictions = 0, 0
    for logits in eng.score_chunks(tokens, chunk, kv_eviction=spec):
        n = logits.shape[0]
        context = [tokens[i] for i in kept_history]
        evictions += len(context) < done
        reference = eng.score(context + tokens[done:done + n])[-n:]
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
        kept_history.extend(range(done, done + n))
        done += n
        assert len(kept_history) <= 24 + BS
    assert evictions > 0 and kept_history[:3] == [0, 1, 2]
    if policy == "streaming":
        assert kept_history[3:] == list(range(90 - len(kept_history) + 3, 90))


def test_h2o_received_attention_matches_transformers(tiny_llama, book_ids):
    from transformers import AutoModelForCausalLM

    tokens = book_ids[:40]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="eager", torch_dtype=torch.float32)
    with torch.no_grad():
        attentions = hf(torch.tensor([tokens]), output_attentions=True).attentions
    # Summed over layers, heads and queries: what each token received from the whole prompt.
    expected = sum(a[0].sum(dim=(0, 1)) for a in attentions)
    eng = engine(tiny_llama)
    for chunk in (7, 1):  # the prefill path (explicit probabilities) and the decode path
        received = {}
        forget = eng.evictor.forget
        eng.evictor.forget = lambda rid: received.setdefault("v", eng.evictor.policy(rid).received.clone())
        list(eng.score_chunks(tokens, chunk, kv_eviction={"policy": "h2o", "budget": 200}))
        eng.evictor.forget = forget
        torch.testing.assert_close(received["v"][:40], expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- token moves
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "fp8", "int8", "int4", "int4_kivi"])
def test_moved_tokens_read_back_as_they_were(kv_dtype):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)
    fmt = make_kv_format(kv_dtype, torch.float32)
    cache = KVCache(spec, fmt, num_blocks=6, device=torch.device("cpu"))
    torch.manual_seed(0)
    slots = torch.arange(24)
    for pool in cache.layers:
        fmt.write(pool, torch.randn(24, 2, 16), torch.randn(24, 2, 16), slots)
    # gather may return scratch buffers that the next gather reuses: keep copies.
    before = [[t.clone() for t in fmt.gather(pool, torch.arange(6), 1, torch.float32)] for pool in cache.layers]
    src, dst = [5, 6, 7, 13, 14, 22], [2, 3, 4, 5, 6, 7]  # overlapping: read before written
    move_tokens(cache, src, dst)
    exact = kv_dtype != "int4_kivi"  # per-channel key ranges per block: moved keys are re-quantized
    for pool, (key0, value0) in zip(cache.layers, before):
        key1, value1 = fmt.gather(pool, torch.arange(6), 1, torch.float32)
        for old, new in zip(src, dst):
            for a, b in ((key0[:, 0, old], key1[:, 0, new]), (value0[:, 0, old], value1[:, 0, new])):
                if exact:
                    assert torch.equal(a, b)
                else:
                    assert (a - b).norm() / a.norm() < 0.15
        untouched = [s for s in range(24) if s not in dst]
        assert torch.equal(value0[:, 0, untouched], value1[:, 0, untouched]) or not exact


# ---------------------------------------------------------------------------- long runs
@pytest.mark.parametrize("policy, kv_dtype", [("streaming", "auto"), ("streaming", "fp8"), ("streaming", "int4_kivi"),
                                              ("h2o", "auto"), ("h2o", "int8"), ("h2o", "int4"),
                                              ("snapkv", "auto"), ("snapkv", "int8"), ("tova", "auto"),
                                              ("tova", "int4_kivi")])
def test_generation_runs_past_max_model_len_with_bounded_blocks(tiny_llama, book_ids, kv_dtype, policy):
    eng = engine(tiny_llama, kv_cache_dtype=kv_dtype, max_model_len=128, kv_eviction=policy, kv_budget=48,
                 max_num_batched_tokens=64)
    eng.add_request(book_ids[:200], greedy(100), "a")  # 200 prompt tokens: longer than max-model-len
    eng.add_request(book_ids[500:520], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=120,
                                                      ignore_eos=True), "b")
    outputs, most = run(eng)
    assert [len(c.token_ids) for c in outputs["a"].outputs] == [100]
    assert [len(c.token_ids) for c in outputs["b"].outputs] == [120, 120]
    assert most <= math.ceil(48 / BS) + 2
    assert eng.num_free_blocks == eng.num_blocks
    assert all(b.ref_cnt == 0 for b in eng.kv_manager.pool.blocks)


def test_preemption_under_eviction_recomputes_and_finishes(tiny_llama, book_ids):
    # 12 blocks of 8 (and the null block): two sequences of up to 7 blocks cannot both run.
    eng = engine(tiny_llama, kv_cache_memory=str(13 * 2 * 2 * 2 * BS * 16 * 4), max_model_len=96,
                 kv_eviction="streaming", kv_budget=48, enable_prefix_caching=False)
    assert eng.num_blocks == 12
    for i in range(2):
        eng.add_request(book_ids[i * 100: i * 100 + 60], greedy(120), f"r{i}")
    outputs, most = run(eng)
    assert eng.scheduler.num_preemptions > 0
    assert all(len(o.outputs[0].token_ids) == 120 for o in outputs.values())
    assert most <= math.ceil(48 / BS) + 2 and eng.num_free_blocks == 12


# ---------------------------------------------------------------------------- validation
def test_eviction_lifts_the_context_limit_per_request(tiny_llama, book_ids):
    eng = engine(tiny_llama, max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64"):
        eng.add_request(book_ids[:100], greedy(10))
    eng.add_request(book_ids[:100], greedy(10, kv_eviction={"policy": "streaming", "budget": 32}), "ok")
    outputs, _ = run(eng)
    assert outputs["ok"].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="at most max-model-len"):
        eng.add_request(book_ids[:10], greedy(10, kv_eviction={"policy": "h2o", "budget": 65}))


def test_engine_flags_are_checked_at_start_up(tiny_llama):
    with pytest.raises(ValueError, match="needs a budget"):
        engine(tiny_llama, kv_eviction="h2o")
    with pytest.raises(ValueError, match="recent_tokens must be in"):
        engine(tiny_llama, kv_eviction="h2o", kv_budget=32, recent_tokens=40)
    with pytest.raises(ValueError, match="unknown KV eviction policy"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", kv_eviction="lru", kv_budget=32)


def test_engine_default_and_per_request_opt_out(tiny_llama, book_ids):
    eng = engine(tiny_llama, max_model_len=64, kv_eviction="streaming", kv_budget=32)
    eng.add_request(book_ids[:100], greedy(10), "default")
    with pytest.raises(ValueError, match="maximum context length"):
        eng.add_request(book_ids[:100], greedy(10, kv_eviction="none"))
    outputs, _ = run(eng)
    assert len(outputs["default"].outputs[0].token_ids) == 10


def test_prefix_cache_shares_blocks_only_within_a_layout(tiny_llama, book_ids):
    eng = engine(tiny_llama)
    prompt = book_ids[:64]
    evicting = greedy(2, kv_eviction={"policy": "streaming", "budget": 128})
    for rid, params in (("plain", greedy(2)), ("evicting", evicting), ("evicting-again", evicting)):
        eng.add_request(prompt, params, rid)
        outputs, _ = run(eng)
        hits = outputs[rid].num_cached_tokens
        assert hits == {"plain": 0, "evicting": 0, "evicting-again": 56}[rid], rid
    assert eng.scheduler.running == [] and eng.num_free_blocks == eng.num_blocks


@pytest.mark.parametrize("policy, hit", [("streaming", 32), ("tova", 32), ("snapkv", 0), ("h2o", 0)])
def test_a_prefix_hit_or_n_samples_do_not_change_what_an_evicting_request_generates(tiny_llama, book_ids, policy,
                                                                                     hit):
    """What a sequence evicts depends on where its chunks end: after a prefix hit (the second of n
    samples hits the first's prompt) its first chunk ends where an uncached one does, and a hit
    leaves the policy every row it observes before evicting (SnapKV's last 32, TOVA's last one;
    H2O sums them all, so takes none): n greedy samples and a later hit give the tokens the request
    gets alone."""
    params = dict(max_tokens=40, kv_eviction={"policy": policy, "budget": 40, "sink_tokens": 4})
    prompt = book_ids[:64]
    alone = engine(tiny_llama, enable_prefix_caching=False)
    alone.add_request(prompt, greedy(**params), "alone")
    expected = run(alone)[0]["alone"].outputs[0].token_ids
    eng = engine(tiny_llama)
    eng.add_request(prompt, greedy(n=2, **params), "pair")
    eng.add_request(prompt, greedy(**params), "later")  # admitted after the pair's first step published its blocks
    outputs, _ = run(eng)
    assert [o.token_ids for o in outputs["pair"].outputs] == [expected, expected]
    assert outputs["later"].outputs[0].token_ids == expected and outputs["later"].num_cached_tokens == hit


# ---------------------------------------------------------------------------- other policies
@pytest.mark.parametrize("policy", ["tova", "snapkv"])
def test_observed_query_rows_match_transformers(tiny_llama, book_ids, policy):
    """The rows a policy observes are the attention of the sequence's latest queries, summed over
    layers and heads: TOVA's the last query's, SnapKV's the last 32 (across chunk boundaries)."""
    from transformers import AutoModelForCausalLM

    tokens = book_ids[:40]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="eager", torch_dtype=torch.float32)
    with torch.no_grad():
        attentions = hf(torch.tensor([tokens]), output_attentions=True).attentions
    rows = sum(a[0].sum(dim=0) for a in attentions)  # [queries, keys]
    expected = rows[-1:] if policy == "tova" else rows[-32:]
    eng = engine(tiny_llama)
    for chunk in (7, 1):  # the prefill path (explicit probabilities) and the decode path
        seen = {}
        forget = eng.evictor.forget
        eng.evictor.forget = lambda rid: seen.setdefault("policy", eng.evictor.policy(rid))
        list(eng.score_chunks(tokens, chunk, kv_eviction={"policy": policy, "budget": 200}))
        eng.evictor.forget = forget
        state = seen["policy"].latest[None] if policy == "tova" else seen["policy"].rows
        torch.testing.assert_close(state[:, :40], expected, rtol=1e-4, atol=1e-4)
