"""KV tiers below the block pool: host memory and disk (vLLM's KV offloading, LMCache's local_cpu and
local_disk, SGLang's HiCache). A published block the pool is about to reclaim goes down; a prefix
lookup that runs out of pool hits continues here and loads what it finds into fresh pool blocks.
Blocks are found by their chained prefix-cache hash, whose root holds the model's identity."""
from kvserve.cache.tiers.block_store import BlockStore
from kvserve.cache.tiers.disk import DiskTier
from kvserve.cache.tiers.host import HostTier
from kvserve.cache.tiers.tiered_store import TierConfig, TieredStore

__all__ = ["BlockStore", "DiskTier", "HostTier", "TierConfig", "TieredStore"]
