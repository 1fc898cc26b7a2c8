"""Which replica holds which cached block: the router's view of every replica's prefix cache.

Filled from the replicas' KV-cache events (kvserve/server/kv_events_api.py): a replica's entries
are replaced by its snapshot, changed by its BlockStored / BlockRemoved events and dropped when it
clears its cache, restarts (a new instance id) or is taken out. Every entry names its medium: the
replica's pool, or one of its offload tiers ("host", "disk"); a block can be in several. The index
is bounded: past `max_entries` (replica, medium, hash) entries the oldest stored is forgotten,
which can only make the router route a request away from a prefix, never to a replica that lacks it.

Requests just routed leave short-lived hints (`PendingHints`): their blocks are on the way to
that replica (its events follow within milliseconds, but a burst of requests sharing a prefix
arrives before them), so the burst follows the first request instead of scattering.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from kvserve.cache.kv_events import DISK, HOST, POOL

DEFAULT_MAX_ENTRIES = 1_000_000
HINT_TTL_S = 10.0


class PrefixIndex:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES):
        if max_entries < 1:
            raise ValueError("the prefix index needs room for at least one entry")
        self.max_entries = max_entries
        self._order: OrderedDict[tuple[str, str, bytes], None] = OrderedDict()  # oldest first
        self._by_replica: dict[str, dict[str, set[bytes]]] = {}  # replica -> medium -> hashes

    def __len__(self) -> int:
        return len(self._order)

    def add(self, replica: str, block_hash: bytes, medium: str = POOL) -> None:
        key = (replica, medium, block_hash)
        if key in self._order:
            self._order.move_to_end(key)
            return
        self._order[key] = None
        self._by_replica.setdefault(replica, {}).setdefault(medium, set()).add(block_hash)
        while len(self._order) > self.max_entries:
            (old_replica, old_medium, old_hash), _ = self._order.popitem(last=False)
            self._by_replica[old_replica][old_medium].discard(old_hash)

    def remove(self, replica: str, block_hash: bytes, medium: str = POOL) -> None:
        key = (replica, medium, block_hash)
        if key in self._order:
            del self._order[key]
            self._by_replica[replica][medium].discard(block_hash)

    def clear(self, replica: str, medium: str | None = None) -> None:
        """Forget what `replica` holds in `medium` (every medium when None)."""
        media = self._by_replica.get(replica, {})
        for m in list(media) if medium is None else [medium]:
            for block_hash in media.pop(m, ()):
                del self._order[(replica, m, block_hash)]

    def replace(self, replica: str, hashes: Iterable[bytes], medium: str = POOL) -> None:
        self.clear(replica, medium)
        for block_hash in hashes:
            self.add(replica, block_hash, medium)

    def hashes(self, replica: str, medium: str = POOL) -> set[bytes]:
        return set(self._by_replica.get(replica, {}).get(medium, ()))

    def holds(self, replica: str, block_hash: bytes, medium: str = POOL) -> bool:
        return block_hash in self._by_replica.get(replica, {}).get(medium, ())


class PendingHints:
    """Blocks of requests just sent to a replica, remembered for `ttl_s` (bounded like the index)."""

    def __init__(self, max_entries: int = 65536, ttl_s: float = HINT_TTL_S):
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._hints: OrderedDict[tuple[str, bytes], float] = OrderedDict()

    def add(self, replica: str, hashes: Iterable[bytes]) -> None:
        until = time.monotonic() + self.ttl_s
        for block_hash in hashes:
            key = (replica, block_hash)
            self._hints.pop(key, None)
            self._hints[key] = until
        while len(self._hints) > self.max_entries:
            self._hints.popitem(last=False)

    def holds(self, replica: str, block_hash: bytes) -> bool:
        until = self._hints.get((replica, block_hash))
        return until is not None and until > time.monotonic()

    def clear(self, replica: str) -> None:
        for key in [k for k in self._hints if k[0] == replica]:
            del self._hints[key]


def matched_media(index: PrefixIndex, hints: PendingHints, replica: str, hashes: list[bytes]) -> list[str]:
    """Where `replica` holds (or is about to hold) the request's blocks, from the first, as the
    replica's own lookup finds them: the longest run in its pool (or just routed there), then the
    run continued through its offload tiers, host before disk (blocks found in the tiers are
    loaded into the pool; the pool is not consulted again after the first block it lacks)."""
    media: list[str] = []
    for block_hash in hashes:
        if (not media or media[-1] == POOL) and (index.holds(replica, block_hash)
                                                 or hints.holds(replica, block_hash)):
            media.append(POOL)
        elif index.holds(replica, block_hash, HOST):
            media.append(HOST)
        elif index.holds(replica, block_hash, DISK):
            media.append(DISK)
        else:
            break
    return media


def matched_blocks(index: PrefixIndex, hints: PendingHints, replica: str, hashes: list[bytes]) -> int:
    """How many of the request's blocks, from the first, `replica` holds (or is about to)."""
    return len(matched_media(index, hints, replica, hashes))
