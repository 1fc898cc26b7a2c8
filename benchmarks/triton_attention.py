"""Decode attention of the Triton backend against the torch backend, one layer, on CUDA: the K/V
bytes each reads per second beside the GPU's measured copy bandwidth, and fp8 against bfloat16.

Issue 41's targets: bfloat16 decode at 128 requests x 1,024-token contexts reads >= 60% of the
copy bandwidth in K/V bytes; fp8 decode >= 1.6x faster than bfloat16 at 4,096-token contexts.
The shape is one layer of Llama-3.2-1B (32 query heads, 8 KV heads, head_dim 64, blocks of 16),
blocks scattered through the pool as a busy server leaves them.

    python benchmarks/triton_attention.py                      # CUDA
    TRITON_INTERPRET=1 python benchmarks/triton_attention.py --smoke   # CPU dry run of the script

K/V bytes are those a decode must read (codes and scales of every context token), whatever the
backend really moves (the torch backend also writes and re-reads its gathered copy). The copy
bandwidth is (read + written bytes) / time of a 1 GiB device-to-device copy. The Triton figure
times the decode kernels alone (`paged_decode`: the decode kernel and the split merge); the torch
figure, the backend's whole attention step. Device time between CUDA events, L2 evicted before
each run (`timed`). Last, RoPE and the KV store of a decode step as two launches against
`rope_store`'s one (issue 42).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVCache, KVCacheSpec
from kvserve.model.attention import StepSequence, make_attention_backend


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs. On a GPU, device time between CUDA events, as
    triton.testing.do_bench takes it: before each run a 1 GiB memset evicts the L2 cache (so K/V
    come from memory, not from the previous run) and keeps the GPU busy while the host queues
    `fn`'s launches, so the host's own time stays outside the window; one synchronisation at the
    end."""
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    flush = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    torch.cuda.synchronize()
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes read + written per second by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, repeats)


def decode_case(backend_name: str, kv_cache_dtype: str, batch: int, context: int, device: torch.device,
                repeats: int, heads: int = 32, kv_heads: int = 8, head_dim: int = 64,
                block_size: int = 16) -> tuple[float, int]:
    """(median seconds of one layer's decode attention, K/V bytes it must read)."""
    dtype = torch.bfloat16
    spec = KVCacheSpec(1, kv_heads, head_dim, block_size)
    fmt = make_kv_format(kv_cache_dtype, dtype)
    blocks_per_seq = -(-(context + 1) // block_size)
    cache = KVCache(spec, fmt, batch * blocks_per_seq, device)
    all_slots = torch.arange(block_size, (batch * blocks_per_seq + 1) * block_size, device=device)
    for chunk in all_slots.split(1 << 16):  # every slot holds a random token, written by the format
        fmt.write(cache.layers[0], torch.randn(len(chunk), kv_heads, head_dim, device=device, dtype=dtype),
                  torch.randn(len(chunk), kv_heads, head_dim, device=device, dtype=dtype), chunk)
    backend = make_attention_backend(backend_name, fmt, spec, dtype, None, device)
    ids = np.random.default_rng(0).permutation(np.arange(1, batch * blocks_per_seq + 1)).reshape(batch, -1)
    sequences = [StepSequence(str(i), i, 1, context + 1, ids[i]) for i in range(batch)]
    slots = torch.as_tensor(ids[:, context // block_size] * block_size + context % block_size, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, head_dim, device=device, dtype=dtype)
    meta = backend.build(sequences, slots)
    if backend_name == "triton":  # the decode kernels alone (and their split merge), as the target says
        d, out = meta.decode, torch.empty_like(q)
        seconds = timed(lambda: backend.kernels.paged_decode(
            backend.kind, q, out, cache.layers[0], d.block_tables, d.seq_lens, d.max_seq_len, None,
            backend.split_tokens, backend.max_splits, backend.interpreting, backend.fp8), device, repeats)
    else:  # torch ops: the layer's attention step (its small store included; the gather is the cost)
        seconds = timed(lambda: backend.attend(q, k, v, cache.layers[0], fmt, meta, None), device, repeats)
    kv_bytes = batch * (context + 1) * fmt.bytes_per_block(spec) // block_size
    return seconds, kv_bytes


def rope_store_case(tokens: int, device: torch.device, repeats: int, heads: int = 32, kv_heads: int = 8,
                    head_dim: int = 64, block_size: int = 16) -> tuple[float, float]:
    """(seconds of RoPE then the store as two launches, seconds of `rope_store`'s one) for a decode
    step of `tokens` sequences, one layer, bfloat16 model and KV: issue 42's "RoPE applied with the
    store"."""
    from kvserve.model import fused_ops

    dtype = torch.bfloat16
    spec = KVCacheSpec(1, kv_heads, head_dim, block_size)
    fmt = make_kv_format("auto", dtype)
    cache = KVCache(spec, fmt, tokens + 1, device)
    backend = make_attention_backend("triton", fmt, spec, dtype, None, device)
    kv, aux = backend._pool_tensors(cache.layers[0])
    k = backend.kernels
    packed = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=device, dtype=dtype)
    cos, sin = (torch.rand(tokens, 1, head_dim, device=device, dtype=dtype) for _ in range(2))
    slots = torch.arange(block_size, block_size + tokens, device=device)

    def apart():
        query, key = fused_ops.rotary(packed[:, : heads + kv_heads], cos, sin).split((heads, kv_heads), dim=1)
        k.store_kv(backend.kind, key, packed[:, heads + kv_heads:], slots, kv, aux)

    together = lambda: k.rope_store(backend.kind, packed, heads, cos, sin, slots, kv, aux)  # noqa: E731
    return timed(apart, device, repeats), timed(together, device, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU dry run under TRITON_INTERPRET=1)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch, short, long_ = (4, 64, 160) if args.smoke else (128, 1024, 4096)
    repeats = 2 if args.smoke else args.repeats
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreter: timings meaningless)"
    print(f"device: {name}; one layer of a 1B-shaped Llama (32 heads, 8 KV heads, head_dim 64, block 16)")
    bandwidth = copy_bandwidth(device, (16 << 20) if args.smoke else (1 << 30), repeats)
    print(f"copy bandwidth: {bandwidth / 1e9:,.0f} GB/s (read + written)")
    results = {}
    for backend in ("triton", "torch"):
        for kv_cache_dtype, context in (("auto", short), ("auto", long_), ("fp8", long_)):
            seconds, kv_bytes = decode_case(backend, kv_cache_dtype, batch, context, device, repeats)
            results[backend, kv_cache_dtype, context] = seconds
            print(f"{backend:6} {kv_cache_dtype:4} batch {batch} x context {context:5}: {seconds * 1e6:9.1f} us, "
                  f"K/V {kv_bytes / seconds / 1e9:8,.0f} GB/s = {kv_bytes / seconds / bandwidth:6.1%} of copy")
    for backend in ("triton", "torch"):
        ratio = results[backend, "auto", long_] / results[backend, "fp8", long_]
        print(f"{backend}: fp8 vs bfloat16 at context {long_}: {ratio:.2f}x faster")
    apart, together = rope_store_case(batch, device, repeats)
    print(f"RoPE + store, decode of {batch}, one layer: two launches {apart * 1e6:.1f} us, "
          f"rope_store {together * 1e6:.1f} us")


if __name__ == "__main__":
    main()
