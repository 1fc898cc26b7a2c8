"""Prefix-cache events: which block hashes a pool holds, as an ordered, numbered log.

A router that knows which replica holds which cached blocks can send a request where its prefix
already is (the idea of vLLM's KV events, `BlockStored` / `BlockRemoved` / `AllBlocksCleared`,
consumed by llm-d's KV-cache-aware scheduler). The block pool records here, on the engine thread:

    stored   a full block became findable by its chained hash (with its parent's hash and tokens)
    removed  a cached block's hash was dropped (evicted for new data, or unpublished)
    cleared  every hash was dropped (reset_prefix_cache)

Every event names its medium, as vLLM's events do (`medium`, "GPU" / "CPU"): "pool" (the KV pool
the model reads), "host" or "disk" (the offload tiers, kvserve/cache/tiers). A block reclaimed
from the pool and copied down is a `removed` from the pool followed by a `stored` in the host tier
(or the disk tier); a host-tier overflow written to disk is a `removed` from host and a `stored`
on disk. A medium's events only change that medium's set: a block may be in several at once.
Recording is idempotent (storing a hash a medium already holds, or removing one it lacks, adds no
event), so a tier can report what it finds without keeping its own books.

Each event gets the next sequence number, one sequence for all media. The log keeps the last `capacity` events (a ring) and
the set of hashes published now per medium, all under one lock, so a reader that fell behind
further than the ring reaches takes a snapshot (the sets and the number of the last event in them)
and goes on from there: replaying events after the snapshot's number over the sets gives the state.

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

POOL, HOST, DISK = "pool", "host", "disk"
MEDIA = (POOL, HOST, DISK)  # nearest to the model first


@dataclass(frozen=True, slots=True)
class KVEvent:
    seq: int
    kind: str  # STORED, REMOVED or CLEARED
    block_hash: bytes | None = None  # None for CLEARED
    parent_hash: bytes | None = None  # STORED in the pool: the previous block's hash (None: the first block)
    token_ids: tuple[int, ...] = ()  # STORED in the pool: the block's tokens
    medium: str = POOL

    def to_json(self) -> dict:
        """The public wire form (README "KV-cache events"): hashes as lowercase hex."""
        body: dict = {"seq": self.seq, "type": self.kind, "medium": self.medium}
        if self.kind == STORED:
            body["block_hash"] = self.block_hash.hex()
            body["parent_hash"] = self.parent_hash.hex() if self.parent_hash is not None else None
            body["token_ids"] = list(self.token_ids)
        elif self.kind == REMOVED:
            body["block_hash"] = self.block_hash.hex()
        return body


@dataclass(frozen=True)
class KVSnapshot:
    seq: int  # the number of the last event reflected in the sets (0: none yet)
    by_medium: dict[str, frozenset[bytes]]  # every medium recorded here, the pool always

    @property
    def block_hashes(self) -> frozenset[bytes]:
        """The pool's."""
        return self.by_medium[POOL]


@dataclass
class KVEventLog:
    capacity: int = DEFAULT_CAPACITY
    _events: deque = field(default_factory=deque, repr=False)
    _published: dict = field(default_factory=dict, repr=False)  # medium -> set of hashes
    _seq: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError("the KV event log needs room for at least one event")
        self._events = deque(maxlen=self.capacity)
        self._published = {POOL: set()}

    def add_medium(self, medium: str) -> None:
        """Announce a tier (its set appears in snapshots, empty until it stores a block)."""
        if medium not in MEDIA:
            raise ValueError(f"unknown KV medium {medium!r}")
        with self._lock:
            self._published.setdefault(medium, set())

    @property
    def media(self) -> tuple[str, ...]:
        return tuple(m for m in MEDIA if m in self._published)

    # ------------------------------------------------------------------ written by the pool and the tiers
    def stored(self, block_hash: bytes, parent_hash: bytes | None = None, token_ids: tuple[int, ...] = (),
               medium: str = POOL) -> None:
        with self._lock:
            held = self._published.setdefault(medium, set())
            if block_hash not in held:
                held.add(block_hash)
                self._append(STORED, block_hash, parent_hash, token_ids, medium)

    def removed(self, block_hash: bytes, medium: str = POOL) -> None:
        with self._lock:
            held = self._published.get(medium)
            if held is not None and block_hash in held:
                held.discard(block_hash)
                self._append(REMOVED, block_hash, medium=medium)

    def cleared(self, medium: str = POOL) -> None:
        with self._lock:
            self._published.setdefault(medium, set()).clear()
            self._append(CLEARED, medium=medium)

    def _append(self, kind: str, block_hash: bytes | None = None, parent_hash: bytes | None = None,
                token_ids: tuple[int, ...] = (), medium: str = POOL) -> None:
        self._seq += 1
        self._events.append(KVEvent(self._seq, kind, block_hash, parent_hash, token_ids, medium))

    # ------------------------------------------------------------------ read from any thread
    @property
    def seq(self) -> int:
        return self._seq

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(self._seq, {m: frozenset(h) for m, h in self._published.items()})
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
