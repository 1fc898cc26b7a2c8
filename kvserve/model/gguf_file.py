"""Read a GGUF file (llama.cpp's checkpoint format): metadata, tensor table, dequantized tensors.

The `gguf` package's reader wraps every metadata value of a file in numpy memmap views (hundreds
of thousands for a tokenizer's vocabulary and merges) and dequantizes with numpy in groups of
rows; both take seconds for a 135M model. This reader walks the header once with `struct`, maps
the tensor data, and dequantizes the common formats (F32, F16, BF16, Q4_0, Q4_1, Q8_0) with
vectorised torch ops that give gguf's float32 results bit for bit (same operations, same order).
Other formats (k-quants, ...) still go through `gguf.quants.dequantize`. `quantized_matrix` gives the
matrices kvserve serves quantized as the file stores them (Q4_0, Q4_1, Q8_0, Q4_K; other quantized types as int8).

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.model.quantized import QuantizedMatrix, quantize_int8

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}

# ggml type id -> (values per block, bytes per block) for the types dequantized here.
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
Q4_K = 12  # the k-quant served as its own 4-bit codes (super-blocks of 256 values)
FLOAT_TYPES = (F32, F16, BF16)
_Q4_K_BYTES = 144
_BLOCKS = {F32: (1, 4), F16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), BF16: (1, 2)}


def cuts_by_blocks(type_id: int) -> bool:
    """Whether a tensor-parallel rank can take its share of such a matrix as whole blocks of the
    file (the 32-value blocks of Q4_0, Q4_1 and Q8_0, and float values); other types' blocks (the
    k-quants' 256) may not end where a share does."""
    return type_id in (Q4_0, Q4_1, Q8_0, *FLOAT_TYPES)


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands (the message says why)."""


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order: the row (GGUF's first dimension) last
    type_id: int  # ggml type
    raw: torch.Tensor  # uint8 bytes of the tensor as stored


@dataclass
class GGUFFile:
    fields: dict[str, Any]  # metadata; arrays as lists
    tensors: list[GGUFTensor]
    metadata_sha256: str  # hash of the header and metadata bytes (not the tensor table or data)

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Cursor:
    """Sequential little-endian reads from a buffer."""

    def __init__(self, buffer: Any):
        self.buffer, self.offset = buffer, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        start, self.offset = self.offset, self.offset + length
        return bytes(self.buffer[start:self.offset]).decode("utf-8", errors="replace")

    def value(self, type_id: int) -> Any:
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALAR_FORMATS:  # one struct call for the whole array
                fmt = _SCALAR_FORMATS[item_type][1]
                values = struct.unpack_from(f"<{count}{fmt}", self.buffer, self.offset)
                self.offset += struct.calcsize(f"<{count}{fmt}")
                return list(values)
            return [self.value(item_type) for _ in range(count)]
        if type_id not in _SCALAR_FORMATS:
            raise GGUFFormatError(f"unknown metadata value type {type_id}")
        return self.unpack(_SCALAR_FORMATS[type_id])


def read_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file (version 2 or 3, little-endian). Tensor bytes stay in a private
    copy-on-write map of the file; they are read when dequantized."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    cursor = _Cursor(mapped)
    if bytes(mapped[:4]) != GGUF_MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic)")
    cursor.offset = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 or 3, little-endian)")
    num_tensors, num_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
    fields = {}
    for _ in range(num_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.unpack("<I"))
    metadata_sha256 = hashlib.sha256(mapped[:cursor.offset]).hexdigest()
    table = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
        table.append((name, tuple(reversed(dims)), cursor.unpack("<I"), cursor.unpack("<Q")))
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = -(-cursor.offset // alignment) * alignment
    data = torch.frombuffer(mapped, dtype=torch.uint8)
    tensors = []
    for name, shape, type_id, offset in table:
        size = _byte_size(shape, type_id)
        start = data_start + offset
        if start + size > len(mapped):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file")
        tensors.append(GGUFTensor(name, shape, type_id, data[start:start + size]))
    return GGUFFile(fields, tensors, metadata_sha256)


def _block_layout(type_id: int) -> tuple[int, int]:
    if type_id in _BLOCKS:
        return _BLOCKS[type_id]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"unknown tensor type {type_id}") from None


def _byte_size(shape: tuple[int, ...], type_id: int) -> int:
    values_per_block, bytes_per_block = _block_layout(type_id)
    count = 1
    for dim in shape:
        count *= dim
    if shape and shape[-1] % values_per_block:
        raise GGUFFormatError(f"row of {shape[-1]} values is not whole blocks of {values_per_block}")
    return count // values_per_block * bytes_per_block


def _scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 [blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[blocks, 16] bytes -> float32 [blocks, 32] values: the low nibbles first, then the high ones."""
    values = torch.empty(packed.shape[0], 2 * packed.shape[1])
    values[:, :packed.shape[1]] = packed & 0x0F
    values[:, packed.shape[1]:] = packed >> 4
    return values


def cut_tensor(tensor: GGUFTensor, dim: int, start: int, stop: int) -> GGUFTensor | None:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a matrix as stored, without dequantizing:
    its rows are whole blocks, so a row range is a byte range and a column range that falls on
    block boundaries is the same byte range of every row. None for other types, shapes or cuts
    (the caller dequantizes and cuts then)."""
    if tensor.type_id not in _BLOCKS or len(tensor.shape) != 2:
        return None
    rows, cols = tensor.shape
    values_per_block, bytes_per_block = _BLOCKS[tensor.type_id]
    if dim == 1 and (start % values_per_block or stop % values_per_block):
        return None
    table = tensor.raw.view(rows, cols // values_per_block * bytes_per_block)
    if dim == 0:
        raw, shape = table[start:stop], (stop - start, cols)
    else:
        raw = table[:, start // values_per_block * bytes_per_block: stop // values_per_block * bytes_per_block]
        shape = (rows, stop - start)
    return GGUFTensor(tensor.name, shape, tensor.type_id, raw.contiguous().view(-1))


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor as float32, equal bit for bit to `gguf.quants.dequantize` (the same float32
    operations in the same order). In-place arithmetic: fresh memory is what costs most here."""
    raw, type_id = tensor.raw, tensor.type_id
    if type_id == F32:
        values = raw.view(torch.float32).clone()
    elif type_id in (F16, BF16):
        values = raw.view(torch.float16 if type_id == F16 else torch.bfloat16).float()
    elif type_id in (Q4_0, Q4_1, Q8_0):
        blocks = raw.view(-1, _BLOCKS[type_id][1])
        if type_id == Q8_0:  # d * q, q signed bytes
            values = blocks[:, 2:].view(torch.int8).float().mul_(_scale(blocks, 0))
        elif type_id == Q4_0:  # d * (q - 8)
            values = _nibbles(blocks[:, 2:]).sub_(8).mul_(_scale(blocks, 0))
        else:  # Q4_1: d * q + m
            values = _nibbles(blocks[:, 4:]).mul_(_scale(blocks, 0)).add_(_scale(blocks, 2))
    else:
        import gguf

        row_bytes = _byte_size(tensor.shape[-1:], type_id)
        try:
            array = gguf.quants.dequantize(raw.numpy().reshape(-1, row_bytes), gguf.GGMLQuantizationType(type_id))
        except NotImplementedError:
            kind = gguf.GGMLQuantizationType(type_id).name
            raise ValueError(f"tensor {tensor.name} is stored as {kind}, which kvserve cannot read (the gguf "
                             "package has no dequantization for it)") from None
        values = torch.from_numpy(array.copy())
    return values.reshape(tensor.shape)


def served_bits(type_id: int) -> int | None:
    """The bits a matrix of this type is served at (quantized_matrix); None for float types."""
    if type_id in FLOAT_TYPES:
        return None
    return 4 if type_id in (Q4_0, Q4_1, Q4_K) else 8


def quantized_matrix(tensor: GGUFTensor) -> QuantizedMatrix | None:
    """A Q4_0, Q4_1 or Q8_0 matrix as it is stored (quantized.py maps llama.cpp's blocks onto its
    convention without changing a value); Q4_K's 32-value sub-blocks as 4-bit groups of 32 (their
    scales and minimums multiplied out); any other quantized type (Q5_K and Q6_K, the k-quant
    files' wider tensors; Q2_K, Q3_K, Q5_0, Q5_1, the IQ types) as int8 in groups of 32,
    requantized from the values `gguf` dequantizes: kvserve's kernels take 4-bit groups of 32 and
    int8, and 8 bits hold any of these grids within half a step. None for float types and other
    shapes."""
    type_id = tensor.type_id
    if len(tensor.shape) != 2 or type_id in FLOAT_TYPES:
        return None
    if type_id == Q4_K:
        return _q4_k_matrix(tensor)
    if type_id not in (Q4_0, Q4_1, Q8_0):
        return quantize_int8(dequantize(tensor), group_size=32) if tensor.shape[1] % 32 == 0 else None
    rows, cols = tensor.shape
    blocks = tensor.raw.view(-1, _BLOCKS[type_id][1])
    scale = _scale(blocks, 0).view(rows, cols // 32)
    if type_id == Q8_0:
        return QuantizedMatrix(blocks[:, 2:].view(torch.int8).reshape(rows, cols), scale, None, 32, 8)
    packed = blocks[:, 4:] if type_id == Q4_1 else blocks[:, 2:]
    q = torch.cat((packed & 0x0F, packed >> 4), dim=1).reshape(rows, cols)
    zero = _scale(blocks, 2).view(rows, cols // 32) + 8 * scale if type_id == Q4_1 else None
    return QuantizedMatrix(q, scale, zero, 32, 4)


def _q4_k_matrix(tensor: GGUFTensor) -> QuantizedMatrix:
    """Q4_K (llama.cpp's k-quants): per 256 values a float16 d and dmin, then eight 32-value
    sub-blocks, each with a 6-bit scale s and minimum m (packed in 12 bytes) and 4-bit codes q:
    w = d·s·q − dmin·m, i.e. a Q4_1 group of 32 with scale d·s (exact in float32) and offset −dmin·m."""
    rows, cols = tensor.shape
    blocks = tensor.raw.view(-1, _Q4_K_BYTES)
    d, dmin = _scale(blocks, 0), _scale(blocks, 2)
    packed = blocks[:, 4:16].long()
    low, high = packed[:, :4], packed[:, 4:8]
    scales = torch.cat((low & 63, (packed[:, 8:] & 15) | ((low >> 6) << 4)), dim=1)
    mins = torch.cat((high & 63, (packed[:, 8:] >> 4) | ((high >> 6) << 4)), dim=1)
    codes = blocks[:, 16:].view(-1, 4, 32)  # sub-blocks 2j (low nibbles) and 2j + 1 (high) share 32 bytes
    q = torch.stack((codes & 0x0F, codes >> 4), dim=2).reshape(rows, cols)
    scale = (d * scales.float()).view(rows, cols // 32)
    zero = (8 * scale - (dmin * mins.float()).view(rows, cols // 32))
    return QuantizedMatrix(q, scale, zero, 32, 4)
