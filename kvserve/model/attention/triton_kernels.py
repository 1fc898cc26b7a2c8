"""Triton kernels for paged attention that read every KV format where it lies.

* `store_kv`: a step's new K/V into their pool slots, quantized on the way (fp8 e4m3/e5m2 with a
  power-of-two scale per token, int8 with a float16 scale, int4 with a float16 scale and zero),
  one program per (token, KV head), bit for bit what the formats' torch writes store.
  `rope_store` does it from the unrotated q/k/v heads, rotating the keys on the way (RoPE applied
  with the store) and the queries beside them: one launch where RoPE and the store took two.
* `paged_decode`: one query per sequence; one program per (sequence, KV head, split) covers the
  whole GQA query group (the group's rows are the rows of its dots), walking the block table and
  dequantizing K/V in registers. Long contexts are cut into splits (flash-decoding, Dao et al.
  2023) whose partial softmax sums `_combine_splits` merges: `split_tokens` each, or a multiple of
  it past `max_splits` splits (`split_length`), so a sequence's splits depend on its own length
  alone. Past DECODE_PROGRAMS programs, each takes every n-th split (`split_programs`).
* `paged_prefill`: chunks of queries over paged K/V, causal aligned to the end of the context, so
  a chunk after a prefix-cache hit reads the cached blocks in place (FlashAttention-2's online
  softmax, Dao 2023, over blocks found through the block table).

Every kernel splits a head's channels into halves [0, D/2) and [D/2, D): int4 packs channel j
with channel j + D/2 in one byte, and the other formats are read the same way so that all
formats share one code path. Pools are laid out as the formats allocate them (cache/formats/):
K in rows [0, kv_heads), V in rows [kv_heads, 2 kv_heads) of [rows, blocks, block_size, ...].

They run on CUDA and, for tests, under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvserve.model.fused_ops import rotate_row
from kvserve.model.triton_rounding import round_to
from kvserve.triton_interpreter import prepare_interpreter

prepare_interpreter()  # under Triton's interpreter only (triton_interpreter.py)

# Layout kinds (KIND, a constexpr of every kernel): the Python values, and the same as constants
# the kernels may read.
FLOAT, INT8, FP8, INT4, INT4_KIVI = range(5)
K_FLOAT, K_INT8, K_FP8, K_INT4, K_INT4_KIVI = (tl.constexpr(kind) for kind in range(5))
# fp8 variants: (mantissa bits, exponent bias, largest finite value).
FP8_VARIANTS = {"e4m3": (3, 7, 448.0), "e5m2": (2, 15, 57344.0)}
LOG2E = 1.4426950408889634
# Adding and subtracting 1.5 * 2^23 rounds a float32 of magnitude < 2^22 to the nearest integer,
# ties to even (torch.round's rule), with no libdevice call (the interpreter has none).
ROUNDER = tl.constexpr(12582912.0)
# Programs a decode launch has before a sequence's splits share programs (split_programs): enough
# to fill an H100's or H200's 132 SMs many times over.
DECODE_PROGRAMS = 2048
NEG_BIG = tl.constexpr(-1.0e30)  # the running maximum's start: finite, so exp2(m_old - m_new) is never NaN


@triton.jit
def _split_length(seq_len, split_tokens, max_splits):
    """`split_length` in a kernel."""
    return split_tokens * tl.maximum(tl.cdiv(tl.cdiv(seq_len, split_tokens), max_splits), 1)


@triton.jit
def _rint(x):
    return (x + ROUNDER) - ROUNDER


@triton.jit
def _dot(a, b, PRECISE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """a @ b with float32 accumulation: IEEE float32 products for float32 models (and under the
    interpreter), else the model's 16-bit dtype on the tensor cores."""
    if PRECISE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def _fp8_to_float(code, MANT: tl.constexpr, BIAS: tl.constexpr):
    """1-byte fp8 codes (int32 holding 0..255) -> their float32 values, exactly, by integer ops:
    normal numbers move their exponent and mantissa into a float32's, subnormals are m * 2^(1 - BIAS - MANT)."""
    magnitude = code & 0x7F
    negative = (code & 0x80) != 0
    normal = ((magnitude << (23 - MANT)) + ((127 - BIAS) << 23)).to(tl.float32, bitcast=True)
    subnormal = magnitude.to(tl.float32) * (2.0 ** (1 - BIAS - MANT))
    value = tl.where((magnitude >> MANT) == 0, subnormal, normal)
    return tl.where(negative, -value, value)


@triton.jit
def _float_to_fp8(x, MANT: tl.constexpr, BIAS: tl.constexpr):
    """float32 values within the format's range -> 1-byte fp8 codes (int32), rounded to nearest,
    ties to even: what torch's cast to float8_e4m3fn / float8_e5m2 does."""
    bits = x.to(tl.int32, bitcast=True)
    negative = bits < 0
    magnitude = tl.abs(x)
    min_normal = 2.0 ** (1 - BIAS)
    # Subnormals: multiples of 2^(1 - BIAS - MANT), rounded as integers.
    sub = _rint(tl.minimum(magnitude, min_normal) * (2.0 ** (BIAS + MANT - 1))).to(tl.int32)
    mbits = magnitude.to(tl.int32, bitcast=True)
    exponent = (mbits >> 23) - 127 + BIAS
    mantissa = mbits & 0x7FFFFF
    drop: tl.constexpr = 23 - MANT
    kept = mantissa >> drop
    rest = mantissa & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    normal = (exponent << MANT) + kept + up.to(tl.int32)  # a mantissa carry moves into the exponent
    code = tl.where(magnitude < min_normal, sub, normal)
    return tl.where(negative, code | 0x80, code)


@triton.jit
def _f16_step(x, UP: tl.constexpr):
    """nextafter of float16 values toward +inf (UP) or -inf, as torch.nextafter."""
    bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    negative = (bits & 0x8000) != 0
    zero = (bits & 0x7FFF) == 0
    if UP:
        stepped = tl.where(negative, bits - 1, bits + 1)
        stepped = tl.where(zero, 1, stepped)
    else:
        stepped = tl.where(negative, bits + 1, bits - 1)
        stepped = tl.where(zero, 0x8001, stepped)
    return stepped.to(tl.int16).to(tl.float16, bitcast=True)


# ---------------------------------------------------------------------------------------- store
@triton.jit
def _quantize_row(lo, hi, kv_ptr, aux_ptr, row, HALF: tl.constexpr, KIND: tl.constexpr,
                  MANT: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr):
    """Store one (token, head) row, channel halves lo/hi [HALF] in float32, at pool row `row`
    (head * blocks * block_size + slot), with its scale(s) in aux; fp8 as MANT/BIAS/FMAX say.
    Divisions round to nearest (div_rn), as torch's do: Triton's `/` is an approximate division on
    NVIDIA GPUs, which would move codes at rounding ties."""
    D: tl.constexpr = 2 * HALF
    c = tl.arange(0, HALF)
    if KIND == K_FLOAT:
        tl.store(kv_ptr + row * D + c, round_to(lo, kv_ptr.dtype.element_ty))
        tl.store(kv_ptr + row * D + HALF + c, round_to(hi, kv_ptr.dtype.element_ty))
    elif KIND == K_INT8:
        amax = tl.maximum(tl.max(tl.abs(lo), axis=0), tl.max(tl.abs(hi), axis=0))
        scale16 = tl.maximum(tl.math.div_rn(amax, 127.0), 2.0 ** -14).to(tl.float16)
        scale = scale16.to(tl.float32)
        lo_code = tl.minimum(tl.maximum(_rint(tl.math.div_rn(lo, scale)), -127.0), 127.0).to(tl.int8)
        hi_code = tl.minimum(tl.maximum(_rint(tl.math.div_rn(hi, scale)), -127.0), 127.0).to(tl.int8)
        tl.store(kv_ptr + row * D + c, lo_code)
        tl.store(kv_ptr + row * D + HALF + c, hi_code)
        tl.store(aux_ptr + row, scale16)
    elif KIND == K_FP8:
        amax = tl.maximum(tl.max(tl.abs(lo), axis=0), tl.max(tl.abs(hi), axis=0))
        ratio = tl.math.div_rn(tl.maximum(amax, 1e-6), FMAX)
        # ceil(log2(ratio)) exactly, from the float32's bits: its exponent, plus one unless a power of two.
        rbits = ratio.to(tl.int32, bitcast=True)
        exponent = ((rbits >> 23) & 0xFF) - 127 + ((rbits & 0x7FFFFF) != 0).to(tl.int32)
        exponent = tl.minimum(exponent, BIAS)
        inv = (((127 - exponent) & 0xFF) << 23).to(tl.float32, bitcast=True)  # 2^-exponent, exact
        lo_code = _float_to_fp8(tl.minimum(tl.maximum(lo * inv, -FMAX), FMAX), MANT, BIAS)
        hi_code = _float_to_fp8(tl.minimum(tl.maximum(hi * inv, -FMAX), FMAX), MANT, BIAS)
        tl.store(kv_ptr + row * D + c, lo_code.to(tl.int8))
        tl.store(kv_ptr + row * D + HALF + c, hi_code.to(tl.int8))
        tl.store(aux_ptr + row, exponent.to(tl.int8))
    else:  # K_INT4: asymmetric per (token, head), float16 (scale, zero) covering [min, max]
        low = tl.minimum(tl.min(lo, axis=0), tl.min(hi, axis=0))
        high = tl.maximum(tl.max(lo, axis=0), tl.max(hi, axis=0))
        low = tl.minimum(tl.maximum(low, -65504.0), 65504.0)
        high = tl.minimum(tl.maximum(high, -65504.0), 65504.0)
        zero16 = low.to(tl.float16)
        zero16 = tl.where(zero16.to(tl.float32) > low, _f16_step(zero16, False), zero16)
        zero = zero16.to(tl.float32)
        scale16 = tl.math.div_rn(high - zero, 15.0).to(tl.float16)
        scale16 = tl.where(scale16.to(tl.float32) * 15.0 + zero < high, _f16_step(scale16, True), scale16)
        scale = tl.maximum(scale16.to(tl.float32), 1e-12)
        lo_code = tl.minimum(tl.maximum(_rint(tl.math.div_rn(lo - zero, scale)), 0.0), 15.0).to(tl.int32)
        hi_code = tl.minimum(tl.maximum(_rint(tl.math.div_rn(hi - zero, scale)), 0.0), 15.0).to(tl.int32)
        tl.store(kv_ptr + row * HALF + c, (lo_code | (hi_code << 4)).to(tl.uint8))
        tl.store(aux_ptr + row * 2, scale16)
        tl.store(aux_ptr + row * 2 + 1, zero16)


@triton.jit
def _store_kernel(key_ptr, value_ptr, slot_ptr, kv_ptr, aux_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                  num_kv_heads, pool_slots, HALF: tl.constexpr, KIND: tl.constexpr,
                  MANT: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    c = tl.arange(0, HALF)
    key = key_ptr + token * stride_kt + head * stride_kh
    value = value_ptr + token * stride_vt + head * stride_vh
    _quantize_row(tl.load(key + c).to(tl.float32), tl.load(key + HALF + c).to(tl.float32), kv_ptr, aux_ptr,
                  head * pool_slots + slot, HALF, KIND, MANT, BIAS, FMAX)
    _quantize_row(tl.load(value + c).to(tl.float32), tl.load(value + HALF + c).to(tl.float32), kv_ptr, aux_ptr,
                  (head + num_kv_heads) * pool_slots + slot, HALF, KIND, MANT, BIAS, FMAX)


def store_kv(kind: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             kv: torch.Tensor, aux: torch.Tensor | None, fp8: str = "e4m3") -> None:
    """Write key/value [tokens, kv_heads, D] (last dim contiguous) at their slots of a pool kv
    [2 kv_heads, blocks, block_size, D or D/2] with per-token scales aux (None for float pools)."""
    tokens, kv_heads, dim = key.shape
    if tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    pool_slots = kv.shape[1] * kv.shape[2]
    mant, bias, fmax = FP8_VARIANTS[fp8]
    _store_kernel[(tokens, kv_heads)](key, value, slot_mapping, kv, kv if aux is None else aux,
                                      key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                      kv_heads, pool_slots, HALF=dim // 2, KIND=kind, MANT=mant, BIAS=bias, FMAX=fmax)


@triton.jit
def _rope_store_kernel(heads_ptr, cos_ptr, sin_ptr, q_ptr, slot_ptr, kv_ptr, aux_ptr, stride_t, stride_ct,
                       stride_qt, num_heads, num_kv_heads, pool_slots, HALF: tl.constexpr, KIND: tl.constexpr,
                       MANT: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    c = tl.arange(0, HALF)
    row = heads_ptr + token * stride_t + head * (2 * HALF)
    first, second = rotate_row(row, cos_ptr + token * stride_ct, sin_ptr + token * stride_ct, HALF,
                               q_ptr.dtype.element_ty)
    if head < num_heads:  # a query head: rotated, for the attention kernels
        out = q_ptr + token * stride_qt + head * (2 * HALF)
        tl.store(out + c, first)
        tl.store(out + HALF + c, second)
    else:  # a key head: rotated and stored, with its value head (num_kv_heads heads further on)
        kv_head = (head - num_heads).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        _quantize_row(first.to(tl.float32), second.to(tl.float32), kv_ptr, aux_ptr, kv_head * pool_slots + slot,
                      HALF, KIND, MANT, BIAS, FMAX)
        value = row + num_kv_heads * (2 * HALF)
        _quantize_row(tl.load(value + c).to(tl.float32), tl.load(value + HALF + c).to(tl.float32), kv_ptr, aux_ptr,
                      (kv_head + num_kv_heads) * pool_slots + slot, HALF, KIND, MANT, BIAS, FMAX)


def rope_store(kind: int, heads: torch.Tensor, num_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
               slot_mapping: torch.Tensor, kv: torch.Tensor, aux: torch.Tensor | None,
               fp8: str = "e4m3") -> torch.Tensor:
    """RoPE applied with the store, in one launch: from a step's packed q/k/v heads
    [tokens, num_heads + 2 kv_heads, D] (rows of the qkv projection, heads contiguous) and the
    tokens' cos / signed sin [tokens, 1, D], the keys are rotated and written with the values at
    their slots as `store_kv` writes them, and the rotated queries [tokens, num_heads, D] are
    returned: what fused_ops.rotary followed by store_kv computes, bit for bit."""
    tokens, total, dim = heads.shape
    num_kv_heads = (total - num_heads) // 2
    query = torch.empty(tokens, num_heads, dim, dtype=heads.dtype, device=heads.device)
    if tokens == 0:
        return query
    assert heads.stride(2) == 1 and heads.stride(1) == dim
    cos, signed_sin = cos.reshape(tokens, dim), signed_sin.reshape(tokens, dim)
    mant, bias, fmax = FP8_VARIANTS[fp8]
    _rope_store_kernel[(tokens, num_heads + num_kv_heads)](
        heads, cos, signed_sin, query, slot_mapping, kv, kv if aux is None else aux, heads.stride(0), cos.stride(0),
        query.stride(0), num_heads, num_kv_heads, kv.shape[1] * kv.shape[2], HALF=dim // 2, KIND=kind, MANT=mant,
        BIAS=bias, FMAX=fmax)
    return query


# ---------------------------------------------------------------------------------------- read
@triton.jit
def _load_kv(kv_ptr, aux_ptr, kp_ptr, kv_row, block, offsets, valid, num_blocks,
             BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr, KIND: tl.constexpr, IS_KEY: tl.constexpr,
             MANT: tl.constexpr, BIAS: tl.constexpr):
    """Tokens `offsets` [N] of block `block` (pool row `kv_row`: a head of K or of V), dequantized:
    (lo, hi) float32 [N, HALF]. kp_ptr: int4_kivi's per-channel key (scale, zero) per block."""
    c = tl.arange(0, HALF)
    slot = (kv_row * num_blocks + block) * BLOCK_SIZE + offsets  # int64 [N]
    m = valid[:, None]
    if KIND == K_FLOAT:
        lo = tl.load(kv_ptr + slot[:, None] * (2 * HALF) + c[None, :], mask=m, other=0.0).to(tl.float32)
        hi = tl.load(kv_ptr + slot[:, None] * (2 * HALF) + HALF + c[None, :], mask=m, other=0.0).to(tl.float32)
    elif (KIND == K_INT8) or (KIND == K_FP8):
        lo_code = tl.load(kv_ptr + slot[:, None] * (2 * HALF) + c[None, :], mask=m, other=0).to(tl.int32)
        hi_code = tl.load(kv_ptr + slot[:, None] * (2 * HALF) + HALF + c[None, :], mask=m, other=0).to(tl.int32)
        stored = tl.load(aux_ptr + slot, mask=valid, other=0)
        if KIND == K_INT8:
            lo = lo_code.to(tl.float32)
            hi = hi_code.to(tl.float32)
            scale = stored.to(tl.float32)
        else:
            lo = _fp8_to_float(lo_code & 0xFF, MANT, BIAS)
            hi = _fp8_to_float(hi_code & 0xFF, MANT, BIAS)
            scale = (((stored.to(tl.int32) + 127) & 0xFF) << 23).to(tl.float32, bitcast=True)  # 2^exponent
        lo = lo * scale[:, None]
        hi = hi * scale[:, None]
    else:
        packed = tl.load(kv_ptr + slot[:, None] * HALF + c[None, :], mask=m, other=0).to(tl.int32)
        lo = (packed & 0xF).to(tl.float32)
        hi = ((packed >> 4) & 0xF).to(tl.float32)
        if (KIND == K_INT4_KIVI) and IS_KEY:  # per channel of the block: params [2, D] per (head, block)
            base = (kv_row * num_blocks + block) * (4 * HALF)
            lo = lo * tl.load(kp_ptr + base + c).to(tl.float32)[None, :] + \
                tl.load(kp_ptr + base + 2 * HALF + c).to(tl.float32)[None, :]
            hi = hi * tl.load(kp_ptr + base + HALF + c).to(tl.float32)[None, :] + \
                tl.load(kp_ptr + base + 3 * HALF + c).to(tl.float32)[None, :]
        else:  # per token: params [2] per slot
            scale = tl.load(aux_ptr + slot * 2, mask=valid, other=0.0).to(tl.float32)
            zero = tl.load(aux_ptr + slot * 2 + 1, mask=valid, other=0.0).to(tl.float32)
            lo = lo * scale[:, None] + zero[:, None]
            hi = hi * scale[:, None] + zero[:, None]
    return lo, hi


@triton.jit
def _attend_blocks(q_lo, q_hi, q_pos, table_ptr, first_token, end_token, window,
                   k_ptr, k_aux_ptr, kp_ptr, v_ptr, v_aux_ptr, k_row, v_row, num_blocks, qk_scale,
                   M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr, KIND: tl.constexpr,
                   MANT: tl.constexpr, BIAS: tl.constexpr, PRECISE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Online softmax of M query rows (q_lo/q_hi [M, HALF], positions q_pos [M]) over the context
    tokens [first_token, end_token) found through the block table: (acc_lo, acc_hi, m, l)."""
    m_i = tl.full([M], NEG_BIG, tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc_lo = tl.zeros([M, HALF], tl.float32)
    acc_hi = tl.zeros([M, HALF], tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    for b in range(first_token // BLOCK_SIZE, tl.cdiv(end_token, BLOCK_SIZE)):
        block = tl.load(table_ptr + b).to(tl.int64)
        kv_pos = b * BLOCK_SIZE + offsets
        valid = (kv_pos >= first_token) & (kv_pos < end_token)
        k_lo, k_hi = _load_kv(k_ptr, k_aux_ptr, kp_ptr, k_row, block, offsets, valid, num_blocks,
                              BLOCK_SIZE, HALF, KIND, True, MANT, BIAS)
        scores = _dot(q_lo, tl.trans(k_lo), PRECISE, DOT_DTYPE) + _dot(q_hi, tl.trans(k_hi), PRECISE, DOT_DTYPE)
        allowed = valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        allowed = allowed & ((kv_pos[None, :] > q_pos[:, None] - window) | (window <= 0))
        scores = tl.where(allowed, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_lo, v_hi = _load_kv(v_ptr, v_aux_ptr, kp_ptr, v_row, block, offsets, valid, num_blocks,
                              BLOCK_SIZE, HALF, KIND, False, MANT, BIAS)
        acc_lo = acc_lo * alpha[:, None] + _dot(p, v_lo, PRECISE, DOT_DTYPE)
        acc_hi = acc_hi * alpha[:, None] + _dot(p, v_hi, PRECISE, DOT_DTYPE)
        m_i = m_new
    return acc_lo, acc_hi, m_i, l_i


# The kernels' integer arguments that change from step to step (a block table's width, a decode's
# splits) are not specialised on their value (do_not_specialize): Triton would compile a variant
# for 1, for multiples of 16 and for the rest, the first time each shows up, mid-serving.
@triton.jit(do_not_specialize=["stride_table", "num_splits"])
def _decode_kernel(q_ptr, out_ptr, part_acc_ptr, part_ml_ptr, table_ptr, seq_lens_ptr,
                   k_ptr, k_aux_ptr, kp_ptr, v_ptr, v_aux_ptr,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_table, num_heads, num_kv_heads, num_blocks,
                   v_row_offset, window, qk_scale, num_splits, split_tokens, max_splits,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr,
                   KIND: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, PRECISE: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    row_ok = g < GROUP
    c = tl.arange(0, HALF)
    q_base = q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_lo = tl.load(q_base + c[None, :], mask=row_ok[:, None], other=0.0)
    q_hi = tl.load(q_base + HALF + c[None, :], mask=row_ok[:, None], other=0.0)
    q_pos = tl.full([GROUP_PAD], 0, tl.int32) + (seq_len - 1)
    # This program's splits: its index, then every num_programs(2)-th. A split past the sequence's
    # end is not computed (a graph's decode has as many as the longest context allowed), and
    # _combine_splits never reads it.
    length = _split_length(seq_len, split_tokens, max_splits)
    for split in range(tl.program_id(2), tl.cdiv(seq_len, length), tl.num_programs(2)):
        first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
        first = tl.maximum(first, split * length)
        end = tl.minimum(seq_len, (split + 1) * length)
        acc_lo, acc_hi, m_i, l_i = _attend_blocks(
            q_lo, q_hi, q_pos, table_ptr + seq.to(tl.int64) * stride_table, first, end, window,
            k_ptr, k_aux_ptr, kp_ptr, v_ptr, v_aux_ptr, kv_head.to(tl.int64), kv_head.to(tl.int64) + v_row_offset,
            num_blocks, qk_scale, GROUP_PAD, BLOCK_SIZE, HALF, KIND, MANT, BIAS, PRECISE, DOT_DTYPE)
        if SPLIT:  # partial sums [seq, head, split, D] and (m, l) [seq, head, split, 2]
            part = (seq * num_heads + heads).to(tl.int64) * num_splits + split
            tl.store(part_acc_ptr + part[:, None] * (2 * HALF) + c[None, :], acc_lo, mask=row_ok[:, None])
            tl.store(part_acc_ptr + part[:, None] * (2 * HALF) + HALF + c[None, :], acc_hi, mask=row_ok[:, None])
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        else:
            denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_base = out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
            tl.store(o_base + c[None, :], round_to(acc_lo / denom, out_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.store(o_base + HALF + c[None, :], round_to(acc_hi / denom, out_ptr.dtype.element_ty),
                     mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits(out_ptr, part_acc_ptr, part_ml_ptr, seq_lens_ptr, stride_ot, stride_oh, num_heads, num_splits,
                    split_tokens, max_splits, D: tl.constexpr):
    """Merge a (sequence, head)'s split partial sums in split order, as an online softmax over the
    splits. A split holding no token of the window (m = NEG_BIG, l = 0, sums 0) leaves the running
    sums exactly as they were, and a sequence of one split comes out as the unsplit kernel writes
    it: the result depends on the sequence alone, not on the longest context in the batch. The
    splits past the sequence's end are neither written nor read (a CUDA graph's decode has as many
    splits as the longest context allowed)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first = (seq * num_heads + head).to(tl.int64) * num_splits
    d = tl.arange(0, D)
    m_run = tl.full([1], NEG_BIG, tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    used = tl.cdiv(seq_len, _split_length(seq_len, split_tokens, max_splits))
    for s in range(used):
        m_s = tl.load(part_ml_ptr + (first + s) * 2)
        l_s = tl.load(part_ml_ptr + (first + s) * 2 + 1)
        m_new = tl.maximum(m_run, m_s)
        alpha = tl.exp2(m_run - m_new)
        weight = tl.exp2(m_s - m_new)
        acc = acc * alpha + tl.load(part_acc_ptr + (first + s) * D + d) * weight
        l_run = l_run * alpha + l_s * weight
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + d, round_to(out, out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["stride_table"])
def _prefill_kernel(q_ptr, out_ptr, table_ptr, tile_chunk_ptr, tile_start_ptr, chunk_row_ptr, chunk_queries_ptr,
                    chunk_context_ptr, k_ptr, k_aux_ptr, kp_ptr, v_ptr, v_aux_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_table, num_blocks, v_row_offset,
                    window, qk_scale,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr,
                    KIND: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, PRECISE: tl.constexpr,
                    DOT_DTYPE: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.load(tile_chunk_ptr + tile)
    q_start = tl.load(tile_start_ptr + tile)
    row0 = tl.load(chunk_row_ptr + chunk)
    num_queries = tl.load(chunk_queries_ptr + chunk)
    context = tl.load(chunk_context_ptr + chunk)
    r = q_start + tl.arange(0, BLOCK_M)
    row_ok = r < num_queries
    q_pos = context - num_queries + r
    c = tl.arange(0, HALF)
    q_base = q_ptr + (row0 + r).to(tl.int64)[:, None] * stride_qt + head * stride_qh
    q_lo = tl.load(q_base + c[None, :], mask=row_ok[:, None], other=0.0)
    q_hi = tl.load(q_base + HALF + c[None, :], mask=row_ok[:, None], other=0.0)
    last = tl.minimum(context - num_queries + q_start + BLOCK_M, context)  # the tile's keys end here
    first = tl.where(window > 0, tl.maximum(context - num_queries + q_start - window + 1, 0), 0)
    kv_head = (head // GROUP).to(tl.int64)
    acc_lo, acc_hi, m_i, l_i = _attend_blocks(
        q_lo, q_hi, q_pos, table_ptr + chunk.to(tl.int64) * stride_table, first, last, window,
        k_ptr, k_aux_ptr, kp_ptr, v_ptr, v_aux_ptr, kv_head, kv_head + v_row_offset, num_blocks, qk_scale,
        BLOCK_M, BLOCK_SIZE, HALF, KIND, MANT, BIAS, PRECISE, DOT_DTYPE)
    denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_base = out_ptr + (row0 + r).to(tl.int64)[:, None] * stride_ot + head * stride_oh
    tl.store(o_base + c[None, :], round_to(acc_lo / denom, out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(o_base + HALF + c[None, :], round_to(acc_hi / denom, out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _pool_args(kind: int, pool: dict[str, torch.Tensor]) -> tuple:
    """(K tensor, K aux, kivi key params, V tensor, V aux, V's first row, blocks) for a kernel."""
    if kind == INT4_KIVI:
        key, value = pool["key"], pool["value"]
        return key, pool["value_params"], pool["key_params"], value, pool["value_params"], 0, key.shape[1]
    kv = pool["kv"]
    if kind in (INT8, FP8):
        kv, aux = kv.view(torch.int8), pool["kv_scale"]
    elif kind == INT4:
        aux = pool["kv_params"]
    else:
        aux = kv
    return kv, aux, aux, kv, aux, kv.shape[0] // 2, kv.shape[1]


def _dot_dtype(query: torch.Tensor, interpreting: bool) -> tuple[bool, object]:
    precise = interpreting or query.dtype == torch.float32
    return precise, tl.float16 if query.dtype == torch.float16 else tl.bfloat16


def split_length(seq_len: int, split_tokens: int, max_splits: int) -> int:
    """Context tokens per split of a decode over `seq_len` tokens: `split_tokens`, or the least
    multiple of it that cuts the context into at most `max_splits` splits. It depends on the
    sequence's own length only (a decode's result does not depend on its batch), and capping the
    count bounds the partial sums a launch keeps: a CUDA graph's decode is sized for the longest
    context allowed, which at `split_tokens` each would be 256 splits at 131,072 tokens."""
    return split_tokens * max(1, _cdiv(_cdiv(seq_len, split_tokens), max_splits))


def decode_splits(max_seq_len: int, split_tokens: int, max_splits: int) -> int:
    """The most splits a sequence of up to `max_seq_len` tokens is cut into (a shorter one may
    have more than the longest: 128 tokens in splits of 32 make 4, and 160 with at most 4 make 3)."""
    return max(1, min(_cdiv(max_seq_len, split_tokens), max_splits))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_programs(num_splits: int, batch: int, kv_heads: int) -> int:
    """Programs per (sequence, KV head) of a decode launch: one per split until the launch has
    DECODE_PROGRAMS, then fewer, each taking every n-th split. A CUDA graph's decode has as many
    splits as the longest context allowed needs (64 at 131,072 tokens) and its sequences mostly need
    far fewer: a program per split would mostly start and stop. Each split is computed the same way
    whichever program takes it, so the result does not depend on this."""
    return min(num_splits, max(1, -(-DECODE_PROGRAMS // (batch * kv_heads))))


def paged_decode(kind: int, query: torch.Tensor, out: torch.Tensor, pool: dict[str, torch.Tensor],
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, window: int | None,
                 split_tokens: int, max_splits: int, interpreting: bool, fp8: str = "e4m3") -> None:
    """Decode attention of query [B, H, D] (one per sequence) into out [B, H, D] over each
    sequence's first seq_lens tokens (none over `max_seq_len`), found through block_tables [B, W]."""
    batch, heads, dim = query.shape
    k, k_aux, kp, v, v_aux, v_row, num_blocks = _pool_args(kind, pool)
    kv_heads = (k.shape[0] if kind == INT4_KIVI else k.shape[0] // 2)
    block_size = k.shape[2]
    group = heads // kv_heads
    num_splits = decode_splits(max_seq_len, split_tokens, max_splits)
    precise, dot_dtype = _dot_dtype(query, interpreting)
    qk_scale = LOG2E / math.sqrt(dim)
    rows = max(1, batch)
    if num_splits > 1:  # partial sums for at most PARTIALS_MAX_BYTES: more rows take several launches
        rows = slice_rows(batch, heads, num_splits, dim)
        part_acc = torch.empty(rows, heads, num_splits, dim, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(rows, heads, num_splits, 2, dtype=torch.float32, device=query.device)
    for first in range(0, batch, rows):  # the rows are independent: same bits whatever the slicing
        q, o, tables, lens = (t[first:first + rows] for t in (query, out, block_tables, seq_lens))
        n = q.shape[0]
        if num_splits == 1:
            part_acc = part_ml = o
        _decode_kernel[(n, kv_heads, split_programs(num_splits, n, kv_heads))](
            q, o, part_acc, part_ml, tables, lens, k, k_aux, kp, v, v_aux,
            q.stride(0), q.stride(1), o.stride(0), o.stride(1), tables.stride(0), heads, kv_heads,
            num_blocks, v_row, window or 0, qk_scale, num_splits, split_tokens, max_splits,
            GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, HALF=dim // 2,
            KIND=kind, MANT=FP8_VARIANTS[fp8][0], BIAS=FP8_VARIANTS[fp8][1], PRECISE=precise, DOT_DTYPE=dot_dtype,
            SPLIT=num_splits > 1)
        if num_splits > 1:
            _combine_splits[(n, heads)](o, part_acc, part_ml, lens, o.stride(0), o.stride(1), heads,
                                        num_splits, split_tokens, max_splits, D=dim)


def partials_bytes(rows: int, heads: int, num_splits: int, dim: int) -> int:
    """The split partial sums a decode launch of `rows` sequences keeps: float32 [rows, heads,
    splits, dim] and (max, sum) [rows, heads, splits, 2]."""
    return rows * heads * num_splits * (dim + 2) * 4


def slice_rows(batch: int, heads: int, num_splits: int, dim: int) -> int:
    """Sequences per decode launch when a call's partial sums would pass PARTIALS_MAX_BYTES (at
    least one)."""
    return max(1, min(batch, PARTIALS_MAX_BYTES // partials_bytes(1, heads, num_splits, dim)))


# The most memory a decode launch's split partial sums take (about 520 MiB): a call over more rows
# (a deterministic prefill, every row a decode; an eager decode of many long contexts) launches in
# slices of rows. A CUDA graph's 512 sequences of an 8B-shaped model (32 heads, head_dim 128) at
# 64 splits fit one launch.
PARTIALS_MAX_BYTES = partials_bytes(512, 32, 64, 128)


def paged_prefill(kind: int, query: torch.Tensor, out: torch.Tensor, pool: dict[str, torch.Tensor],
                  block_tables: torch.Tensor, tile_chunk: torch.Tensor, tile_start: torch.Tensor,
                  chunk_row: torch.Tensor, chunk_queries: torch.Tensor, chunk_context: torch.Tensor,
                  window: int | None, block_m: int, interpreting: bool, fp8: str = "e4m3") -> None:
    """Causal attention of prefill chunks: chunk i's queries are packed rows [chunk_row[i],
    chunk_row[i] + chunk_queries[i]) of query [tokens, H, D], the last of its chunk_context[i]
    context tokens (block_tables [chunks, W]); the tiles (chunk, first query) cover them all."""
    heads, dim = query.shape[1], query.shape[2]
    k, k_aux, kp, v, v_aux, v_row, num_blocks = _pool_args(kind, pool)
    kv_heads = (k.shape[0] if kind == INT4_KIVI else k.shape[0] // 2)
    precise, dot_dtype = _dot_dtype(query, interpreting)
    _prefill_kernel[(tile_chunk.shape[0], heads)](
        query, out, block_tables, tile_chunk, tile_start, chunk_row, chunk_queries, chunk_context,
        k, k_aux, kp, v, v_aux, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), num_blocks, v_row, window or 0, LOG2E / math.sqrt(dim),
        GROUP=heads // kv_heads, BLOCK_M=block_m, BLOCK_SIZE=k.shape[2], HALF=dim // 2, KIND=kind,
        MANT=FP8_VARIANTS[fp8][0], BIAS=FP8_VARIANTS[fp8][1], PRECISE=precise, DOT_DTYPE=dot_dtype)
