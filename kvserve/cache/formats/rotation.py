"""The orthogonal rotation that quantized formats apply to K and V before quantizing them.

A few channels of the keys carry most of their magnitude (the same channels in every token:
RoPE's low-frequency pairs). Quantization error then concentrates in those channels, which
are also where the queries are large, so it lands straight in the attention scores.
Multiplying K and V by an orthogonal Hadamard matrix H spreads every channel over all
channels (QuaRot: Ashkboos et al. 2024, arXiv:2404.00456): absmax / rms of a block drops, and
the error that remains is spread evenly instead of aligned with the queries. Attention is
unchanged because q.k = (qH).(kH) and softmax(s) (VH) H^T = softmax(s) V; the attention layer
rotates the queries and un-rotates its output (two small matmuls), so the cached K/V are
never turned back. It halved every format's KL from the full-precision cache; a randomized
Hadamard or a random orthogonal matrix did no better (BENCHMARKS.md, "KV-cache dtypes").
int8 does not rotate: its error is small either way, and the matmuls cost decode speed (int8.py).
fp8_e4m3 does not either: its keys are stored in a basis fitted to its relative rounding, starting from this rotation (kvserve/engine/key_basis.py), and its values'
relative error does not shrink in any basis. fp8_e5m2 and int4 rotate.
"""
from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=None)
def hadamard_rotation(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Orthonormal, symmetric [dim, dim]: block-diagonal Sylvester-Hadamard matrices of size 2^k,
    the largest power of two dividing `dim` (the identity when `dim` is odd)."""
    size = dim & -dim
    block = torch.ones(1, 1)
    while block.shape[0] < size:
        block = torch.cat((torch.cat((block, block), 1), torch.cat((block, -block), 1)), 0)
    matrix = torch.block_diag(*[block / math.sqrt(size)] * (dim // size))
    return matrix.to(device=device, dtype=dtype)
