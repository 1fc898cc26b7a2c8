"""Prefix-cache events: which block hashes a pool holds, as an ordered, numbered log.

A router that knows which replica holds which cached blocks can send a request where its prefix
already is (the idea of vLLM's KV events, `BlockStored` / `BlockRemoved` / `AllBlocksCleared`,
consumed by llm-d's KV-cache-aware scheduler). The block pool records here, on the engine thread:

    stored   a full block became findable by its chained hash (with its parent's hash and tokens)
    removed  a cached block's hash was dropped (evicted for new data, or unpublished)
    cleared  every hash was dropped (reset_prefix_cache)

Each event gets the next sequence number. The log keeps the last `capacity` events (a ring) and
the set of hashes published now, both under one lock, so a reader that fell behind further than
the ring reaches takes a snapshot (the set and the number of the last event in it) and goes on
from there: replaying events after the snapshot's number over the set gives the pool's state.

Nothing here is attached unless a server asks (`BlockPool.events` stays None offline), so an
engine nobody listens to pays one attribute test per published or evicted block.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

DEFAULT_CAPACITY = 65536

STORED = "BlockStored"
REMOVED = "BlockRemoved"
CLEARED = "AllBlocksCleared"


@dataclass(frozen=True, slots=True)
class KVEvent:
    seq: int
    kind: str  # STORED, REMOVED or CLEARED
    block_hash: bytes | None = None  # None for CLEARED
    parent_hash: bytes | None = None  # STORED: the previous block's hash (None: the first block)
    token_ids: tuple[int, ...] = ()  # STORED: the block's tokens

    def to_json(self) -> dict:
        """The public wire form (README "KV-cache events"): hashes as lowercase hex."""
        body: dict = {"seq": self.seq, "type": self.kind}
        if self.kind == STORED:
            body["block_hash"] = self.block_hash.hex()
            body["parent_hash"] = self.parent_hash.hex() if self.parent_hash is not None else None
            body["token_ids"] = list(self.token_ids)
        elif self.kind == REMOVED:
            body["block_hash"] = self.block_hash.hex()
        return body


@dataclass(frozen=True)
class KVSnapshot:
    seq: int  # the number of the last event reflected in `block_hashes` (0: none yet)
    block_hashes: frozenset[bytes]


@dataclass
class KVEventLog:
    capacity: int = DEFAULT_CAPACITY
    _events: deque = field(default_factory=deque, repr=False)
    _published: set = field(default_factory=set, repr=False)
    _seq: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError("the KV event log needs room for at least one event")
        self._events = deque(maxlen=self.capacity)

    # ------------------------------------------------------------------ written by the pool
    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...] = ()) -> None:
        with self._lock:
            self._published.add(block_hash)
            self._append(STORED, block_hash, parent_hash, token_ids)

    def removed(self, block_hash: bytes) -> None:
        with self._lock:
            self._published.discard(block_hash)
            self._append(REMOVED, block_hash)

    def cleared(self) -> None:
        with self._lock:
            self._published.clear()
            self._append(CLEARED)

    def _append(self, kind: str, block_hash: bytes | None = None, parent_hash: bytes | None = None,
                token_ids: tuple[int, ...] = ()) -> None:
        self._seq += 1
        self._events.append(KVEvent(self._seq, kind, block_hash, parent_hash, token_ids))

    # ------------------------------------------------------------------ read from any thread
    @property
    def seq(self) -> int:
        return self._seq

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(self._seq, frozenset(self._published))

    def since(self, seq: int, limit: int | None = None) -> list[KVEvent] | None:
        """Events numbered after `seq`, oldest first (at most `limit`); None if some of them have
        already left the ring (the reader must resynchronise from a snapshot)."""
        with self._lock:
            if seq > self._seq:
                return None  # numbered by another log (the replica restarted): resynchronise
            if seq == self._seq:
                return []
            first = self._events[0].seq if self._events else self._seq + 1
            if seq + 1 < first:
                return None
            start = seq + 1 - first
            stop = len(self._events) if limit is None else min(len(self._events), start + limit)
            return [self._events[i] for i in range(start, stop)]
