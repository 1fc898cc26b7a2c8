"""--async-scheduling: the next step is scheduled and launched before the step in flight is waited
for, a decode reading its input token on the device. A request's tokens, texts, finish reasons and
logprobs are the ones the one-step-at-a-time engine gives, through chunked prefill, preemptions,
stops on a token or a string (the token computed after a stop is dropped), seeded sampling with
n > 1, min_tokens, penalties, a logits processor, a grammar, requests that make the engine wait
(prompt logprobs), aborts and a failed step. Both engines run --deterministic, so any difference
is the scheduling's, not batch-dependent rounding."""
from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.engine.request import RequestStatus
from kvserve.outputs import top_logprobs

PROMPTS = ["It is a truth universally acknowledged", "Hello", "Mr. Bennet was so odd a mixture of quick parts",
           "The", "However little known the feelings or views of such a man may be", "My dear Mr. Bennet",
           "Netherfield is taken at last", "You want to tell me, and I have no objection to hearing it",
           "She is tolerable, but not handsome enough", "It is a truth universally acknowledged", "Hello there",
           "Write it"]


def engine(model, async_scheduling: bool, **options) -> LLM:
    return LLM(str(model), dtype="float32", kv_cache_memory=options.pop("kv_cache_memory", "4MiB"),
               max_num_batched_tokens=32, block_size=8, deterministic=True, async_scheduling=async_scheduling,
               **options)


def outputs(llm: LLM, prompts, params) -> list[list[tuple]]:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              c.logprobs) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def workload(stop_token: int, stop_text: str) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, n=2, max_tokens=9),
        SamplingParams(temperature=0, max_tokens=20, stop=[stop_text]),
        SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=15, min_tokens=10,
                       stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=7, logprobs=2),
        SamplingParams(temperature=0.5, min_p=0.1, seed=5, max_tokens=16),
        SamplingParams(temperature=0.9, seed=8, max_tokens=14, frequency_penalty=1.5, presence_penalty=0.5,
                       repetition_penalty=1.3),
        # a favoured token repeats until its penalty outweighs the bias: off by one if the latest is not counted
        SamplingParams(temperature=0, max_tokens=14, logit_bias={300: 8.0}, frequency_penalty=2.0),
        SamplingParams(temperature=0, max_tokens=12, logits_processors=[ban_previous_token]),
        SamplingParams(temperature=0.7, seed=4, max_tokens=16,
                       structured_outputs=StructuredOutputsParams(regex="(ab|cd)+[0-9]{2}")),
    ]


def ban_previous_token(output_token_ids: list[int], row):
    """A logits processor that reads the output so far: never the same token twice in a row."""
    if output_token_ids:
        row[output_token_ids[-1]] = float("-inf")
    return row


PROMPT_MIX = [[t % 400 + 5 for t in range(i, i + 4 + 9 * i)] if i % 3 == 0 else p for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def stops(tiny_llama):
    """A token that prompt 2's greedy output reaches mid-way, a text that prompt 4's does."""
    llm = engine(tiny_llama, async_scheduling=False)
    greedy = [o.outputs[0] for o in llm.generate(PROMPT_MIX, SamplingParams(temperature=0, max_tokens=12),
                                                 use_tqdm=False)]
    llm.close()
    text = greedy[4].text
    return greedy[2].token_ids[4], text[len(text) // 2:len(text) // 2 + 3]


@pytest.mark.parametrize("kv_cache_memory", ["4MiB", "96KiB"], ids=["roomy", "preempting"])
def test_async_scheduling_gives_the_one_step_at_a_time_outputs(tiny_llama, stops, kv_cache_memory):
    stop_token, stop_text = stops
    params = workload(stop_token, stop_text)
    results = {}
    for async_scheduling in (False, True):
        llm = engine(tiny_llama, async_scheduling, kv_cache_memory=kv_cache_memory)
        results[async_scheduling] = outputs(llm, PROMPT_MIX, params)
        preemptions = llm.engine.scheduler.num_preemptions
        assert llm.engine.num_free_blocks == llm.engine.num_blocks  # nothing left held
        llm.close()
    assert results[True] == results[False]
    reasons = [[c[2] for c in o] for o in results[True]]
    assert reasons[2] == reasons[4] == ["stop"] and reasons[0] == ["length"]
    assert len(results[True][6][0][4]) == 7 and all(len(top_logprobs(e, 2)) == 2 for e in results[True][6][0][4])
    processed = results[True][10][0][0]
    assert all(a != b for a, b in zip(processed, processed[1:]))
    assert re.fullmatch("(ab|cd)+[0-9]{2}", results[True][11][0][1]) and results[True][11][0][2] == "stop"
    if kv_cache_memory == "96KiB":
        assert preemptions > 0


def test_a_request_needing_host_tokens_makes_the_engine_wait_then_overlap_resumes(tiny_llama):
    """A request asking for prompt logprobs (planned on the host) arriving mid-run: steps run one at
    a time while it lives, and everyone's tokens and logprobs are unchanged."""
    def run(async_scheduling: bool) -> tuple[dict, list]:
        llm = engine(tiny_llama, async_scheduling)
        core = llm.engine
        for i, prompt in enumerate(PROMPTS[:4]):
            core.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, logprobs=1), request_id=f"r{i}")
        launched = []
        real_launch = core.runner.launch
        core.runner.launch = lambda scheduled, tables, previous=None: (  # launched while one is in flight?
            launched.append(previous is not None) or real_launch(scheduled, tables, previous))
        finals, step = {}, 0
        while core.has_unfinished_requests():
            if step == 3:
                core.add_request(PROMPTS[4], SamplingParams(temperature=0, max_tokens=3, logprobs=1,
                                                                 prompt_logprobs=1), request_id="lp")
            for out in core.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0]
            step += 1
        llm.close()
        return {rid: (o.token_ids, [e[t].logprob for e, t in zip(o.logprobs or [], o.token_ids)])
                for rid, o in finals.items()}, launched

    sync, _ = run(False)
    overlapped, launched = run(True)
    assert overlapped == sync and len(sync["lp"][1]) == 3
    # overlapped before the logprobs request came, one at a time while it lived, overlapped again after
    assert launched[1] and not all(launched) and launched[-1]


def test_abort_while_a_step_is_in_flight(tiny_llama):
    llm = engine(tiny_llama, async_scheduling=True)
    core = llm.engine
    for i, prompt in enumerate(PROMPTS[:3]):
        core.add_request(prompt, SamplingParams(temperature=0, max_tokens=12), request_id=f"r{i}")
    for _ in range(3):
        core.step()
    assert core._in_flight is not None and "r1" in [s.request.request_id for s in core._in_flight.sampled]
    aborted = core.abort_request("r1")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    later = []
    while core.has_unfinished_requests():
        later += core.step()
    assert "r1" not in [o.request_id for o in later]
    assert {o.request_id for o in later if o.finished} == {"r0", "r2"}
    assert all(len(o.outputs[0].token_ids) == 12 for o in later if o.finished)
    assert core.num_free_blocks == core.num_blocks
    llm.close()


def test_a_failed_launch_drops_the_step_in_flight_and_the_engine_goes_on(tiny_llama):
    llm = engine(tiny_llama, async_scheduling=True)
    core = llm.engine
    reference = engine(tiny_llama, async_scheduling=False)
    expected = reference.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8),
                                  use_tqdm=False)[0].outputs[0].token_ids
    reference.close()
    core.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8), request_id="a")
    core.step()
    core.step()
    real_launch, failed = core.runner.launch, []

    def launch(*args):
        if not failed:
            failed.append(True)
            raise RuntimeError("injected fault")
        return real_launch(*args)

    core.runner.launch = launch
    with pytest.raises(RuntimeError, match="injected"):
        core.step()
    request = core.scheduler.running[0]
    assert core._in_flight is None and request.num_pending_tokens == 0
    final = None
    while core.has_unfinished_requests():
        final = next((o for o in core.step() if o.finished), final)
    # the step before the failed one was reported, its token kept: the same tokens
    assert final.outputs[0].token_ids == expected
    assert request.status == RequestStatus.FINISHED_LENGTH
    llm.close()


@pytest.mark.parametrize("failing", ["launch", "sample"])
def test_a_request_the_step_before_a_failure_finished_is_reported_finished(tiny_llama, failing):
    """The step in flight when the next one fails (launching its forward pass, or sampling after
    the step before was reported) finished request "short": its final output is handed out by
    take_salvaged_outputs, not lost with the failed step."""
    reference = engine(tiny_llama, async_scheduling=False)
    expected = reference.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3),
                                  use_tqdm=False)[0].outputs[0].token_ids
    reference.close()
    llm = engine(tiny_llama, async_scheduling=True)
    core = llm.engine
    core.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3), request_id="short")
    core.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12), request_id="long")
    reported = []
    while True:  # until the step in flight samples short's last token
        reported += core.step()
        short = core.output_processor.sequences("short")[0]
        if short.num_output_tokens + short.num_pending_tokens == 3:
            break
    real = getattr(core.runner, failing)

    def fail_once(*args):
        setattr(core.runner, failing, real)
        raise RuntimeError("injected fault")

    setattr(core.runner, failing, fail_once)
    with pytest.raises(RuntimeError, match="injected"):
        core.step()
    salvaged = {o.request_id: o for o in core.take_salvaged_outputs()}
    assert core.take_salvaged_outputs() == []
    assert salvaged["short"].finished and salvaged["short"].outputs[0].finish_reason == "length"
    assert salvaged["short"].outputs[0].token_ids == expected
    assert not salvaged["long"].finished and core._in_flight is None
    core.abort_request("long")
    assert not core.has_unfinished_requests() and core.num_free_blocks == core.num_blocks
    llm.close()


def test_async_scheduling_through_the_server(server_factory, tiny_llama):
    """Streamed and whole completions from a --async-scheduling server, under concurrent traffic,
    match what the one-step-at-a-time engine gives."""
    server = server_factory(str(tiny_llama), "--async-scheduling", "--deterministic", "--dtype", "float32",
                            "--kv-cache-memory", "4MiB", "--block-size", "8", "--max-num-batched-tokens", "32")
    body = {"model": str(tiny_llama), "prompt": PROMPTS[2], "max_tokens": 14, "temperature": 0}
    reference = engine(tiny_llama, async_scheduling=False)
    expected = reference.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=14),
                                  use_tqdm=False)[0].outputs[0].text
    reference.close()
    url = f"{server.base_url}/v1/completions"
    results: list[str] = []

    def ask(payload: dict) -> None:
        response = httpx.post(url, json=payload, timeout=120)
        assert response.status_code == 200, response.text
        results.append(response.json()["choices"][0]["text"])

    threads = [threading.Thread(target=ask, args=({**body, "prompt": p, "max_tokens": 3 + i},))
               for i, p in enumerate(PROMPTS[3:7])] + [threading.Thread(target=ask, args=(body,))]
    for thread in threads:
        thread.start()
    streamed = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed.append(json.loads(line[6:])["choices"][0]["text"])
    for thread in threads:
        thread.join()
    assert "".join(streamed) == expected and expected in results


def test_refused_with_tensor_parallelism():
    from kvserve.engine.args import EngineArgs
    with pytest.raises(ValueError, match="--async-scheduling does not work with --tensor-parallel-size"):
        EngineArgs(model="x", async_scheduling=True, tensor_parallel_size=2).validate()
