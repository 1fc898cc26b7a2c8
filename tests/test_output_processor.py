"""The output processor (kvserve/engine/output_processor.py) without a model: the sequences of an
n > 1 request are reported together, a stop string ends its sequence with finish reason "stop"
and the string held back, and a request is forgotten (with its sequences' sampler state) once
every sequence finished."""
from __future__ import annotations

from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import SampleResult
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.sampling_params import SamplingParams


def _processor(tokenizer):
    finished: list[tuple[str, RequestStatus]] = []
    forgotten: list[str] = []

    def finish(request: Request, status: RequestStatus) -> None:  # as Scheduler.finish does
        request.status = status
        finished.append((request.request_id, status))

    return OutputProcessor(tokenizer, finish, forgotten.append), finished, forgotten


def _step(processor, sequences, tokens):
    """Append one token to each sequence (as Scheduler.update would) and process the step."""
    for request, token in zip(sequences, tokens):
        request.append_token(token)
    items = [ScheduledRequest(r, 1) for r in sequences]
    return processor.process(items, SampleResult(list(tokens), [None] * len(tokens)))


def test_two_sequences_report_together_and_a_stop_string_ends_one(tiny_tokenizer):
    processor, finished, forgotten = _processor(tiny_tokenizer)
    prompt = tiny_tokenizer.encode("It is a truth")
    params = SamplingParams(n=2, max_tokens=8, stop=[" wife"])
    sequences = [Request(f"{i}_r", prompt, params.for_child(i)) for i in range(2)]
    for r in sequences:
        r.status = RequestStatus.RUNNING
    processor.add("r", "It is a truth", prompt, sequences)
    assert "r" in processor and processor.sequences("r") == sequences

    first = tiny_tokenizer.encode(" universally acknowledged")
    second = tiny_tokenizer.encode(" in want of a wife")
    steps = max(len(first), len(second))
    outputs = []
    for i in range(steps):
        live = [(r, t[i]) for r, t in zip(sequences, (first, second)) if i < len(t) and not r.status.finished]
        outputs = _step(processor, [r for r, _ in live], [t for _, t in live])
        assert [o.request_id for o in outputs] == ["r"]  # one output gathering both sequences
    [out] = outputs
    assert [c.index for c in out.outputs] == [0, 1]
    assert finished == [("1_r", RequestStatus.FINISHED_STOPPED)]
    stopped = out.outputs[1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " wife"
    assert stopped.text == " in want of a"
    assert set(forgotten) == {"1_r"} and not out.finished and "r" in processor

    sequences[0].status = RequestStatus.FINISHED_LENGTH
    last = processor.output("r")
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert set(forgotten) == {"0_r", "1_r"}
    assert "r" not in processor and processor.output("r") is None and processor.sequences("r") == []


def test_a_final_only_request_is_reported_once_when_it_finishes(tiny_tokenizer):
    """What offline generation asks for (LLM.generate): no output per token, one at the end, with
    every token and the whole text; a request beside it still gets one output per step."""
    processor, _, _ = _processor(tiny_tokenizer)
    prompt = tiny_tokenizer.encode("It is a truth")
    final, streamed = (Request(rid, prompt, SamplingParams(max_tokens=8)) for rid in ("final", "streamed"))
    processor.add("final", None, prompt, [final], final_only=True)
    processor.add("streamed", None, prompt, [streamed])
    tokens = tiny_tokenizer.encode(" universally acknowledged")
    for token in tokens:
        outputs = _step(processor, [final, streamed], [token, token])
        assert [o.request_id for o in outputs] == ["streamed"]
    final.status = RequestStatus.FINISHED_LENGTH
    outputs = _step(processor, [final], [tokens[0]])
    [out] = outputs
    assert out.request_id == "final" and out.finished
    assert out.outputs[0].token_ids == tokens + tokens[:1]
    assert out.outputs[0].text == tiny_tokenizer.decode(tokens + tokens[:1])
    assert "final" not in processor and "streamed" in processor


def test_token_ids_reported_are_a_snapshot(tiny_tokenizer):
    """An output keeps the tokens it was reported with while the sequence goes on."""
    processor, _, _ = _processor(tiny_tokenizer)
    prompt = tiny_tokenizer.encode("Hello")
    request = Request("r", prompt, SamplingParams(max_tokens=8))
    processor.add("r", None, prompt, [request])
    [first] = _step(processor, [request], [5])
    _step(processor, [request], [6])
    assert first.outputs[0].token_ids == [5] and request.output_token_ids == [5, 6]


def _single(processor, tokenizer, params: SamplingParams) -> Request:
    request = Request("s", tokenizer.encode("x"), params)
    request.status = RequestStatus.RUNNING
    processor.add("s", "x", request.prompt_token_ids, [request])
    return request


def test_a_stop_string_the_last_allowed_token_completes_is_a_stop(tiny_tokenizer):
    """vLLM: the token that reaches max_tokens and completes a stop string ends with finish reason
    "stop" and the string as stop_reason, its text cut there (not "length")."""
    processor, _, _ = _processor(tiny_tokenizer)
    tokens = tiny_tokenizer.encode(" in want of a wife")
    request = _single(processor, tiny_tokenizer, SamplingParams(max_tokens=len(tokens), stop=[" wife"]))
    for i, token in enumerate(tokens):
        request.append_token(token)
        if i == len(tokens) - 1:
            request.status = RequestStatus.FINISHED_LENGTH  # as Scheduler.update's check_stop does
        [out] = processor.process([ScheduledRequest(request, 1)], SampleResult([token], [None]))
    [completion] = out.outputs
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (" in want of a", "stop", " wife")


def test_min_tokens_ignores_a_stop_string_its_last_held_token_completes(tiny_tokenizer):
    """vLLM's rule: stop strings count from the token after the first min_tokens; one completed by
    the min_tokens-th token does not end the sequence, one completed by the next does."""
    tokens = tiny_tokenizer.encode(" in want of a wife")
    for min_tokens, stopped in ((len(tokens) - 1, True), (len(tokens), False)):
        processor, _, _ = _processor(tiny_tokenizer)
        request = _single(processor, tiny_tokenizer,
                          SamplingParams(max_tokens=len(tokens) + 2, min_tokens=min_tokens, stop=[" wife"]))
        for token in tokens:
            request.append_token(token)
            processor.process([ScheduledRequest(request, 1)], SampleResult([token], [None]))
        assert (request.status == RequestStatus.FINISHED_STOPPED) == stopped, min_tokens
