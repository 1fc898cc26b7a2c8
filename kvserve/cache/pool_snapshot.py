"""A copy of the block pool's per-block state, for watching the pool (the server's dashboard).

Each block falls in exactly one state, from its ref-count and prefix-cache hash:

    free     ref-count 0, no hash      (nothing worth keeping)
    cached   ref-count 0, with a hash  (free, but a prefix-cache hit can still revive it)
    used     ref-count 1               (held by one request)
    shared   ref-count > 1             (held by several: a shared prefix, or n > 1 samples)

so free + cached is what vLLM's metrics call free blocks. The copy is plain bytes, taken in one
pass over the pool by whoever owns it (the engine thread, between steps); reading it needs no lock.
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

import numpy as np

from kvserve.cache.block_pool import NULL_BLOCK_ID, BlockPool


class BlockState(enum.IntEnum):
    FREE = 0
    CACHED = 1
    USED = 2
    SHARED = 3


# Bit set in a block's state byte when the block carries a prefix-cache hash (in any state).
PUBLISHED_BIT = 4
# Ref-counts are copied as uint16; a larger count (65,535 sharers) is shown as the maximum.
MAX_REF_COUNT = np.iinfo(np.uint16).max


@dataclass(frozen=True)
class PoolSnapshot:
    """`states[i]` and `ref_counts[i]` describe block id `first_block_id + i`."""

    states: np.ndarray  # uint8: BlockState in the low two bits, PUBLISHED_BIT if hashed
    ref_counts: np.ndarray  # uint16
    first_block_id: int = NULL_BLOCK_ID + 1

    @property
    def num_blocks(self) -> int:
        return len(self.states)

    def counts(self) -> dict[BlockState, int]:
        """Blocks per state."""
        per_state = np.bincount(self.states & 3, minlength=len(BlockState))
        return {state: int(per_state[state]) for state in BlockState}


_REF_CNT = operator.attrgetter("ref_cnt")


def snapshot_pool(pool: BlockPool) -> PoolSnapshot:
    """Copy every block's ref-count (one pass over the pool, no object per block) and which blocks
    carry a prefix-cache hash (a pass over the hashed ones only)."""
    n, first = pool.num_blocks, pool.blocks[0].block_id
    refs = np.fromiter(map(_REF_CNT, pool.blocks), dtype=np.int64, count=n)
    hashed = np.zeros(n, dtype=bool)
    hashed[np.fromiter((b.block_id for b in pool.cached.values()), dtype=np.int64, count=len(pool.cached)) - first] = True
    states = np.where(refs > 1, BlockState.SHARED, np.where(refs == 1, BlockState.USED,
                                                            np.where(hashed, BlockState.CACHED, BlockState.FREE)))
    states = states.astype(np.uint8) | (hashed.astype(np.uint8) * PUBLISHED_BIT)
    return PoolSnapshot(states=states, ref_counts=np.minimum(refs, MAX_REF_COUNT).astype(np.uint16),
                        first_block_id=first)
