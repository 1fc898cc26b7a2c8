"""Running requests through an `LLMEngine` to completion, for tests that compare two engines."""
from __future__ import annotations

from kvserve import SamplingParams
from kvserve.engine.llm_engine import LLMEngine


def greedy_tokens(engine: LLMEngine, prompts: dict[str, tuple[list[int], dict | None]]) -> dict[str, list[int]]:
    """Add every prompt (request id -> (token ids, kv_eviction or None)) at once, 24 greedy tokens
    with EOS ignored, and step until all finish; returns request id -> generated token ids."""
    for request_id, (prompt, eviction) in prompts.items():
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, kv_eviction=eviction)
        engine.add_request(prompt, params, request_id)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens
