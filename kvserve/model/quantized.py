"""Weight-only quantized matrices as plain data: group-wise int4 and int8 with float32 scales.

One convention for both, that of torch's int4 CPU kernel (`aten._weight_int4pack_mm_for_cpu`):
w = (q - offset) * scale + zero per group of `group_size` consecutive input columns, with
q in 0..15 and offset 8 for int4, q in -127..127 and offset 0 (zero = 0) for int8. llama.cpp's
blocks map onto it exactly (ggml-quants.c): Q4_0 `d * (q - 8)` is scale d, zero 0; Q4_1
`d * q + m` is scale d, zero m + 8d; Q8_0 `d * q` is int8 with group scales d.

A matrix is [out_features, in_features] like an nn.Linear weight; scales and zeros are
[out_features, in_features / group_size].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedMatrix:
    q: torch.Tensor  # uint8 (int4: values 0..15, one per byte) or int8 [out, in]
    scale: torch.Tensor  # float32 [out, in / group_size]
    zero: torch.Tensor | None  # float32 like scale, or None (symmetric: zero 0)
    group_size: int
    bits: int  # 4 or 8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def offset(self) -> int:
        return 8 if self.bits == 4 else 0

    @property
    def storage_bytes(self) -> int:
        """Bytes at `bits` per value plus the float32 scales and zeros (what a kernel keeps)."""
        values = self.q.numel() * self.bits // 8
        return values + self.scale.nbytes + (self.zero.nbytes if self.zero is not None else 0)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: (q - offset) * scale + zero, one rounding per value (the product is
        exact in float32 for these small integers and float16-sized scales)."""
        out, cols = self.shape
        groups = self.q.float().view(out, cols // self.group_size, self.group_size)
        if self.offset:
            groups = groups.sub_(self.offset)
        values = groups.mul_(self.scale.unsqueeze(-1))
        if self.zero is not None:
            values = values.add_(self.zero.unsqueeze(-1))
        return values.view(out, cols)

    def rows(self, index: torch.Tensor) -> "QuantizedMatrix":
        """The matrix with its rows reordered (or selected) by `index`."""
        return QuantizedMatrix(self.q[index], self.scale[index], None if self.zero is None else self.zero[index],
                               self.group_size, self.bits)


    def columns(self, start: int, stop: int) -> "QuantizedMatrix":
        """The input columns [start, stop) (a row-parallel shard). The cut must fall on group
        boundaries; a matrix of one group per row (per-channel int8) can be cut anywhere, its one
        scale per row then covering the `stop - start` columns kept."""
        cols = self.shape[1]
        if self.group_size == cols:
            return QuantizedMatrix(self.q[:, start:stop].contiguous(), self.scale, self.zero, stop - start, self.bits)
        if start % self.group_size or stop % self.group_size:
            raise ValueError(f"cannot cut columns [{start}, {stop}) of a {self.shape[0]}x{cols} int{self.bits} "
                             f"matrix into whole groups of {self.group_size}")
        first, last = start // self.group_size, stop // self.group_size
        zero = None if self.zero is None else self.zero[:, first:last].contiguous()
        return QuantizedMatrix(self.q[:, start:stop].contiguous(), self.scale[:, first:last].contiguous(), zero,
                               self.group_size, self.bits)


def concat_rows(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Stack matrices of one format along the output dimension (fused q/k/v, gate/up)."""
    first = parts[0]
    if any(p.bits != first.bits or p.group_size != first.group_size or (p.zero is None) != (first.zero is None)
           for p in parts):
        raise ValueError("cannot fuse quantized matrices of different formats")
    zero = None if first.zero is None else torch.cat([p.zero for p in parts])
    return QuantizedMatrix(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), zero,
                           first.group_size, first.bits)


def same_format(parts: list[QuantizedMatrix | None]) -> bool:
    """Whether the parts can be fused with `concat_rows`."""
    if any(p is None for p in parts):
        return False
    first = parts[0]
    return all(p.bits == first.bits and p.group_size == first.group_size
               and (p.zero is None) == (first.zero is None) for p in parts)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedMatrix:
    """Symmetric int8 per output channel, or per group of `group_size` input columns (as llama.cpp's
    Q8_0), round to nearest: scale = max|w| / 127."""
    w = weight.float()
    out, cols = w.shape
    group = group_size or cols
    if cols % group:
        raise ValueError(f"int8 groups of {group} need in_features divisible by it, got {cols}")
    groups = w.view(out, cols // group, group)
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(groups / scale).clamp_(-127, 127).to(torch.int8)
    return QuantizedMatrix(q.view(out, cols), scale.squeeze(-1), None, group, 8)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedMatrix:
    """Asymmetric int4 in groups of `group_size` input columns (min/max, round to nearest, like
    llama.cpp's Q4_1): scale = (max - min) / 15, q = round((w - min) / scale)."""
    w = weight.float()
    out, cols = w.shape
    if cols % group_size:
        raise ValueError(f"int4 needs in_features divisible by {group_size}, got {cols}")
    groups = w.view(out, cols // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    return QuantizedMatrix(q.view(out, cols), scale, low + 8 * scale, group_size, 4)



def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes, one a byte [out, in] (in even) -> two a byte [out, in / 2]: column 2j in the low
    nibble, 2j + 1 in the high one."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`: uint8 codes 0..15 [out, 2 * packed columns]."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).view(packed.shape[0], -1)


def _as_float16_if_exact_enough(values: torch.Tensor) -> torch.Tensor:
    """float16 where every value is 0 or in float16's normal range (11 significant bits, as GGUF
    stores its scales), else float32: no scale is flushed to zero or kept with a subnormal's fewer
    bits."""
    values = values.float()
    magnitude = values.abs()
    half = torch.finfo(torch.float16)
    fits = ((magnitude == 0) | ((magnitude >= half.tiny) & (magnitude <= half.max))).all()
    return values.to(torch.float16) if fits else values


@dataclass
class CompactMatrix:
    """A QuantizedMatrix in the bytes `kvserve plan` counts for it (quant_linear.served_matrix_bytes),
    for devices where no kernel keeps a layout of its own (CUDA: the layer dequantizes it on each
    call). 4-bit: codes two a byte and, per group, a float16 scale d and offset m, w = d u + m, as
    GGUF's Q4_1 and kvserve's CPU kernel hold them; 8-bit: codes a byte, float16 scales (plus offsets
    where the matrix has zeros). Scales that float16 would not hold stay float32."""

    codes: torch.Tensor  # uint8 [out, in / 2] (4-bit) or int8 [out, in]
    d: torch.Tensor  # [out, in / group_size]
    m: torch.Tensor | None  # like d; None for a symmetric 8-bit matrix
    group_size: int
    bits: int

    @classmethod
    def of(cls, matrix: QuantizedMatrix, device: torch.device | str) -> "CompactMatrix":
        """`matrix` packed where it lies, then moved to `device` (the smaller bytes travel)."""
        scale = matrix.scale.float()
        m = None
        if matrix.bits == 4 or matrix.zero is not None:
            zero = matrix.zero.float() if matrix.zero is not None else torch.zeros_like(scale)
            m = _as_float16_if_exact_enough(zero - matrix.offset * scale).to(device)
        codes = pack_nibbles(matrix.q) if matrix.bits == 4 else matrix.q.to(torch.int8)
        return cls(codes.to(device), _as_float16_if_exact_enough(scale).to(device), m, matrix.group_size, matrix.bits)

    @property
    def shape(self) -> tuple[int, int]:
        rows, columns = self.codes.shape
        return rows, columns * 2 if self.bits == 4 else columns

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.d.nbytes + (self.m.nbytes if self.m is not None else 0)

    def dequantize(self, dtype: torch.dtype = torch.float32, chunk_values: int = 1 << 26) -> torch.Tensor:
        """[out, in] in `dtype`: d u + m computed in float32 (one rounding, then the cast), a block of
        rows at a time, so that the float32 intermediate stays under `chunk_values` values (a large
        LM head's would be gigabytes)."""
        out, columns = self.shape
        weight = torch.empty(out, columns, dtype=dtype, device=self.device)
        step = max(1, chunk_values // columns)
        for start in range(0, out, step):
            rows = slice(start, start + step)
            codes = unpack_nibbles(self.codes[rows]) if self.bits == 4 else self.codes[rows]
            groups = codes.float().view(codes.shape[0], -1, self.group_size).mul_(self.d[rows].float().unsqueeze(-1))
            if self.m is not None:
                groups.add_(self.m[rows].float().unsqueeze(-1))
            weight[rows] = groups.view(codes.shape[0], columns)
        return weight
