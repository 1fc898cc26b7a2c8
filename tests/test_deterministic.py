"""--deterministic: a request's tokens and their logprobs, bit for bit, whatever else the engine is
doing. Each weight format and KV dtype runs 32 prompts (half greedy, half sampled with a seed)
alone, then among 64 mixed requests with prefix caching, 64-token chunked prefill and a pool small
enough to force preemptions, then again with prefix hits on one thread, then in an engine restarted
on the disk tier those wrote; blocks come back from the host tier too; a server answers two
same-seed requests among concurrent traffic.
Comparing logprobs (not only tokens) makes a one-bit difference anywhere upstream fail the test:
without the option these very runs differ (BENCHMARKS.md counts how often).
"""
from __future__ import annotations

import argparse
import random
import threading

import httpx
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVCacheSpec
from kvserve.engine.args import EngineArgs
from kvserve.fixed_order import fixed_order_matmul
from kvserve.hardware import native_bf16_missing
from kvserve.torch_threads import one_thread

WEIGHTS = {
    "float32": dict(dtype="float32", quantization="none"),
    "bfloat16": dict(dtype="bfloat16", quantization="none"),
    "int8": dict(quantization="int8"),  # dtype auto: bfloat16 where native, else float32
    "int4": dict(quantization="int4"),
}
KV_DTYPES = ["auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
MAX_TOKENS = 8


def _prompts(seed: int, count: int, shared: int) -> list[list[int]]:
    """`count` token-id prompts of 8-80 tokens; groups of four share a `shared`-token prefix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 500) for _ in range(shared)] for _ in range(count // 4 + 1)]
    return [prefixes[i // 4] + [rng.randrange(5, 500) for _ in range(rng.randrange(8, 80 - shared))]
            for i in range(count)]


PROMPTS = _prompts(0, 32, 24)
FILLERS = _prompts(1, 32, 16)


def _params(i: int) -> SamplingParams:
    """Even prompts greedy, odd ones sampled with their own seed; the chosen token's logprob."""
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    return SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS, logprobs=0,
                          ignore_eos=True)


def _filler_params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.7 if i % 3 else 0, max_tokens=1 + i % 12, ignore_eos=True)


def _result(output) -> tuple:
    completion = output.outputs[0]
    return tuple(completion.token_ids), tuple(e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids))


def _alone(llm: LLM) -> list[tuple]:
    """Each prompt in a batch of its own."""
    return [_result(llm.generate([{"prompt_token_ids": p}], _params(i), use_tqdm=False)[0])
            for i, p in enumerate(PROMPTS)]


def _mixed(llm: LLM) -> tuple[list[tuple], list]:
    """The 32 prompts interleaved with 32 other requests in one call: their results, and the outputs."""
    order = [("p", i) for i in range(len(PROMPTS))] + [("f", i) for i in range(len(FILLERS))]
    random.Random(2).shuffle(order)
    prompts = [{"prompt_token_ids": (PROMPTS if kind == "p" else FILLERS)[i]} for kind, i in order]
    params = [_params(i) if kind == "p" else _filler_params(i) for kind, i in order]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    mine = {i: out for (kind, i), out in zip(order, outputs) if kind == "p"}
    return [_result(mine[i]) for i in range(len(PROMPTS))], [mine[i] for i in range(len(PROMPTS))]


def _skip_without_native_bf16(weights: str) -> None:
    if WEIGHTS[weights].get("dtype") == "bfloat16" and (missing := native_bf16_missing()) is not None:
        pytest.skip(f"bfloat16 weights: this CPU lacks native bf16 ({missing})")


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_tokens_and_logprobs_do_not_depend_on_what_else_runs(tiny_llama, tmp_path, weights, kv_cache_dtype):
    _skip_without_native_bf16(weights)
    # The same pool and max-model-len for both engines: they bound the start-up calibration prefill
    # of the formats that fit key transforms (README, "Deterministic inference").
    common = dict(deterministic=True, kv_cache_dtype=kv_cache_dtype, max_model_len=128,
                  kv_cache_memory=_pool_bytes(weights, kv_cache_dtype, blocks=24), **WEIGHTS[weights])
    with LLM(str(tiny_llama), enable_prefix_caching=False, **common) as llm:
        alone = _alone(llm)
    disk = dict(enable_prefix_caching=True, kv_offloading_disk_path=str(tmp_path / "kv"))
    with LLM(str(tiny_llama), max_num_batched_tokens=64, **disk, **common) as llm:
        mixed, _ = _mixed(llm)
        assert llm.engine.scheduler.num_preemptions > 0  # the small pool forced recomputes
        with one_thread():
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                   [_params(i) for i in range(len(PROMPTS))], use_tqdm=False)
        assert sum(o.num_cached_tokens for o in outputs) > 0  # prefix hits from the first call
    with LLM(str(tiny_llama), **disk, **common) as llm:  # a restart: closing flushed the blocks to disk
        restored = [_result(o) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                     [_params(i) for i in range(len(PROMPTS))], use_tqdm=False)]
        assert llm.engine.kv_manager.stats.tier_hits["disk"] > 0
    differing = [i for i in range(len(PROMPTS)) if restored[i] != alone[i]]
    assert not differing, f"prompts {differing} differ with blocks restored from disk after a restart"
    differing = [i for i in range(len(PROMPTS)) if mixed[i] != alone[i]]
    assert not differing, f"prompts {differing} differ in a mixed batch"
    again = [_result(o) for o in outputs]
    differing = [i for i in range(len(PROMPTS)) if again[i] != alone[i]]
    assert not differing, f"prompts {differing} differ with prefix hits on one thread"


def _pool_bytes(weights: str, kv_cache_dtype: str, blocks: int) -> int:
    """The bytes of `blocks` 16-token blocks of the tiny llama's pool (2 layers, 2 KV heads of 16):
    24 hold a few requests at a time."""
    dtype = WEIGHTS[weights].get("dtype", "bfloat16" if native_bf16_missing() is None else "float32")
    kv_format = make_kv_format(kv_cache_dtype, getattr(torch, dtype))
    return 2 * kv_format.bytes_per_block(KVCacheSpec(2, 2, 16, 16)) * blocks


def test_blocks_restored_from_the_host_tier_give_the_same_tokens(tiny_llama):
    """A pool of 24 blocks cannot keep 32 prompts' prefixes: the second pass finds many in host memory."""
    with LLM(str(tiny_llama), deterministic=True, quantization="int4", kv_cache_dtype="int8", max_model_len=128,
             kv_cache_memory=_pool_bytes("int4", "int8", blocks=24), kv_offloading_size=0.05) as llm:
        first = _alone(llm)
        again = _alone(llm)
        assert llm.engine.kv_manager.stats.tier_hits["host"] > 0
    assert again == first


def test_without_the_option_a_replayed_batch_or_a_request_alone_is_reproducible(tiny_llama):
    """What the default mode promises (README): the same requests scheduled the same way give the
    same bits (CPU kernels are deterministic for a given shape); batch composition may change them."""
    with LLM(str(tiny_llama), quantization="int4", enable_prefix_caching=False, kv_cache_memory="8MiB") as llm:
        assert _mixed(llm)[0] == _mixed(llm)[0]
        assert _alone(llm)[:4] == _alone(llm)[:4]


# ------------------------------------------------------------------------------------------ limits
@pytest.mark.parametrize("options,named", [
    (dict(kv_cache_dtype="int4_kivi"), "--kv-cache-dtype int4_kivi"),
    (dict(kv_eviction="streaming", kv_budget=64), "--kv-eviction"),
    (dict(attention_backend="torch"), "--attention-backend torch"),
    (dict(tensor_parallel_size=2), "--tensor-parallel-size"),
])
def test_what_it_cannot_make_batch_invariant_is_refused_in_one_line(options, named):
    with pytest.raises(ValueError, match=f"--deterministic does not support {named}") as error:
        EngineArgs(model="unused", deterministic=True, **options).validate()
    assert "\n" not in str(error.value)


def test_a_request_asking_for_kv_eviction_is_refused(tiny_llama):
    with LLM(str(tiny_llama), deterministic=True, kv_cache_memory="8MiB") as llm:
        params = SamplingParams(max_tokens=2, kv_eviction={"policy": "streaming", "budget": 64})
        with pytest.raises(ValueError, match="kv_eviction is not available under --deterministic"):
            llm.generate(["Hello"], params, use_tqdm=False)


def test_the_flag_and_its_sglang_alias():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--deterministic"]).deterministic is True
    assert parser.parse_args(["--enable-deterministic-inference"]).deterministic is True
    assert parser.parse_args([]).deterministic is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_order_matmul_rows_do_not_depend_on_the_row_count(dtype):
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    matrix = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    singles = torch.cat([fixed_order_matmul(x[i: i + 1], matrix) for i in range(len(x))])
    for rows in (2, 3, 17, 70):
        assert torch.equal(fixed_order_matmul(x[:rows], matrix), singles[:rows]), rows
    assert torch.equal(fixed_order_matmul(x[:5], matrix.T), torch.cat([fixed_order_matmul(r[None], matrix.T)
                                                                        for r in x[:5]]))


# ------------------------------------------------------------------------------------------ server
def test_two_same_seed_requests_among_concurrent_traffic_get_the_same_text(server_factory, tiny_llama):
    server = server_factory(str(tiny_llama), "--deterministic", "--dtype", "float32", "--kv-cache-memory", "16MiB",
                            "--max-num-batched-tokens", "64")
    url = f"{server.base_url}/v1/completions"
    body = {"model": str(tiny_llama), "prompt": "It is a truth universally acknowledged, that a single man",
            "max_tokens": 12, "temperature": 1.0, "seed": 7, "logprobs": 1}

    def ask(payload: dict) -> dict:
        response = httpx.post(url, json=payload, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    alone = ask(body)
    results: dict[str, dict] = {}
    traffic = [threading.Thread(target=ask, args=({**body, "prompt": f"Filler number {i} " * (1 + i % 5),
                                                     "seed": i, "max_tokens": 4 + i % 9},)) for i in range(12)]
    mine = [threading.Thread(target=lambda k=k: results.__setitem__(k, ask(body))) for k in ("a", "b")]
    threads = traffic[:6] + [mine[0]] + traffic[6:] + [mine[1]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for key in ("a", "b"):
        assert results[key]["text"] == alone["text"]
        assert results[key]["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]
