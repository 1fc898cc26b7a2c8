"""Key centring: a quantized cache stores every key minus a constant vector per (layer, KV head).

Softmax is invariant to adding the same number to every score of a query, and q·(k - c) =
q·k - q·c differs from q·k by exactly such a number. So any constant c subtracted from all
cached keys of a head leaves attention unchanged, while the values the quantizer sees shrink:
some key channels carry a large offset shared by every token (RoPE's slow pairs barely rotate),
and a per-token int4 group otherwise spends most of its 16 levels on that offset. c is the mean
key a calibration pass over random tokens gives at start-up, the same for every request, so
blocks stay shareable (prefix caching). RoPE turns a fixed offset a different way at every
position (slowly for its low-frequency pairs), so the centre is the pre-RoPE mean rotated by
RoPE averaged over positions 0..4,095: the offset that survives at the positions a cache holds.
KVQuant (Hooper et al. 2024, arXiv:2401.18079) and KIVI quantize keys per channel for the same
reason; centring keeps int4's per-token layout.

Which centre (and which RoPE averaging) was measured with `kvserve eval` (BENCHMARKS.md,
"KV-cache dtypes"); fp8 and int8 gained nothing from it, so only formats with `center_keys` use it.

Keys stored before RoPE (requests under KV eviction, rotated when gathered) are not centred:
rotating k - c by another position would not subtract the same c from every key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvserve.engine.calibration import cached_calibration, calibration_tokens, record_projections
from kvserve.engine.model_runner import ModelRunner
from kvserve.model.rope import apply_rotary

CENTER_POSITIONS = 4096  # the mean key is averaged over RoPE at positions [0, this) (see the docstring)


def calibrate_key_centers(runner: ModelRunner, max_tokens: int, model_file: Path | None = None) -> list[torch.Tensor]:
    """Each layer's key centre [kv_heads, head_dim]: the mean pre-RoPE key over the calibration
    prefill of random tokens (calibration.py, run with centring off), rotated by RoPE averaged
    over positions [0, CENTER_POSITIONS). Kept in the disk cache per `model_file` and options."""
    model, kv_cache = runner.model, runner.kv_cache
    config = model.config
    model.set_key_centers(None)

    def compute() -> dict[str, Any]:
        keys = slice(config.num_heads, config.num_heads + config.num_kv_heads)
        means = [qkv[:, keys].float().mean(dim=0) for qkv in record_projections(runner, max_tokens)]
        # RoPE is linear in (cos, sin), so rotating by their mean is the mean of the rotated keys.
        cos, signed_sin = (table[:CENTER_POSITIONS].float().mean(dim=0)
                           for table in (model.rope.cos, model.rope.signed_sin))
        return {"centers": [apply_rotary(mean[None], cos, signed_sin)[0] for mean in means]}

    def valid(result: dict[str, Any]) -> bool:
        centers = result.get("centers")
        shape = (config.num_kv_heads, config.head_dim)
        return (isinstance(centers, list) and len(centers) == config.num_layers
                and all(isinstance(c, torch.Tensor) and c.shape == shape and c.isfinite().all() for c in centers))

    # The RoPE table is max-model-len long: a shorter one averages over fewer positions.
    parameters = {"tokens": calibration_tokens(kv_cache, max_tokens),
                  "center_positions": min(CENTER_POSITIONS, model.rope.cos.shape[0])}
    return cached_calibration("key-centers", model, kv_cache, model_file, parameters, compute, valid)["centers"]
