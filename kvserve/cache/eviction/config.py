"""What a request asks of KV eviction, and the resolved settings the engine runs it with.

`EvictionSpec` is the user's (possibly partial) request: the `kv_eviction` field of an HTTP
request or of `SamplingParams`, or the engine flags `--kv-eviction`, `--kv-budget`,
`--sink-tokens`, `--recent-tokens`. `resolve_eviction` lays a request's spec over the engine's
and checks it against the model, giving an `EvictionConfig` (or None: no eviction).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

NO_EVICTION = "none"
DEFAULT_SINK_TOKENS = 4  # StreamingLLM keeps 4 initial tokens (Xiao et al. 2023, section 3.2)


@dataclass(frozen=True)
class EvictionSpec:
    """Eviction settings as given; None = not given (falls back to the engine's setting)."""

    policy: str | None = None
    budget: int | None = None
    sink_tokens: int | None = None
    recent_tokens: int | None = None

    @classmethod
    def parse(cls, value: Any) -> "EvictionSpec | None":
        """A spec from a dict with these keys, a policy name, or a spec; ValueError naming the bad key."""
        if value is None or isinstance(value, EvictionSpec):
            return value
        if isinstance(value, str):
            value = {"policy": value}
        if not isinstance(value, dict):
            raise ValueError(f"kv_eviction must be an object with keys policy, budget, sink_tokens, "
                             f"recent_tokens, got {value!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"kv_eviction has unknown key(s) {', '.join(map(repr, unknown))}: "
                             f"use {', '.join(sorted(names))}")
        policy = value.get("policy")
        if policy is not None and not isinstance(policy, str):
            raise ValueError(f"kv_eviction.policy must be a string, got {policy!r}")
        for name in ("budget", "sink_tokens", "recent_tokens"):
            number = value.get(name)
            if number is not None and (not isinstance(number, int) or isinstance(number, bool)):
                raise ValueError(f"kv_eviction.{name} must be an integer, got {number!r}")
        return cls(**value)

    def over(self, base: "EvictionSpec") -> "EvictionSpec":
        """This spec's given values, `base`'s for the rest."""
        return EvictionSpec(**{f.name: getattr(self, f.name) if getattr(self, f.name) is not None
                               else getattr(base, f.name) for f in fields(self)})


@dataclass(frozen=True)
class EvictionConfig:
    """Resolved settings of one evicting sequence (all token counts).

    The sequence keeps `sink_tokens` first tokens, the `recent_tokens` newest and, for policies
    with a scored share, the best-scoring `budget - sink_tokens - recent_tokens` of the rest.
    """

    policy: str
    budget: int
    sink_tokens: int
    recent_tokens: int

    @property
    def max_chunk(self) -> int:
        """Most tokens one step may add: the sinks must still fit in the budget beside them."""
        return self.budget - self.sink_tokens


def resolve_eviction(request: EvictionSpec | None, engine: EvictionSpec, max_model_len: int,
                     policies: Mapping[str, Any]) -> EvictionConfig | None:
    """The request's spec over the engine's, checked; None when the policy is "none".

    `policies` maps names to policy classes (policy.EvictionPolicy). One without a scored share
    (`scored_share` False: streaming) keeps sinks and a recent window of budget - sinks. One with
    a scored share defaults its recent window to its `default_recent(budget - sinks)` (H2O: half,
    its even split between heavy hitters and recent tokens)."""
    spec = request.over(engine) if request is not None else engine
    name = spec.policy or NO_EVICTION
    if name != NO_EVICTION and name not in policies:
        raise ValueError(f"unknown KV eviction policy {name!r}: choose one of "
                         f"{', '.join((NO_EVICTION, *policies))}")
    if name == NO_EVICTION:
        given = [f"kv_eviction.{n}" for n in ("budget", "sink_tokens", "recent_tokens")
                 if request is not None and getattr(request, n) is not None]
        if given:  # settings of a policy the request does not run: refused, not ignored
            raise ValueError(f"{', '.join(given)} only apply(s) under a KV eviction policy, and this request has "
                             f"none: name one in kv_eviction.policy ({', '.join(policies)}), or start with --kv-eviction")
        return None
    if spec.budget is None:
        raise ValueError(f"KV eviction policy {name!r} needs a budget (--kv-budget or kv_eviction.budget)")
    sinks = DEFAULT_SINK_TOKENS if spec.sink_tokens is None else spec.sink_tokens
    if sinks < 0:
        raise ValueError(f"sink_tokens must be at least 0, got {sinks}")
    if not sinks < spec.budget <= max_model_len:
        raise ValueError(f"the KV budget must be more than sink_tokens ({sinks}) and at most max-model-len "
                         f"({max_model_len}), got {spec.budget}")
    room = spec.budget - sinks
    default_recent = policies[name].default_recent(room)
    if not policies[name].scored_share:
        recent = default_recent if spec.recent_tokens is None else spec.recent_tokens
        if recent != room:
            raise ValueError(f"{name} keeps sink_tokens + recent_tokens = budget: recent_tokens is {room} "
                             f"here, got {recent} (change the budget instead)")
    else:
        recent = default_recent if spec.recent_tokens is None else spec.recent_tokens
        if not 0 <= recent <= room:
            raise ValueError(f"recent_tokens must be in [0, budget - sink_tokens] = [0, {room}], got {recent}")
    return EvictionConfig(name, spec.budget, sinks, recent)
