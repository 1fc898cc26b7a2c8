"""KV-cache eviction: sequences that keep a bounded number of tokens in the paged pool and run
past the model's context. One module per policy under `policies/` (StreamingLLM, H2O, SnapKV,
TOVA, ...), found at import; `POLICIES` lists them by name."""
from kvserve.cache.eviction.config import NO_EVICTION, EvictionConfig, EvictionSpec
from kvserve.cache.eviction.policies import POLICIES
from kvserve.cache.eviction.policy import EvictionPolicy, ObservedRows

POLICY_CHOICES = (NO_EVICTION, *POLICIES)

__all__ = ["EvictionConfig", "EvictionPolicy", "EvictionSpec", "NO_EVICTION", "ObservedRows", "POLICIES",
           "POLICY_CHOICES"]
