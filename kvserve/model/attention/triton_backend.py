"""The Triton backend (`--attention-backend triton`; `auto` on CUDA): paged attention whose kernels
(triton_kernels.py) read every KV format where it lies, with no gather.

Per layer and step: one store launch writes the step's K/V into the pool (quantizing on the way;
with the CUDA fused ops it also applies RoPE to q and k, `rope_store`), one decode launch covers
every decode of the step (plus a split-merge launch when a context is longer than one split), one
prefill launch covers every prefill chunk, prefix hits included.
Sequences under KV eviction store their keys before RoPE and may have their attention observed:
the torch backend's code serves those (gathered), and the start-up log says so. int4_kivi's keys,
whose block-wide channel ranges grow as a block fills, are written by the format's torch ops.

On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1): slow, for tests, and the way CI
proves these kernels against the torch backend without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.cache.formats.fp8 import Fp8Format
from kvserve.cache.formats.full_precision import FullPrecisionFormat
from kvserve.cache.formats.int4 import Int4Format
from kvserve.cache.formats.int4_kivi import Int4KiviFormat
from kvserve.cache.formats.int8 import Int8Format
from kvserve.cache.kv_cache import KVFormat
from kvserve.hardware import triton_unavailable
from kvserve.model.attention.base import BackendConfig
from kvserve.model.attention.metadata import AttentionMetadata, StepSequence, attended_sequences
from kvserve.model.attention.torch_backend import TorchBackend, padded_block_tables
from kvserve.model.attention.torch_ops import decode_gathered, prefills_gathered

# Context tokens per split of a decode (flash-decoding), and the most splits a decode is cut into
# (longer contexts take longer splits, triton_kernels.split_length): the splits depend on the
# sequence's own length only, and a CUDA graph's partial sums stay bounded (64 splits each).
SPLIT_TOKENS = 512
MAX_SPLITS = 64
PREFILL_BLOCK_M = 32  # query rows per prefill program


def layout_kind(kv_format: KVFormat) -> int | None:
    """The kernels' KIND for a format (triton_kernels.FLOAT...), None for one they cannot read."""
    kinds = {FullPrecisionFormat: 0, Int8Format: 1, Fp8Format: 2, Int4Format: 3, Int4KiviFormat: 4}
    return kinds.get(type(kv_format))


@dataclass
class TritonDecode:
    """Every decode of the step not under eviction: rows [0, batch) of the packed batch."""

    block_tables: torch.Tensor  # [batch, blocks] int64, padded with the null block
    seq_lens: torch.Tensor  # [batch] int64
    max_seq_len: int


@dataclass
class TritonPrefill:
    """Every prefill chunk not under eviction, and the (chunk, first query) tiles covering them."""

    block_tables: torch.Tensor  # [chunks, blocks] int64, padded with the null block
    chunk_row: torch.Tensor  # [chunks] first packed row
    chunk_queries: torch.Tensor  # [chunks]
    chunk_context: torch.Tensor  # [chunks] context tokens once the chunk is written
    tile_chunk: torch.Tensor  # [tiles]
    tile_start: torch.Tensor  # [tiles] first query of the tile within its chunk


@dataclass
class TritonMetadata(AttentionMetadata):
    decode: TritonDecode | None = None
    prefill: TritonPrefill | None = None


class TritonBackend(TorchBackend):
    """Paged attention in Triton kernels over the pool in place."""

    name = "triton"
    auto_devices = ("cuda",)
    captures_decodes = True

    def __init__(self, config: BackendConfig):
        super().__init__(config)
        from kvserve.model.attention import triton_kernels  # triton is imported only when chosen

        self.kernels = triton_kernels
        self.kind = layout_kind(config.kv_format)
        self.fp8 = config.kv_format.name.removeprefix("fp8_") if isinstance(config.kv_format, Fp8Format) else "e4m3"
        self.interpreting = config.device.type == "cpu"
        self.split_tokens = SPLIT_TOKENS
        self.max_splits = MAX_SPLITS
        self.prefill_block_m = PREFILL_BLOCK_M
        # Whether the step's keys may be rotated as they are stored (`forward`): the kernels write
        # them, and the format turns no basis between RoPE and the pool.
        cpu = torch.device("cpu")
        self.stores_with_rope = (self.kind != self.kernels.INT4_KIVI
                                 and config.kv_format.rotation(config.spec.head_dim, torch.float32, cpu) is None)

    @classmethod
    def unsupported(cls, config: BackendConfig) -> str | None:
        why = triton_unavailable(config.device.type)
        if why is not None:
            return why
        if layout_kind(config.kv_format) is None:
            return f"no Triton kernel reads a {config.kv_format.name} KV cache in place"
        dim, block = config.spec.head_dim, config.spec.block_size
        if dim < 32 or dim & (dim - 1):
            return f"the Triton kernels take a power-of-two head_dim of 32 or more, not {dim}"
        if block < 16 or block & (block - 1):
            return f"the Triton kernels take a power-of-two block size of 16 or more, not {block}"
        return None

    @property
    def description(self) -> str:
        notes = ["sequences under KV eviction gathered by torch ops"]
        if self.kind == self.kernels.INT4_KIVI:
            notes.append("int4_kivi keys written by torch ops")
        mode = " under the interpreter" if self.interpreting else ""
        return f"Triton paged kernels (in place{mode}; {'; '.join(notes)})"

    # ------------------------------------------------------------------ metadata
    def build(self, sequences: list[StepSequence], slot_mapping: torch.Tensor) -> TritonMetadata:
        # (--deterministic: every query row through the decode kernel, with its fixed splits)
        sequences = attended_sequences(sequences, self.config.deterministic)
        base = super().build(sequences, slot_mapping)
        meta = TritonMetadata(**{f: getattr(base, f) for f in AttentionMetadata.__dataclass_fields__})
        decodes = [s for s in sequences if s.is_decode and not s.keys_before_rope]
        if decodes:
            meta.decode = TritonDecode(self._padded_tables(decodes), self._tensor([s.seq_len for s in decodes]),
                                       max(s.seq_len for s in decodes))
        chunks = [s for s in sequences if not s.is_decode and not self._gathers_chunk(s)]
        if chunks:
            tiles = [(i, start) for i, s in enumerate(chunks)
                     for start in range(0, s.num_queries, self.prefill_block_m)]
            meta.prefill = TritonPrefill(
                self._padded_tables(chunks), self._tensor([s.row_start for s in chunks]),
                self._tensor([s.num_queries for s in chunks]), self._tensor([s.seq_len for s in chunks]),
                self._tensor([t[0] for t in tiles]), self._tensor([t[1] for t in tiles]))
        return meta

    def graph_metadata(self, slot_mapping, block_tables, seq_lens, max_seq_len):
        """The decode kernel over the given tensors with as many splits as `max_seq_len` needs: a
        split past a sequence's end contributes nothing, so each result is the eager step's."""
        return TritonMetadata(slot_mapping, decodes=[], prefills=[], backend=self,
                              decode=TritonDecode(block_tables, seq_lens, max_seq_len))

    def decode_scratch_bytes(self, rows, query_heads, max_seq_len):
        k = self.kernels
        splits = k.decode_splits(max_seq_len, self.split_tokens, self.max_splits)
        if splits == 1:
            return 0
        dim = self.spec.head_dim
        return k.partials_bytes(k.slice_rows(rows, query_heads, splits, dim), query_heads, splits, dim)

    # The torch backend's metadata keeps only what the kernels do not serve: sequences under eviction.
    def _gathers_chunk(self, seq: StepSequence) -> bool:
        return seq.keys_before_rope or seq.observed_rows is not None

    def _decode_runs(self, decode):
        return []

    def _padded_tables(self, members: list[StepSequence]) -> torch.Tensor:
        return self._tensor(padded_block_tables(members, self.block_size))

    # ------------------------------------------------------------------ attention
    def forward(self, layer, heads, rope, kv_cache, meta):
        """With the CUDA fused ops installed, RoPE is applied with the store (`rope_store`: one
        launch rotates the queries and writes the rotated keys and the values) wherever nothing
        comes between the rotation and the store: no key centre or fitted basis on the layer, no
        Hadamard rotation or torch-written keys in the format, no keys kept before RoPE this step.
        Otherwise the interface's path: RoPE, the key transforms, then `attend`."""
        if (layer.fused is None or not self.stores_with_rope or layer.key_center is not None
                or layer.key_basis is not None or meta.unrotated_key_rows is not None):
            return super().forward(layer, heads, rope, kv_cache, meta)
        pool = kv_cache.layers[layer.layer_idx]
        query = self.kernels.rope_store(self.kind, heads, layer.num_heads, *rope, meta.slot_mapping,
                                        *self._pool_tensors(pool), self.fp8)
        return self._attend_stored(query, pool, kv_cache.format, meta, layer.window)

    def attend(self, query, key, value, pool, kv_format, meta, window):
        self._write(key, value, pool, kv_format, meta.slot_mapping)
        return self._attend_stored(query, pool, kv_format, meta, window)

    def _attend_stored(self, query: torch.Tensor, pool: dict[str, torch.Tensor], kv_format: KVFormat,
                       meta: TritonMetadata, window: int | None) -> torch.Tensor:
        """Attention for the packed batch over a pool that already holds the step's K/V."""
        k = self.kernels
        rotation = kv_format.rotation(query.shape[-1], query.dtype, query.device)
        if rotation is not None:  # the pool holds K·R and V·R: (qR)·(kR) = q·k
            query = kv_format.rotate_rows(query, rotation)
        tokens, heads, dim = query.shape
        out = torch.empty(tokens, heads, dim, dtype=query.dtype, device=query.device)
        if meta.decode is not None:
            d = meta.decode
            batch = d.seq_lens.shape[0]
            k.paged_decode(self.kind, query[:batch], out[:batch], pool, d.block_tables, d.seq_lens, d.max_seq_len,
                           window, self.split_tokens, self.max_splits, self.interpreting, self.fp8)
        if meta.prefill is not None:
            p = meta.prefill
            k.paged_prefill(self.kind, query, out, pool, p.block_tables, p.tile_chunk, p.tile_start, p.chunk_row,
                            p.chunk_queries, p.chunk_context, window, self.prefill_block_m, self.interpreting,
                            self.fp8)
        if meta.evicting_decode is not None:
            group = meta.evicting_decode
            start = 0 if meta.decode is None else meta.decode.seq_lens.shape[0]
            out[start: start + group.num_requests] = decode_gathered(
                query[start: start + group.num_requests], group, pool, kv_format, rotation, window)
        for chunk, chunk_out in zip(meta.prefills, prefills_gathered(query, meta.prefills, pool, kv_format,
                                                                      rotation, window)):
            out[chunk.row_start: chunk.row_start + chunk.num_queries] = chunk_out
        if rotation is not None:  # probs·(VR)·R^T = probs·V
            out = kv_format.rotate_rows(out, rotation.T)
        return out.reshape(tokens, heads * dim)

    def _write(self, key: torch.Tensor, value: torch.Tensor, pool: dict[str, torch.Tensor], kv_format: KVFormat,
               slot_mapping: torch.Tensor) -> None:
        """The step's K/V into the pool: the store kernel, after the format's rotation if it has one."""
        k = self.kernels
        if self.kind == k.INT4_KIVI:
            kv_format.write(pool, key, value, slot_mapping)
            return
        rotation = kv_format.rotation(key.shape[-1], torch.float32, key.device)
        if rotation is not None:
            both = kv_format.rotate_rows(torch.cat((key, value), dim=1).float(), rotation)
            key, value = both[:, : key.shape[1]], both[:, key.shape[1]:]
        key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))
        k.store_kv(self.kind, key, value, slot_mapping, *self._pool_tensors(pool), self.fp8)

    def _pool_tensors(self, pool: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(codes, per-token scales or None) as the store kernels take them."""
        k = self.kernels
        aux = {k.FLOAT: None, k.INT8: "kv_scale", k.FP8: "kv_scale", k.INT4: "kv_params"}[self.kind]
        kv = pool["kv"].view(torch.int8) if self.kind in (k.INT8, k.FP8) else pool["kv"]
        return kv, None if aux is None else pool[aux]
