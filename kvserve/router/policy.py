"""Routing policies: which up backend gets the next request.

    round_robin   in turn
    least_loaded  the least load (Backend.load: the requests this router has open on it, those
                  still waiting for their first bytes counted twice, plus its KV-cache pressure
                  near a full pool)
    kv_aware      the longest cached run of the request's prompt blocks, weighed against load:
                  score = cached prompt tokens x tier weight - load_cost_tokens x load; the best
                  score wins, ties go to the next in turn. A hot prefix thus stays on one replica
                  until that replica is (its cached tokens / load_cost_tokens) requests busier
                  than another, and then spreads (the balance SGLang's cache-aware router keeps
                  with thresholds). Where the cache gives no reason to prefer one (every backend
                  would reuse as much: all-distinct prompts, or a prefix on every replica; or
                  there are no prompt tokens to look up), it places in turn as round_robin does,
                  unless the backend in turn carries more than BALANCE_SLACK load beyond the
                  least loaded one.

Why in turn and not by load when nothing is cached: in a closed loop of equal requests, the ones
started together on a replica finish together, and placing their replacements by load sends most
of them back to that replica, to prefill in one step and wait for each other, while the other
replica only decodes; the cohort never breaks up. Taking turns splits each cohort between the
replicas, so fewer prefills share a step. On all-distinct prompts least_loaded, and kv_aware when
it placed by load, lost throughput to round_robin, and a small slack (two prefills) still diverted
enough requests to raise kv_aware's TTFT (BENCHMARKS.md, "Routing policies").
The slack only keeps a stalled replica from drawing its whole share, as SGLang's router turns to
the shortest queue only past an absolute imbalance.

Tier weights (TIER_WEIGHTS): a block in a replica's pool is reused as it is (1.0); one in its host
tier first costs a copy into the pool (0.9); one in its disk tier a file read and its checks,
slower and more variable with the device (0.75). Each is still far cheaper than computing the
block's tokens again (BENCHMARKS.md, "KV offload tiers"), so all stay near 1, ordered: with equal
load a pool hit beats a host hit beats a disk hit beats nothing, and a disk holder keeps a long
prefix until it is several requests busier than a replica holding nothing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvserve.cache.kv_events import DISK, HOST, POOL
from kvserve.router import DEFAULT_LOAD_COST_TOKENS, POLICIES
from kvserve.router.backends import Backend
from kvserve.router.index import PendingHints, PrefixIndex, matched_media
from kvserve.router.prompt_hashes import block_hashes

TIER_WEIGHTS = {POOL: 1.0, HOST: 0.9, DISK: 0.75}  # worth of a cached token, by where it is (above)
BALANCE_SLACK = 16.0  # Backend.load by which the one in turn may exceed the least loaded (a prefill counts 2)


@dataclass
class Choice:
    backend: Backend
    hashes: list[bytes]  # the prompt's block hashes under the backend's namespace ([] unknown)
    cached_tokens: int  # how many prompt tokens the router expects it to find cached (in any tier)


@dataclass
class Router:
    policy: str
    index: PrefixIndex
    hints: PendingHints
    load_cost_tokens: float = DEFAULT_LOAD_COST_TOKENS
    _turn: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r} (choose from {', '.join(POLICIES)})")

    def choose(self, backends: list[Backend], token_ids: list[int] | None, cache_salt: str | None) -> Choice | None:
        """The backend for a request among `backends` (the up ones); None if there is none."""
        if not backends:
            return None
        start = next(self._turn)
        rotated = [backends[(start + i) % len(backends)] for i in range(len(backends))]
        if self.policy == "round_robin":
            return Choice(rotated[0], [], 0)
        if self.policy == "least_loaded":
            return Choice(min(rotated, key=lambda b: b.load), [], 0)
        if not token_ids:  # no tokens to look up (the tokenizer still loading, an unreadable body)
            return Choice(_in_turn(rotated), [], 0)
        scored = []  # (backend, hashes, cached tokens, worth) in turn order
        hashes_by_ns: dict[tuple[str, int], list[bytes]] = {}
        for backend in rotated:
            hashes, cached, worth = [], 0, 0.0
            if backend.namespace is not None and backend.block_size:
                key = (backend.namespace, backend.block_size)
                if key not in hashes_by_ns:
                    hashes_by_ns[key] = block_hashes(token_ids, *key, cache_salt)
                hashes = hashes_by_ns[key]
                # The last prompt token is always recomputed: a prompt's last full block counts only
                # if a token follows it (as the engine caps its hits).
                usable = hashes[:(len(token_ids) - 1) // backend.block_size]
                media = matched_media(self.index, self.hints, backend.name, usable)
                cached = len(media) * backend.block_size
                worth = sum(TIER_WEIGHTS[m] for m in media) * backend.block_size
            scored.append((backend, hashes, cached, worth))
        if len({worth for *_, worth in scored}) == 1:  # the cache prefers none: in turn (docstring)
            backend = _in_turn(rotated)
            _, hashes, cached, _ = next(s for s in scored if s[0] is backend)
            return Choice(backend, hashes, cached)
        # Ties go to the next in turn. Not to the lowest reported KV usage: that report lags and
        # favours the replica whose batch just finished, so the replacements' prefills all went to it.
        best: float | None = None
        choice = None
        for backend, hashes, cached, worth in scored:
            score = worth - self.load_cost_tokens * backend.load
            if best is None or score > best:
                best, choice = score, Choice(backend, hashes, cached)
        return choice

    def routed(self, choice: Choice) -> None:
        """Remember that the chosen backend is about to hold the prompt's blocks."""
        if choice.hashes:
            self.hints.add(choice.backend.name, choice.hashes)


def _in_turn(rotated: list[Backend]) -> Backend:
    """The first backend in turn order whose load is within BALANCE_SLACK of the least loaded one."""
    least = min(backend.load for backend in rotated)
    return next(backend for backend in rotated if backend.load <= least + BALANCE_SLACK)
