"""StreamingLLM on the default model past its trained context (8,192 tokens): 10,000 tokens of the
novel through one sequence in prefill chunks, then 200 generated tokens, with a 1,024-token budget.
The KV blocks the sequence holds stay within ceil(budget / block_size) + 2 the whole time."""
from __future__ import annotations

import math

from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from tiny_models import BOOK

BUDGET = 1024
PROMPT_TOKENS = 10_000
NEW_TOKENS = 200


def test_streaming_feeds_10k_tokens_and_generates_in_bounded_memory():
    # Chunks of the budget keep the prefill to ~10 steps.
    engine = LLMEngine(EngineArgs(kv_eviction="streaming", kv_budget=BUDGET, max_num_batched_tokens=BUDGET,
                                  kv_cache_memory="256MiB"))
    prompt = engine.tokenizer.encode(BOOK.read_text())[:PROMPT_TOKENS]
    assert len(prompt) == PROMPT_TOKENS > engine.max_model_len
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), "novel")
    bound = math.ceil(BUDGET / engine.args.block_size) + 2
    held, finished = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished = output
        blocks = engine.kv_manager.req_blocks.get("novel")
        if blocks is not None:
            held.append(len(blocks))
            assert len(blocks) <= bound, f"held {len(blocks)} blocks, bound {bound}"
    assert finished is not None and len(finished.outputs[0].token_ids) == NEW_TOKENS
    assert finished.outputs[0].finish_reason == "length"
    assert len(held) >= PROMPT_TOKENS // BUDGET + NEW_TOKENS - 1 and max(held) >= BUDGET // engine.args.block_size
    assert engine.num_free_blocks == engine.num_blocks
