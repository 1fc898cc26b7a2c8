"""The replica's prefix-cache events over HTTP, for KV-cache-aware routers (README "KV-cache events").

    GET /v1/kv_events/snapshot   {"replica": {...}, "seq": S, "block_hashes": [hex, ...],
                                  "tier_block_hashes": {"host": [hex, ...], "disk": [...]}}
    GET /v1/kv_events?since=S    SSE: a "Hello" message (the replica), then a "Snapshot" when the
                                 events after S are no longer kept (or S is absent or from
                                 another instance), then "Events" batches in order, and "Load"
                                 messages when the replica's load changes
    GET /v1/load                 {"instance_id", "running", "waiting", "kv_cache_usage"}

Every message and answer names the replica: its `instance_id` (new on every start, so a router
sees a restart and drops what it knew) and the hash namespace (`namespace`, `block_size`): a
router computes a prompt's block hashes with kv_cache_manager.root_hash(namespace, cache_salt)
and prompt_block_hashes, exactly as this replica does. With KV offload tiers, events and snapshots
also cover the host and disk tiers (each event's `medium`: "pool", "host" or "disk"). All of it needs the API key, like every
data route. The stream is polled from the event log (the engine thread never waits on a reader)
and ends when the server begins to shut down, so a router's connection never holds a shutdown.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass

from fastapi import FastAPI, Query
from fastapi.responses import StreamingResponse

from kvserve.cache.kv_events import POOL, KVEventLog
from kvserve.server.engine_loop import AsyncEngine

POLL_S = 0.02  # how often an open stream looks for new events
KEEPALIVE_S = 2.0  # a comment line this often on a quiet stream, so a reader notices a dead replica
MAX_BATCH = 4096  # events per SSE message
LOAD_EVERY_S = 0.1  # at most this often a "Load" message, when the load changed


@dataclass(frozen=True)
class ReplicaInfo:
    """Who publishes the events and how its hashes are made."""

    instance_id: str
    model: str  # the model's file or directory name
    namespace: str  # root of the hash chain (the KV storage format)
    block_size: int
    prefix_caching: bool
    tiers: tuple[str, ...] = ()  # the offload tiers whose blocks are published too ("host", "disk")


def attach_kv_events(async_engine: AsyncEngine, capacity: int) -> tuple[KVEventLog, ReplicaInfo]:
    """Start recording the engine's prefix-cache events (before its thread starts)."""
    engine = async_engine.engine
    log = KVEventLog(capacity)
    engine.kv_manager.attach_events(log)
    info = ReplicaInfo(uuid.uuid4().hex, engine.model_path.name, engine.kv_manager.namespace,
                       engine.kv_manager.block_size, engine.kv_manager.enable_prefix_caching,
                       tuple(m for m in log.media if m != POOL))
    return log, info


def _sse(body: dict) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


def add_kv_event_routes(app: FastAPI, async_engine: AsyncEngine, log: KVEventLog, info: ReplicaInfo,
                        stopping: Callable[[], bool]) -> None:
    replica = asdict(info)

    def snapshot_body() -> dict:
        snap = log.snapshot()
        return {"type": "Snapshot", "replica": replica, "seq": snap.seq,
                "block_hashes": sorted(h.hex() for h in snap.block_hashes),
                "tier_block_hashes": {m: sorted(h.hex() for h in hashes)
                                      for m, hashes in snap.by_medium.items() if m != POOL}}

    @app.get("/v1/kv_events/snapshot")
    async def kv_events_snapshot() -> dict:
        return snapshot_body()

    def load_body() -> dict:
        snap = async_engine.snapshot
        return {"instance_id": info.instance_id, "running": snap.num_running, "waiting": snap.num_waiting,
                "kv_cache_usage": round(snap.kv_usage, 4)}

    @app.get("/v1/load")
    async def load() -> dict:
        return load_body()

    @app.get("/v1/kv_events")
    async def kv_events(since: int | None = Query(default=None, ge=0),
                        instance_id: str | None = Query(default=None)) -> StreamingResponse:
        # A position from another instance (this replica restarted) means nothing here.
        start = since if instance_id in (None, info.instance_id) else None
        return StreamingResponse(_stream(start), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _stream(since: int | None) -> AsyncIterator[bytes]:
        draining = _sse({"type": "Draining", "instance_id": info.instance_id})
        if stopping():  # a router reconnecting while this server shuts down: no Hello, no new requests
            yield draining
            return
        yield _sse({"type": "Hello", "replica": replica, "seq": log.seq})
        seq = since
        quiet, since_load = 0.0, LOAD_EVERY_S
        last_load = None
        while not stopping():
            load = load_body()
            if load != last_load and since_load >= LOAD_EVERY_S:
                yield _sse({"type": "Load", **load})
                last_load, since_load, quiet = load, 0.0, 0.0
            events = log.since(seq, MAX_BATCH) if seq is not None else None
            if events is None:
                body = snapshot_body()
                seq = body["seq"]
                yield _sse(body)
                quiet = 0.0
            elif events:
                seq = events[-1].seq
                yield _sse({"type": "Events", "events": [e.to_json() for e in events]})
                quiet = 0.0
            else:
                await asyncio.sleep(POLL_S)
                quiet += POLL_S
                since_load += POLL_S
                if quiet >= KEEPALIVE_S:
                    yield b": keepalive\n\n"
                    quiet = 0.0
        yield draining  # shutting down: a router sends no new requests, and lets those in flight finish
