"""Speculative decoding by n-gram lookup (kvserve/engine/speculative.py): what is drafted, that the
scheduler never preempts for a draft and counts only confirmed positions, that every emitted
token has the model's distribution (sampled from fixed logits, no model), and that an engine with
drafts gives the tokens, texts, finish reasons and logprobs of one without, through stops,
preemptions and n > 1; the server's flag and its /metrics counters."""
from __future__ import annotations

import collections
import json
import math
import time

import httpx
import pytest
import torch

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.engine.args import EngineArgs
from kvserve.engine.model_runner import sampled_rows
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import SampleResult, Sampler
from kvserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from kvserve.engine.speculative import Drafter, SpeculativeConfig, accept_drafts, ngram_draft
from test_server import sse_events

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# ----------------------------------------------------------------------------- drafting
def test_the_longest_recurring_suffix_gives_the_draft():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 5, 2, 3, 4, 7, 2, 3]
    # [2, 3] occurred at 1-2 (then 9) and 5-6 (then 4): the latest occurrence followed by 2 tokens
    assert ngram_draft(tokens, 1, 3, 2) == [4, 7]
    # [9, 2, 3] never recurs, so [2, 3] is the longest suffix; with 3 wanted, 5-6 still has 3 after it
    assert ngram_draft(tokens, 1, 3, 3) == [4, 7, 2]
    assert ngram_draft(tokens, 3, 3, 2) == []  # no suffix of 3 recurs
    assert ngram_draft([4, 5, 6], 1, 3, 2) == []
    assert ngram_draft(tokens, 1, 3, 0) == []


def test_a_repeating_span_drafts_past_one_period():
    """The latest occurrence of the suffix in a span repeating every 3 tokens is followed by 3
    tokens only; an earlier one gives all k."""
    tokens = [8, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
    assert ngram_draft(tokens, 2, 2, 5) == [3, 1, 2, 3, 1]


def test_config_takes_vllms_json_and_refuses_what_is_not_built():
    assert SpeculativeConfig.parse(None) is None
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (4, 5, 5)
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.parse({**NGRAM, "disable_by_batch_size": 4}).disable_by_batch_size == 4
    for bad, message in [("{", "must be a JSON object"),
                         ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model not supported"),
                         ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1, got None"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                           "prompt_lookup_max": 2}, "prompt_lookup_min (4) must not exceed")]:
        with pytest.raises(ValueError) as error:
            SpeculativeConfig.parse(bad)
        assert message in str(error.value)
    with pytest.raises(ValueError, match="does not work with --async-scheduling"):
        EngineArgs(speculative_config=NGRAM, async_scheduling=True).validate()


# ----------------------------------------------------------------------------- scheduling
def _scheduler(num_blocks: int, budget: int = 64, max_num_seqs: int = 16) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, True)
    drafter = Drafter(SpeculativeConfig(3, 3, 1), max_model_len=256)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 256), kv, drafter)


def _decoding(scheduler: Scheduler, prompts: dict[str, list[int]], max_tokens: int = 20) -> list[Request]:
    """Requests (id -> prompt) whose prompts are computed and first token sampled (each prompt's
    first token again), drafting off meanwhile."""
    requests = [Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for rid, prompt in prompts.items()]
    drafter, scheduler.drafter = scheduler.drafter, None
    for request in requests:
        scheduler.add(request)
    while not all(r.num_output_tokens for r in requests):
        items = scheduler.schedule()
        scheduler.update(items, {s.request.request_id: s.request.prompt_token_ids[0] for s in items if s.samples})
    scheduler.drafter = drafter
    return requests


def test_a_decode_carries_drafts_and_counts_only_the_confirmed_positions():
    scheduler = _scheduler(32)
    [request] = _decoding(scheduler, {"r": [1, 2, 3, 4, 1, 2, 3, 4]})  # then 1: the draft is 2, 3, 4
    [item] = scheduler.schedule()
    assert item.draft_token_ids == [2, 3, 4] and item.num_new_tokens == 4 and item.samples
    computed = request.num_computed_tokens
    # the samples confirm 2 and 3, then differ: 2, 3 and the sample (9) are emitted
    scheduler.update([item], {"r": 9}, accepted={"r": [2, 3]})
    assert request.output_token_ids == [1, 2, 3, 9]
    assert request.num_computed_tokens == computed + 3  # the last token and two drafts: 9's is next
    assert request.num_tokens - request.num_computed_tokens == 1


def test_drafts_stop_at_max_tokens_and_the_budget_and_never_preempt():
    scheduler = _scheduler(32)
    _decoding(scheduler, {"r": [1, 2, 3, 4] * 3}, max_tokens=3)
    [item] = scheduler.schedule()
    assert item.draft_token_ids == [2]  # 3 tokens at most: the first, one draft, the sample
    scheduler = _scheduler(32, budget=3)
    _decoding(scheduler, {"r": [1, 2, 3, 4] * 3})
    [item] = scheduler.schedule()
    assert len(item.draft_token_ids) == 2  # the budget's 3 tokens: the decode and 2 drafts
    # a step samples at most max_num_seqs rows, drafts included
    scheduler = _scheduler(32, max_num_seqs=3)
    _decoding(scheduler, {"a": [1, 2, 3, 1, 2, 3, 1], "b": [5, 6, 7, 5, 6, 7, 5]})
    assert [len(s.draft_token_ids) for s in scheduler.schedule()] == [1, 0]  # 3 rows: a, its draft, b

    # The drafts take what the step leaves: here one free block, which the first decode's drafts
    # take (its positions 8-10 start a block); the second runs without drafts, and nothing is preempted.
    scheduler = _scheduler(5)  # 5 blocks of 4
    a, b = _decoding(scheduler, {"a": [1, 2, 3, 1, 2, 3, 1], "b": [5, 6, 7, 5, 6, 7, 5]})  # 8 tokens, 2 blocks each
    assert scheduler.kv.pool.num_free_blocks == 1
    steps = scheduler.schedule()
    assert [(s.request, s.draft_token_ids) for s in steps] == [(a, [2, 3, 1]), (b, ())]
    assert scheduler.num_preemptions == 0 and scheduler.kv.pool.num_free_blocks == 0

    # vLLM's disable_by_batch_size: no drafts while more requests run than that
    scheduler = _scheduler(32)
    scheduler.drafter.config = SpeculativeConfig(3, 3, 1, disable_by_batch_size=1)
    _decoding(scheduler, {"a": [1, 2, 3, 1, 2, 3, 1], "b": [5, 6, 7, 5, 6, 7, 5]})
    assert [s.draft_token_ids for s in scheduler.schedule()] == [(), ()]


def test_a_stop_token_among_the_samples_ends_what_a_step_emits():
    eos = 9
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=(eos,))
    # drafts 5, 9, 6; the samples confirm 5 and 9: 9 is the sampled token, nothing after it
    found = accept_drafts([request], [[5, eos, 6]], [5, eos, 6, 7], [None] * 4)
    assert (found.drafts, found.token_ids) == ([[5]], [eos])


# ----------------------------------------------------------------------------- the distribution
def test_each_emitted_token_has_the_models_distribution():
    """Two positions with fixed distributions and a draft for the first: the first emitted token
    follows p0 (the draft is not favoured), and the second, emitted when the draft was confirmed,
    follows p1."""
    p0, p1 = torch.tensor([0.5, 0.3, 0.15, 0.05]), torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = 20_000
    requests = [Request(f"r{i}", [0], SamplingParams(temperature=1.0)) for i in range(rows)]
    logits = torch.stack([p0.log(), p1.log()] * rows)
    sampler = Sampler(4, torch.device("cpu"))
    torch.manual_seed(0)
    tokens, _ = sampler.sample_on_device(logits, [r for r in requests for _ in range(2)])
    found = accept_drafts(requests, [[1]] * rows, tokens.tolist(), [None] * (2 * rows))
    first = collections.Counter(d[0] if d else t for d, t in zip(found.drafts, found.token_ids))
    second = collections.Counter(t for d, t in zip(found.drafts, found.token_ids) if d)
    noise = 4 * math.sqrt(0.25 / rows)
    assert all(abs(first[t] / rows - p0[t]) < noise for t in range(4)), first
    confirmed = sum(second.values())
    assert abs(confirmed / rows - p0[1]) < noise
    assert all(abs(second[t] / confirmed - p1[t]) < 4 * math.sqrt(0.25 / confirmed) for t in range(4)), second


def test_penalties_and_min_tokens_count_the_drafts_before_a_row():
    """Row 1 verifies the position after draft 1: a frequency penalty counts that draft (token 1
    falls below token 2), and min_tokens, reached there, no longer masks EOS (3)."""
    eos = 3
    penalised = Request("p", [0], SamplingParams(temperature=0, frequency_penalty=2.0), eos_token_ids=(eos,))
    waiting = Request("m", [0], SamplingParams(temperature=0, min_tokens=1), eos_token_ids=(eos,))
    items = [ScheduledRequest(penalised, 2, [1]), ScheduledRequest(waiting, 2, [1])]
    rows = sampled_rows(items)
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0], [0.0, 3.0, 2.5, 0.0],    # penalised: rows 0, 1
                           [0.0, 1.0, 0.0, 5.0], [0.0, 1.0, 0.0, 5.0]])  # waiting: EOS best at both
    tokens, _ = Sampler(4, torch.device("cpu")).sample_on_device(logits, rows)
    assert tokens.tolist() == [1, 2, 1, eos]
    found = accept_drafts([penalised, waiting], [[1], [1]], tokens.tolist(), [None] * 4)
    assert (found.drafts, found.token_ids) == ([[1], [1]], [2, eos])


# ----------------------------------------------------------------------------- the output processor
def test_a_stop_string_inside_the_drafts_drops_what_follows(tiny_tokenizer):
    finished = []

    def finish(request: Request, status: RequestStatus) -> None:
        request.status = status
        finished.append(status)

    processor = OutputProcessor(tiny_tokenizer, finish, lambda rid: None)
    prompt = tiny_tokenizer.encode("It is a truth")
    request = Request("r", prompt, SamplingParams(max_tokens=20, stop=[" wife"]))
    request.status = RequestStatus.RUNNING
    processor.add("r", "It is a truth", prompt, [request])
    emitted = tiny_tokenizer.encode(" in want of a wife and more")
    for token in emitted:  # as Scheduler.update appends them
        request.append_token(token)
    drafts, sampled = emitted[:-1], emitted[-1]
    [out] = processor.process([ScheduledRequest(request, len(emitted), drafts)],
                              SampleResult([sampled], [None], [drafts], [[None] * len(drafts)]))
    completion = out.outputs[0]
    assert completion.text == " in want of a" and completion.finish_reason == "stop"
    assert completion.stop_reason == " wife" and finished == [RequestStatus.FINISHED_STOPPED]
    stop_end = len(tiny_tokenizer.encode(" in want of a wife"))
    assert completion.token_ids == emitted[:stop_end]


# ----------------------------------------------------------------------------- the engine
def _engine(model, speculative: dict | None, **options) -> LLM:
    return LLM(str(model), dtype="float32", kv_cache_memory=options.pop("kv_cache_memory", "4MiB"), block_size=8,
               deterministic=True, speculative_config=speculative, **options)


def _outputs(llm: LLM, prompts, params) -> list[list[tuple]]:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_outputs_are_the_ones_without_drafts(tiny_llama):
    """Under --deterministic a verified row is the computation a decode is, so the tokens and their
    logprobs are exactly the plain engine's, greedy or seeded (a seeded draw depends on the output
    position, not on the draws discarded before it); with a pool small enough to preempt too."""
    plain = _engine(tiny_llama, None)
    loops = [{"prompt_token_ids": p} for p in ([7] * 12, [5, 6, 7, 8] * 4, [11, 12, 13] * 5, [100, 200])]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = _outputs(plain, loops, greedy)
    text = reference[1][0][1]
    stop = text[len(text) // 2:len(text) // 2 + 3]  # a stop string in the middle of an output
    workload = [greedy, SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=True),
                SamplingParams(temperature=0.3, top_k=20, seed=5, n=2, max_tokens=30, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=25, n=2, stop_token_ids=[reference[2][0][0][20]])]
    expected = [_outputs(plain, loops, params) for params in workload]
    speculating = _engine(tiny_llama, NGRAM)
    assert [_outputs(speculating, loops, params) for params in workload] == expected
    stats = speculating.engine.drafter.stats
    assert stats.num_accepted_tokens > 20 and stats.accepted_per_position[1] > 0, stats

    tight = _engine(tiny_llama, NGRAM, kv_cache_memory="96KiB", max_num_seqs=4)
    assert _outputs(tight, loops * 2, greedy) == reference * 2
    assert tight.engine.scheduler.num_preemptions > 0


def test_penalties_min_tokens_and_grammars_apply_at_every_verified_position(tiny_llama):
    """The sampler sees each verified row with the drafts before it as the request's tokens:
    penalties, min_tokens and structured outputs give the plain engine's tokens. A request with a
    logits processor (its own state) does not draft."""
    loops = [{"prompt_token_ids": ids} for ids in ([7] * 12, [5, 6, 7, 8] * 4)]
    params = [SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.3, presence_penalty=0.2,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, min_tokens=12, logprobs=1)]
    plain, speculating = _engine(tiny_llama, None), _engine(tiny_llama, NGRAM)
    for p in params:
        before = speculating.engine.drafter.stats.copy()
        assert _outputs(speculating, loops, p) == _outputs(plain, loops, p)
        assert speculating.engine.drafter.stats.num_accepted_tokens > before.num_accepted_tokens, p

    # a grammar masks each verified row as it stands after the drafts before it
    for constraint in (StructuredOutputsParams(regex="(abc )+x"), StructuredOutputsParams(
            json={"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})):
        p = SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)
        before = speculating.engine.drafter.stats.copy()
        assert _outputs(speculating, loops, p) == _outputs(plain, loops, p)
        assert speculating.engine.drafter.stats.num_accepted_tokens > before.num_accepted_tokens, constraint

    # a grammar completed by a draft: the request stops at that token, as it does one token at a
    # time (as a draft it was followed by a sampled EOS)
    text = "red fox jumps."
    copied = [{"prompt_token_ids": plain.engine.tokenizer.encode((text + "\n") * 3, add_special_tokens=False)}]
    for constraint in (StructuredOutputsParams(choice=[text]), StructuredOutputsParams(regex=r"red fox jumps\.")):
        p = SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)
        before = speculating.engine.drafter.stats.copy()
        assert _outputs(speculating, copied, p) == _outputs(plain, copied, p)
        assert speculating.engine.drafter.stats.num_accepted_tokens > before.num_accepted_tokens, constraint

    before = speculating.engine.drafter.stats.copy()
    processed = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                               logits_processors=[lambda output, row: row])
    speculating.generate(loops, processed, use_tqdm=False)
    assert speculating.engine.drafter.stats.num_drafts == before.num_drafts

    class BansOnce:  # bans a token at the first position, then says it is done (LogitsProcessor)
        done = False

        def __call__(self, output, row):
            row[3] = float("-inf")
            self.done = True
            return row

    def once():
        return SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logits_processors=[BansOnce()])
    assert _outputs(speculating, loops[:1], once()) == _outputs(plain, loops[:1], once())
    assert speculating.engine.drafter.stats.num_drafts > before.num_drafts  # drafts once it is done


def test_no_drafts_beside_a_decode_under_eviction(tiny_llama):
    """A decode under KV eviction is packed between the plain decodes and the verifying chunks,
    which the backends attend as one run of decodes: such a step takes no drafts, and both
    requests get the tokens they get without speculative decoding."""
    requests = [{"prompt_token_ids": [5, 6, 7, 8] * 4}, {"prompt_token_ids": [9, 10, 11] * 5}]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             kv_eviction={"policy": "streaming", "budget": 16})]

    def outputs(speculative: dict | None) -> tuple[list, LLM]:
        llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="4MiB", block_size=8,
                  speculative_config=speculative)
        return [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)], llm

    expected, _ = outputs(None)
    got, speculating = outputs(NGRAM)
    assert got == expected
    assert speculating.engine.drafter.stats.num_drafts > 0  # once the evicting request finished


# ----------------------------------------------------------------------------- the server
def test_server_speculates_and_counts_it_in_metrics(server_factory, tiny_llama):
    server = server_factory(str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "16MiB",
                            "--speculative-config", json.dumps(NGRAM))
    body = {"model": str(tiny_llama), "prompt": [5, 6, 7, 8] * 4, "max_tokens": 30, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 30
    # streamed, several tokens may arrive in one event: the same text, a logprob for every token
    streamed = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": True, "logprobs": 1},
                          timeout=60)
    events = [json.loads(e) for e in sse_events(streamed)[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == response.json()["choices"][0]["text"]
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events) == 30
    assert any(len(e["choices"][0]["logprobs"]["tokens"]) > 1 for e in events)  # drafts arrived together

    def drafted() -> dict[str, float]:
        samples = server.metrics()
        return {k: v for k, v in samples.items() if k.startswith("kvserve:spec_decode") and "_total" in k}

    deadline = time.monotonic() + 10
    while not drafted().get("kvserve:spec_decode_num_drafts_total") and time.monotonic() < deadline:
        time.sleep(0.2)
    counts = drafted()
    assert counts["kvserve:spec_decode_num_drafts_total"] > 0
    assert 0 < counts["kvserve:spec_decode_num_accepted_tokens_total"] <= counts[
        "kvserve:spec_decode_num_draft_tokens_total"]
    assert counts['kvserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
