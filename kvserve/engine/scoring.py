"""Teacher-forced scoring: the logits at every position of a given sequence, through the paged cache.

The sequence is fed in chunks, each prepared and run by the ModelRunner like a serving step
(asking for every row's logits instead of the last one's), so a chunk attends to the K/V the
earlier chunks stored in whatever format the cache stores them, and a request under KV eviction
evicts between chunks as it would while serving. `kvserve eval` and the tests compare formats
and eviction policies with it.

It runs beside the scheduler, not through it: a chunk is computed when the caller asks for it
(the iterator is lazy, and callers interleave scoring runs), it takes no sequence slot, and
only blocks that are free at that moment.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.preflight import CapacityError
from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest


def score_chunks(runner: ModelRunner, kv_manager: KVCacheManager, request: Request,
                 chunk_size: int, hidden: bool = False) -> Iterator[torch.Tensor]:
    """Float32 logits [chunk tokens, vocab] (with `hidden`, the final-normed hidden states
    [chunk tokens, hidden size] instead) for each chunk of at most `chunk_size` tokens of
    `request.token_ids`, in order (fewer under eviction: the cache's budget caps a chunk). The
    request's blocks go back to the pool when the iterator ends or is closed. Raises
    CapacityError when the free blocks cannot hold the next chunk."""
    try:
        while request.num_computed_tokens < request.num_tokens:
            n = min(chunk_size, request.num_tokens - request.num_computed_tokens, kv_manager.max_new_tokens(request))
            if not kv_manager.allocate(request, n):
                raise CapacityError("not enough free KV blocks to score this sequence")
            runner.move_tokens(*kv_manager.take_moves())
            item = ScheduledRequest(request, n)
            inputs = runner.prepare([item], {request.request_id: kv_manager.block_ids(request.request_id)},
                                    all_logits=True)
            out = runner.hidden_states(inputs) if hidden else runner.forward(inputs)
            request.num_computed_tokens += n
            yield out
    finally:
        kv_manager.free(request)
