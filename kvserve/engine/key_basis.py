"""A calibrated key basis for the fp8 (e4m3) cache: keys stored as k·T, queries turned by T^-T.

Attention only needs q·k, and q·k = (q T^-T)·(k T) for any invertible T [head_dim, head_dim], so
each (layer, KV head) may cache its keys in a basis of its own. The basis decides how much an
fp8 cache's rounding disturbs the scores. fp8 is a floating-point format: each stored channel is
off by a relative error δ_i of about the same size at any magnitude. The score error of a query
is then Σ_i q'_i k'_i δ_i (q' = q T^-T, k' = k T), with variance proportional to

    Σ_i E[q'_i²] E[k'_i²] = Σ_i (T^-1 A T^-T)_ii (T^T B T)_ii,   A = E[q qᵀ], B = E[k kᵀ]

(A summed over the query heads that share the KV head). The per-token scales and a per-channel
scale cancel out of it (so QServe's SmoothAttention balancing buys fp8 nothing), but the basis
does not. A Hadamard rotation (rotation.py) flattens both diagonals, which is what fp8 used to
store its keys in (e5m2 still does, fp8.py says why); T is fitted at start-up to make the sum
smaller still, by gradient descent from that rotation on the moments of one prefill of random
tokens (calibration.py). Integer formats (int8, int4) round to an absolute step instead, an
error this model does not describe.

Almost all of fp8's error comes from the keys, and a general T beat both the Hadamard basis and
an orthogonal T on this model (BENCHMARKS.md, "fp8_e4m3's fitted key basis").

Rows of requests under KV eviction store their keys before RoPE, which does not commute with T;
those rows keep the plain basis (the model restores their queries), like key centring.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvserve.engine.calibration import cached_calibration, calibration_tokens, record_projections
from kvserve.cache.formats.rotation import hadamard_rotation
from kvserve.engine.model_runner import ModelRunner
from kvserve.model.rope import apply_rotary
from kvserve.torch_threads import one_thread

CALIBRATION_TOKENS = 2048  # random tokens (fewer if max-model-len or the pool is smaller)
FIT_STEPS = 150  # Adam steps from the Hadamard rotation: the modelled error is within 0.1% of 300 steps'
_LEARNING_RATE = 0.01
# Below this many calibration tokens per channel the moments are too thin to fit to (nearly
# rank-deficient, so the fit could pick an ill-conditioned T); the Hadamard rotation is kept.
MIN_TOKENS_PER_DIM = 4


def modelled_score_error(transform: torch.Tensor, query_moment: torch.Tensor,
                         key_moment: torch.Tensor) -> torch.Tensor:
    """Σ_i (T^-1 A T^-T)_ii (T^T B T)_ii over [..., d, d] batches: the variance of a score's error,
    up to a constant, when keys are cached as k·T in a format with relative rounding error."""
    inverse = torch.linalg.inv(transform)
    query_side = torch.diagonal(inverse @ query_moment @ inverse.mT, dim1=-2, dim2=-1)
    key_side = torch.diagonal(transform.mT @ key_moment @ transform, dim1=-2, dim2=-1)
    return (query_side * key_side).sum(-1)


def fit_transforms(query_moment: torch.Tensor, key_moment: torch.Tensor,
                   start: torch.Tensor) -> torch.Tensor:
    """T [..., d, d] near `start` (an orthogonal rotation) with a smaller modelled score error:
    FIT_STEPS Adam steps on T = start (I + U) from U = 0, each (layer, head) weighted by its
    error at the start. The gradient is written out (see `_error_gradient`) rather than taken by
    autograd: a third of the batched matmuls, no graph."""
    eye = torch.eye(start.shape[-1], device=start.device)
    baseline = modelled_score_error(start, query_moment, key_moment)
    update = torch.zeros(query_moment.shape, device=start.device)
    optimizer = torch.optim.Adam([update], lr=_LEARNING_RATE)
    for _ in range(FIT_STEPS):
        # Relative to the start, so that every (layer, head) counts alike whatever its scale.
        gradient = _error_gradient(start @ (eye + update), query_moment, key_moment)
        update.grad = start.mT @ (gradient / baseline[..., None, None])
        optimizer.step()
    return start @ (eye + update)


def _error_gradient(transform: torch.Tensor, query_moment: torch.Tensor, key_moment: torch.Tensor) -> torch.Tensor:
    """d/dT of `modelled_score_error`. With X = T^-1, a = diag(X A X^T), b = diag(T^T B T) and
    the error Σ a_i b_i: d/dT = 2 (B T diag(a) - X^T diag(b) X A X^T), using dX = -X dT X and
    the symmetry of A and B."""
    inverse = torch.linalg.inv(transform)
    inverse_query = inverse @ query_moment
    key_transform = key_moment @ transform
    query_side = (inverse_query * inverse).sum(-1)  # diag(X A X^T)
    key_side = (transform * key_transform).sum(-2)  # diag(T^T B T)
    return 2 * (key_transform * query_side[..., None, :]
                - inverse.mT @ (key_side[..., :, None] * inverse_query) @ inverse.mT)


def calibrate_key_bases(runner: ModelRunner, max_tokens: int,
                        model_file: Path | None = None) -> tuple[list[torch.Tensor], float]:
    """Each layer's key transform T [kv_heads, d, d] for the model (`set_key_bases`), fitted from
    the Hadamard rotation, and the fitted bases' modelled score error as a share of that
    rotation's (mean over layers and heads). For formats that store the keys they are given as
    they are (no rotation of their own). Kept in the disk cache per `model_file` and options."""
    model, kv_cache = runner.model, runner.kv_cache
    config = model.config
    model.set_key_bases(None)
    shape = (config.num_kv_heads, config.head_dim, config.head_dim)

    def valid(result: dict[str, Any]) -> bool:
        bases = result.get("bases")
        return (isinstance(bases, list) and len(bases) == config.num_layers and isinstance(result.get("share"), float)
                and all(isinstance(b, torch.Tensor) and b.shape == shape and b.isfinite().all() for b in bases))

    parameters = {"tokens": calibration_tokens(kv_cache, max_tokens, CALIBRATION_TOKENS), "steps": FIT_STEPS,
                  "learning_rate": _LEARNING_RATE, "min_tokens_per_dim": MIN_TOKENS_PER_DIM}
    result = cached_calibration("key-bases", model, kv_cache, model_file, parameters,
                                lambda: _fit_key_bases(runner, max_tokens), valid)
    return result["bases"], result["share"]


def _fit_key_bases(runner: ModelRunner, max_tokens: int) -> dict[str, Any]:
    """{"bases": T per layer, "share": the modelled error against the Hadamard rotation}."""
    model, device = runner.model, runner.kv_cache.device
    config = model.config
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    recorded = record_projections(runner, max_tokens, CALIBRATION_TOKENS)
    positions = torch.arange(recorded[0].shape[0], device=device)
    hadamard = hadamard_rotation(dim, torch.float32, device)
    if positions.shape[0] < MIN_TOKENS_PER_DIM * dim:  # too few tokens (a short max-model-len or pool)
        return {"bases": [hadamard.expand(kv_heads, dim, dim).clone() for _ in model.layers], "share": 1.0}
    cos, signed_sin = model.rope(positions)
    query_moments, key_moments = [], []
    for layer, qkv in zip(model.layers, recorded):
        qk = apply_rotary(qkv[:, : heads + kv_heads].float(), cos.float(), signed_sin.float())
        q = qk[:, :heads].reshape(-1, kv_heads, heads // kv_heads, dim)
        k = qk[:, heads:]
        if layer.self_attn.key_center is not None:
            k = k - layer.self_attn.key_center.float()
        query_moments.append(torch.einsum("nhgi,nhgj->hij", q, q) / q.shape[0])
        key_moments.append(torch.einsum("nhi,nhj->hij", k, k) / k.shape[0])
    query_moment, key_moment = torch.stack(query_moments), torch.stack(key_moments)
    with one_thread():  # small ops (torch_threads.py)
        fitted = fit_transforms(query_moment, key_moment, hadamard.expand_as(query_moment).contiguous())
    share = (modelled_score_error(fitted, query_moment, key_moment)
             / modelled_score_error(hadamard, query_moment, key_moment)).mean().item()
    return {"bases": list(fitted), "share": share}
