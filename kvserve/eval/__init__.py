"""`kvserve eval`: the quality cost and memory gain of each KV-cache configuration
(perplexity / KL / top-1 agreement through the paged cache, passkey retrieval, bytes per token)."""
from kvserve.eval.passkey import PasskeyConfig, PasskeyResult
from kvserve.eval.perplexity import FidelityResult, ScoringConfig
from kvserve.eval.runner import DEFAULT_KV_CACHE_DTYPES, ConfigResult, EvalReport, evaluate

__all__ = ["ConfigResult", "DEFAULT_KV_CACHE_DTYPES", "EvalReport", "FidelityResult", "PasskeyConfig",
           "PasskeyResult", "ScoringConfig", "evaluate"]
