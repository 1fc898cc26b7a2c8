"""Compacting a sequence's block table after eviction: kept tokens move to the front, the freed
blocks go back to the pool. Plain Python over `Block`s; the token copies it plans are carried
out on the pool tensors by `moves.move_tokens` before the next forward pass.

Kept token i (old cache index kept[i]) becomes cache index i. New block b holds indices
[b*bs, (b+1)*bs). Three cases per new block::

    kept = [0 1 2 3 | 20 .. 31 | 32 .. 47 | 48 .. ]        (streaming: 4 sinks, 16 tokens dropped)
    old:  [blk A: 0-15] [blk B: 16-31] [blk C: 32-47] [blk D: 48-63]
    new:  [blk A: 0-3 stay, 4-15 <- B's 4-15] [blk C as is] [blk D as is] ...     B is freed

* the new block's tokens are one old block's, at the same offsets: that block is taken over
  as it is (nothing copied; it may even stay shared with other sequences). Except a last,
  partly filled new block: the sequence's next tokens are written into it, so it is taken over
  only if the sequence owns it alone (and its hash is dropped);
* otherwise the tokens are copied into a destination: the old block at the same index when
  this sequence owns it alone (tokens already in place are not copied), else another block
  of the sequence that is being given up, else a fresh block from the pool. A block shared
  with another sequence (prefix-cache hit, n > 1 sibling) is never written (copy-on-write);
* old blocks that end up unused are released (tail first); their contents were not touched,
  so a block that was in the prefix cache stays findable.

A destination block's hash is dropped before it is rewritten. Keys are stored before RoPE for
evicting sequences (positions.py), so moving a token needs no re-rotation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.cache.block_pool import Block, BlockPool


@dataclass
class Compaction:
    blocks: list[Block]  # the new block table
    src_slots: list[int] = field(default_factory=list)  # token copies, src -> dst, in new-index order
    dst_slots: list[int] = field(default_factory=list)


def plan_compaction(pool: BlockPool, blocks: list[Block], kept: list[int], block_size: int) -> Compaction | None:
    """Rewrite `blocks` (the sequence's table) to hold exactly the `kept` old cache indices.
    Updates the pool (allocations, releases, hashes) and returns the new table and the copies
    to make; returns None, changing nothing, if a needed fresh block is not available."""
    bs = block_size
    count = -(-len(kept) // bs)
    spans = [(b * bs, min((b + 1) * bs, len(kept))) for b in range(count)]

    taken_over: dict[int, int] = {}  # new block -> old block moved as it is
    for b, (lo, hi) in enumerate(spans):
        first = kept[lo]
        if first % bs == 0 and kept[hi - 1] - first == hi - 1 - lo:
            if hi - lo < bs and blocks[first // bs].ref_cnt != 1:
                continue  # new tokens will be written after these: never into a shared block
            taken_over[b] = first // bs
    claimed = set(taken_over.values())

    destinations: dict[int, int | None] = {}  # new block -> old block rewritten (None: a fresh block)
    for b in range(count):
        if b not in taken_over and b not in claimed and blocks[b].ref_cnt == 1:
            destinations[b] = b
    spare = [i for i, blk in enumerate(blocks)
             if i not in claimed and i not in destinations.values() and blk.ref_cnt == 1]
    for b in range(count):
        if b not in taken_over and b not in destinations:
            destinations[b] = spare.pop() if spare else None
    fresh_needed = sum(1 for old in destinations.values() if old is None)
    if fresh_needed > pool.num_free_blocks:
        return None

    fresh = iter(pool.allocate(fresh_needed))
    plan = Compaction(blocks=[])
    for b, (lo, hi) in enumerate(spans):
        if b in taken_over:
            plan.blocks.append(blocks[taken_over[b]])
            if hi - lo < bs:
                pool.unpublish(blocks[taken_over[b]])
            continue
        old = destinations[b]
        dest = blocks[old] if old is not None else next(fresh)
        pool.unpublish(dest)
        in_place = old == b
        for j in range(lo, hi):
            src = kept[j]
            if in_place and src == j:
                continue
            plan.src_slots.append(blocks[src // bs].block_id * bs + src % bs)
            plan.dst_slots.append(dest.block_id * bs + j % bs)
        plan.blocks.append(dest)
    used = claimed | {old for old in destinations.values() if old is not None}
    pool.release([blk for i, blk in reversed(list(enumerate(blocks))) if i not in used])
    return plan
