"""Decode steps through CUDA graphs' persistent buffers (engine/decode_graphs.py) give the eager
engine's tokens: padding rows write only the null block, block tables and lengths are read from
fixed-shape buffers, steps too large or not plain decodes run eagerly beside them. On CPU the
padded step runs eagerly over the same buffers under Triton's interpreter (everything but the
capture); on a machine with CUDA the graphs are captured and replayed."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported

pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.engine.decode_graphs import DecodeGraphs, capture_sizes  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPTS = ["It is a truth universally acknowledged", "Hello", "Mr. Bennet was so odd a mixture of quick parts",
           "The", "However little known the feelings or views of such a man may be", "My dear Mr. Bennet"]


def test_the_captured_sizes_follow_vllms_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(512)[-3:] == [496, 504, 512]


def engine(model, **options) -> LLM:
    return LLM(str(model), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=32,
               attention_backend="triton", device=str(DEVICE), **options)


GRAPH_TEST_PARAMS = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def eager_tokens(tiny_llama_d32) -> list[list[int]]:
    """PROMPTS under GRAPH_TEST_PARAMS with --enforce-eager: what the graph steps must give."""
    eager = engine(tiny_llama_d32, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    tokens = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GRAPH_TEST_PARAMS, use_tqdm=False)]
    eager.close()
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decodes_through_the_graph_buffers_give_the_eager_tokens(tiny_llama_d32, eager_tokens, async_scheduling):
    """Six prompts with max 4 sequences per graph: steps of 5-6 decodes run eagerly, later steps
    of 1-4 through the buffers padded to 1, 2 or 4, with prefill chunks in between eager. Under
    async scheduling the graph steps take their input tokens from the step before on the device.
    (The KV format is the default: the buffers are the same for every format.)"""
    params, expected = GRAPH_TEST_PARAMS, eager_tokens
    llm = engine(tiny_llama_d32, max_cudagraph_capture_size=4, async_scheduling=async_scheduling)
    runner = llm.engine.runner
    if DEVICE.type == "cuda":
        assert runner.graphs is not None and sorted(runner.graphs.graphs) == [1, 2, 4]
    else:
        assert runner.graphs is None  # no graphs on CPU: the same buffers, run eagerly
        runner.graphs = DecodeGraphs(llm.engine.model, llm.engine.kv_cache, runner.backend, 4,
                                     llm.engine.max_model_len)
    sizes, table_entries, pending_rows = [], [], []
    run = runner.graphs.run

    def counted(step, pending=None):
        sizes.append(len(step.token_ids))
        table_entries.append(sum(len(t) for t in step.block_tables))
        pending_rows.append(len(step.pending_rows))
        return run(step, pending)

    runner.graphs.run = counted
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    assert set(sizes) >= {1, 3, 4}  # padded (3 -> 4) and unpadded steps both ran through the buffers
    # the device tables took each request's blocks once, not every step's whole tables
    assert 0 < runner.graphs.tables.entries_uploaded < sum(table_entries) / 2
    # async: every decode's input token was sampled by the step before, still on the device
    assert sum(pending_rows) == (sum(sizes) if async_scheduling else 0)


def graph_steps(llm: LLM) -> list:
    """The steps `llm` runs through its decode graphs (on CPU: graph buffers made for 4 rows, run
    eagerly), recorded as they run."""
    runner = llm.engine.runner
    if runner.graphs is None:
        runner.graphs = DecodeGraphs(llm.engine.model, llm.engine.kv_cache, runner.backend, 4,
                                     llm.engine.max_model_len)
    calls = []
    run = runner.graphs.run
    runner.graphs.run = lambda step, pending=None: calls.append(step) or run(step, pending)
    return calls


def test_prompt_logprobs_and_eviction_take_the_eager_path(tiny_llama_d32):
    llm = engine(tiny_llama_d32, max_cudagraph_capture_size=4)
    calls = graph_steps(llm)
    llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1), use_tqdm=False)
    llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4,
                                                 kv_eviction={"policy": "streaming", "budget": 32}),
                 use_tqdm=False)
    assert calls == []
    llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(calls) == 3  # the three decodes after the prefill


def test_steps_with_drafts_run_eagerly_beside_graph_steps(tiny_llama_d32):
    """Speculative decoding on the Triton backend: a step whose decodes carry drafts runs eagerly
    (its rows attended by the decode kernel), plain decode steps through the graph buffers; the
    greedy tokens are the eager engine's without drafts."""
    prompts = [{"prompt_token_ids": ids} for ids in ([7] * 12, [300] * 8)]  # outputs that repeat
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in engine(tiny_llama_d32, enforce_eager=True).generate(
        prompts, params, use_tqdm=False)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = engine(tiny_llama_d32, max_cudagraph_capture_size=4, speculative_config=ngram)
    calls = graph_steps(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.drafter.stats.num_accepted_tokens > 0 and calls


def test_the_profiled_reserve_adds_the_smaller_graphs_outputs(tiny_llama_d32):
    """The profiling pass runs the largest graph's forward (its output included); every smaller
    graph keeps its own output in the shared pool too, [size, hidden] in the model's dtype."""
    llm = engine(tiny_llama_d32, max_cudagraph_capture_size=8)
    model = llm.engine.model
    graphs = DecodeGraphs(model, llm.engine.kv_cache, llm.engine.runner.backend, 8, llm.engine.max_model_len)
    graphs.profile()
    assert graphs.sizes == [1, 2, 4, 8]
    assert graphs.kept_outputs_bytes() == (1 + 2 + 4) * model.config.hidden_size * 4  # float32


def test_enforce_eager_on_cpu_says_it_changes_nothing(tiny_llama, caplog):
    if DEVICE.type == "cuda":
        pytest.skip("on CUDA --enforce-eager turns the graphs off (the test above)")
    with caplog.at_level("INFO", logger="kvserve"):
        llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="4MiB", enforce_eager=True)
    assert llm.engine.runner.graphs is None
    assert "on CPU every step runs eagerly" in caplog.text
