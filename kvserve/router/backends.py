"""The replicas behind a router: their health, load and prefix-cache events.

Each backend has one watcher task that follows its event stream (GET /v1/kv_events): block
events into the shared PrefixIndex, Load messages into the backend's running/waiting/KV usage.
A backend is up from its stream's Hello message until the stream breaks or stays silent for
`STREAM_READ_TIMEOUT_S` (the replica sends a keepalive every 2 s: a hung replica); then it is
taken out (`down` is set, which ends the requests in flight on it at once) and reconnected with
exponential backoff. A Hello with another
instance id than before (the replica restarted) drops everything the index held for it; the
stream then starts with a snapshot. A backend that is not kvserve (no event routes) is still
used, by load alone, its health read from /health. A request that cannot connect to a backend
takes it out too (`take_out`), and its stream is followed afresh: the replica is back with the
new stream's Hello (a stream that outlived the failure would never say Hello again).

A replica shutting down says Draining before its stream ends: it gets no new requests, but `down`
stays clear, so that the requests in flight on it finish there (a rolling restart loses none);
they end on their own when it closes their connections. It is back at a Hello.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

import httpx

from kvserve.cache.kv_events import MEDIA, POOL
from kvserve.router.index import PendingHints, PrefixIndex

logger = logging.getLogger("kvserve.router")

INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
HEALTH_POLL_S = 1.0  # backends without event routes
CONNECT_TIMEOUT_S = 3.0
KV_PRESSURE_FROM = 0.8  # KV usage above which a replica counts as busier
STREAM_READ_TIMEOUT_S = 10.0  # the replica sends a keepalive every 2 s
PREFILL_WEIGHT = 1.0  # extra load of a request still waiting for its first answer byte (Backend.load)


@dataclass(eq=False)
class Backend:
    name: str  # the label in /metrics and /router/state
    url: str
    up: bool = False
    instance_id: str | None = None
    namespace: str | None = None  # hash namespace root the replica publishes (None: no events)
    block_size: int | None = None
    seq: int | None = None  # last event applied
    in_flight: int = 0  # requests this router has open on it
    prefilling: int = 0  # of which no answer byte has come back yet (their prompts still being computed)
    running: int = 0  # as the replica last reported
    waiting: int = 0
    kv_usage: float = 0.0
    routed: int = 0
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set while out of service
    draining: bool = False  # shutting down (its Draining message): no new requests, those in flight go on

    def __post_init__(self) -> None:
        self.down.set()

    @property
    def load(self) -> float:
        """The requests this router has open on it (exact and without delay: the replica's own
        running/waiting report lags its finishes by up to a Load interval), those still waiting for
        their first answer byte counted twice, plus up to one more as its reported KV usage climbs
        from KV_PRESSURE_FROM to full: a pool about to preempt is busier than its request count
        says (and the usage reflects other clients' work).

        Why prefills count twice: a prompt still being computed costs its replica far more per step
        than a request that is decoding, and it delays every prompt sent after it. Counting requests
        alone, the replacements for a batch that finished together on one replica (a closed loop of
        equal requests does this every time) all went back to that replica, whose load had just
        dropped, and queued behind each other's prefills while the other replica only decoded."""
        return (self.in_flight + PREFILL_WEIGHT * self.prefilling
                + max(0.0, self.kv_usage - KV_PRESSURE_FROM) / (1.0 - KV_PRESSURE_FROM))

    def open(self) -> Ticket:
        """Count one of this router's requests as sent to it, until the ticket is closed."""
        self.in_flight += 1
        self.prefilling += 1
        return Ticket(self)


@dataclass(eq=False)
class Ticket:
    """One request on a backend: counted as prefilling until its first answer bytes, as in flight
    until it ends. Both calls may repeat; only the first counts."""

    backend: Backend
    answered: bool = False
    closed: bool = False

    def answer(self) -> None:
        if not self.answered:
            self.answered = True
            self.backend.prefilling -= 1

    def close(self) -> None:
        if not self.closed:
            self.answer()
            self.closed = True
            self.backend.in_flight -= 1


class BackendWatcher:
    def __init__(self, backend: Backend, client: httpx.AsyncClient, index: PrefixIndex, hints: PendingHints,
                 headers: dict[str, str]):
        self.backend, self.client, self.index, self.hints, self.headers = backend, client, index, hints, headers
        self._tasks: list[asyncio.Task] = []
        self._logged_reason: str | None = None  # why a backend not up yet is not: logged once per reason

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow())]

    def take_out(self, reason: str) -> None:
        """Out of service on a failure seen elsewhere (a request could not connect): mark it down
        and follow its events afresh, so that it is back as soon as a new stream says Hello."""
        self.mark_down(reason)
        for task in self._tasks:
            task.cancel()
        running = [task for task in self._tasks if not task.done()]  # ending: stop() still waits for them
        self.start()
        self._tasks += running

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ up / down
    def _mark_up(self) -> None:
        b = self.backend
        if not b.up:
            logger.info("backend %s (%s) is up", b.name, b.url)
        b.up = True
        b.down.clear()
        b.draining = False
        self._logged_reason = None

    def mark_down(self, reason: str) -> None:
        b = self.backend
        if b.up:
            logger.warning("backend %s (%s) taken out: %s", b.name, b.url, reason)
        elif reason != self._logged_reason:  # never up, or down for a new reason: say why, once
            logger.warning("backend %s (%s) is not in service: %s", b.name, b.url, reason)
        self._logged_reason = reason
        b.up = False
        b.down.set()  # requests in flight on it end now
        b.draining = False
        self.hints.clear(b.name)

    def _drain(self) -> None:
        """The replica is shutting down: no new requests; those in flight finish there."""
        b = self.backend
        if b.up:
            logger.info("backend %s (%s) is shutting down: no new requests; those in flight finish there",
                        b.name, b.url)
        b.up = False
        b.draining = True
        self.hints.clear(b.name)

    # ------------------------------------------------------------------ events
    async def _follow(self) -> None:
        delay = INITIAL_BACKOFF_S
        while True:
            try:
                connected = await self._stream_once()
                reason = "its event stream ended"
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                connected, reason = False, f"{type(exc).__name__}: {exc}"
            if not self.backend.draining:  # (a draining one is gone soon: its requests end with it)
                self.mark_down(reason)
            delay = INITIAL_BACKOFF_S if connected else min(delay * 2, MAX_BACKOFF_S)
            await asyncio.sleep(delay)

    async def _stream_once(self) -> bool:
        """Follow the event stream until it ends; True if it got as far as its Hello."""
        b = self.backend
        params = {} if b.seq is None else {"since": b.seq, "instance_id": b.instance_id}
        timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=STREAM_READ_TIMEOUT_S)
        async with self.client.stream("GET", f"{b.url}/v1/kv_events", params=params, headers=self.headers,
                                      timeout=timeout) as response:
            if response.status_code in (404, 405):  # not a kvserve replica: load-only routing
                await self._health_only()
                return True
            if response.status_code != 200:
                raise ValueError(f"GET /v1/kv_events answered {response.status_code}")
            hello = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                message = json.loads(line[5:])
                kind = message["type"]
                if kind == "Hello":
                    self._hello(message["replica"])
                    hello = True
                elif kind == "Snapshot":
                    self._snapshot(message)
                elif kind == "Events":
                    self._apply(message["events"])
                elif kind == "Load":
                    b.running, b.waiting, b.kv_usage = message["running"], message["waiting"], message["kv_cache_usage"]
                elif kind == "Draining":
                    self._drain()
            return hello

    def _hello(self, replica: dict) -> None:
        b = self.backend
        if replica["instance_id"] != b.instance_id:
            if b.instance_id is not None:
                logger.info("backend %s restarted (instance %s): dropping its index entries", b.name,
                            replica["instance_id"])
            self.index.clear(b.name)
            b.seq = None
        b.instance_id = replica["instance_id"]
        b.namespace = replica["namespace"] if replica.get("prefix_caching", True) else None
        b.block_size = replica["block_size"]
        self._mark_up()

    def _snapshot(self, message: dict) -> None:
        """The replica's whole state: its pool's hashes and each tier's (a tier not listed holds none)."""
        b = self.backend
        self.index.clear(b.name)
        self.index.replace(b.name, (bytes.fromhex(h) for h in message["block_hashes"]))
        for medium, hashes in message.get("tier_block_hashes", {}).items():
            if medium in MEDIA:
                self.index.replace(b.name, (bytes.fromhex(h) for h in hashes), medium)
        b.seq = message["seq"]

    def _apply(self, events: list[dict]) -> None:
        b = self.backend
        for event in events:
            kind, medium = event["type"], event.get("medium", POOL)
            if medium not in MEDIA:
                pass  # a medium this router does not know: not a place it can route to
            elif kind == "BlockStored":
                self.index.add(b.name, bytes.fromhex(event["block_hash"]), medium)
            elif kind == "BlockRemoved":
                self.index.remove(b.name, bytes.fromhex(event["block_hash"]), medium)
            elif kind == "AllBlocksCleared":
                self.index.clear(b.name, medium)
            b.seq = event["seq"]

    async def _health_only(self) -> None:
        b = self.backend
        b.namespace = None
        while True:
            response = await self.client.get(f"{b.url}/health", timeout=CONNECT_TIMEOUT_S)
            if response.status_code != 200:
                return
            self._mark_up()
            await asyncio.sleep(HEALTH_POLL_S)
