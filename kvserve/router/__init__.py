"""KV-cache-aware routing over kvserve replicas (`kvserve router`, `kvserve serve --data-parallel-size`)."""

POLICIES = ("kv_aware", "round_robin", "least_loaded")
DEFAULT_LOAD_COST_TOKENS = 64
