"""KV-cache eviction: sequences that keep a bounded number of tokens in the paged pool and run
past the model's context (StreamingLLM sinks + window; H2O heavy hitters). One module per
policy; `POLICIES` lists them by name."""
from kvserve.cache.eviction.config import NO_EVICTION, EvictionConfig, EvictionSpec
from kvserve.cache.eviction.h2o import H2OPolicy
from kvserve.cache.eviction.policy import EvictionPolicy
from kvserve.cache.eviction.streaming import StreamingPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (StreamingPolicy, H2OPolicy)}
POLICY_CHOICES = (NO_EVICTION, *POLICIES)

__all__ = ["EvictionConfig", "EvictionPolicy", "EvictionSpec", "NO_EVICTION", "POLICIES", "POLICY_CHOICES"]
