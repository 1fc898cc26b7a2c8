"""Micro-benchmark: one layer's KV write + gather (+ decode attention) per KV-cache format.

The shape is one decode step of the default model (SmolLM2-135M: 3 KV heads, 9 query heads,
head_dim 64) over a batch of sequences with the same context length: each sequence appends one
token (a write into a partly filled block, the path that may re-encode a block), then the batch's
blocks are gathered and dequantized, then the grouped-query decode attention runs on them
(`paged_attention`, so quantized formats include their query/output rotation). A second case is
a 512-token prefill chunk of one sequence.

    python benchmarks/kv_formats.py [--batch 32] [--context 512] [--threads 2] [--repeat 50]

Best of `--repeat` runs after warm-up; times are per layer (the model has 30).
"""
from __future__ import annotations

import argparse
import time

import torch

from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVCacheSpec
from kvserve.model.attention import AttentionGroup, AttentionMetadata
from kvserve.model.attention.torch_ops import paged_attention

FORMATS = ("bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int4_kivi")


def best_ms(fn, repeat: int) -> float:
    """The fastest of `repeat` runs after warm-up: on a machine shared with other jobs the minimum
    is the stable statistic (interference only ever adds time)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def decode_case(batch: int, context: int, spec: KVCacheSpec, heads: int, dtype: torch.dtype):
    """Inputs of one decode step: each sequence owns `blocks_per_seq` consecutive blocks."""
    bs = spec.block_size
    blocks_per_seq = -(-(context + 1) // bs)
    tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
    slots = tables[:, context // bs] * bs + context % bs
    group = AttentionGroup(block_ids=tables.reshape(-1), seq_lens=torch.full((batch,), context + 1),
                           context_len=blocks_per_seq * bs, max_seq_len=context + 1)
    meta = AttentionMetadata(slot_mapping=slots, decodes=[group], prefills=[])
    q = torch.randn(batch, heads, spec.head_dim, dtype=dtype)
    k = torch.randn(batch, spec.num_kv_heads, spec.head_dim, dtype=dtype)
    return meta, q, k, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=3, head_dim=64, block_size=16)
    heads = 9
    meta, q, k, tables = decode_case(args.batch, args.context, spec, heads, dtype)
    num_blocks = tables.numel() + 64
    prefill_tokens = 512
    prefill_slots = torch.arange(prefill_tokens) + tables.numel() * spec.block_size
    prefill_k = torch.randn(prefill_tokens, spec.num_kv_heads, spec.head_dim, dtype=dtype)
    prefill_ids = torch.arange(tables.numel(), tables.numel() + prefill_tokens // spec.block_size)

    print(f"one layer, {args.batch} sequences x {args.context} context tokens, {args.dtype} compute, "
          f"{args.threads} threads (best of {args.repeat}, ms)")
    header = ("format", "bytes/token", "decode write", "decode gather", "decode attention step",
              "vs bf16", "prefill write 512", "prefill gather 512")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    base = None
    for name in FORMATS:
        fmt = make_kv_format(name, dtype)
        pool = fmt.allocate(spec, num_blocks, torch.device("cpu"))
        # Fill every context slot once (prefill-style) so the decode writes continue real blocks.
        context_slots = (tables[:, :, None] * spec.block_size + torch.arange(spec.block_size)).reshape(args.batch, -1)
        context_slots = context_slots[:, :args.context].reshape(-1)
        filler = torch.randn(context_slots.numel(), spec.num_kv_heads, spec.head_dim, dtype=dtype)
        fmt.write(pool, filler, filler, context_slots)
        batch_ids = meta.decodes[0].block_ids
        t_write = best_ms(lambda: fmt.write(pool, k, k, meta.slot_mapping), args.repeat)
        t_gather = best_ms(lambda: fmt.gather(pool, batch_ids, args.batch, dtype), args.repeat)
        t_step = best_ms(lambda: paged_attention(q, k, k, pool, fmt, meta, None), args.repeat)
        t_pwrite = best_ms(lambda: fmt.write(pool, prefill_k, prefill_k, prefill_slots), args.repeat)
        t_pgather = best_ms(lambda: fmt.gather(pool, prefill_ids, 1, dtype), args.repeat)
        base = base or t_step
        per_token = fmt.bytes_per_block(spec) / spec.block_size
        print(f"| {name} | {per_token:.0f} | {t_write:.3f} | {t_gather:.3f} | {t_step:.3f} | "
              f"{t_step / base:.2f}x | {t_pwrite:.3f} | {t_pgather:.3f} |")


if __name__ == "__main__":
    main()
