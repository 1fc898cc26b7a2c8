"""How long the disk tier takes to read a request's blocks while the engine thread is busy (issue 21).

The loader thread reads block files while the engine thread steps other requests. Both are Python
threads of one process: each time the loader comes back from a call that released the GIL (open,
read, the checksum, utime) it may wait for the engine thread to give the GIL up. This measures the
time to read `--blocks` block files of the default model's KV layout (files in the OS page cache,
as right after they were written) on the loader thread, alone and beside an engine decoding a
batch of requests in the main thread; medians over `--rounds`. Each round reads two tiers side by
side: the default CRC-32 files and files authenticated with HMAC-SHA256 (--kv-offloading-disk-key),
and times writing the blocks of each.

    python benchmarks/disk_tier_reads.py [--blocks 80] [--rounds 7] [--batch 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import secrets
import statistics
import sys
import tempfile
import threading
import time

import torch

from kvserve.cache.tiers.disk import DiskTier
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams


def write_blocks(tier: DiskTier, count: int) -> tuple[list[bytes], float]:
    """The blocks' hashes, and the seconds their writes took."""
    hashes = [hashlib.sha256(f"block {i}".encode()).digest() for i in range(count)]
    blocks = [torch.randint(0, 256, (tier.block_nbytes,), dtype=torch.uint8) for _ in hashes]
    start = time.perf_counter()
    for h, block in zip(hashes, blocks):
        tier.put(h, block)
    return hashes, time.perf_counter() - start


def read_all(tier: DiskTier, hashes: list[bytes]) -> float:
    """Seconds to read every block into the rows of one buffer, as the loader thread does."""
    buffer = torch.empty(len(hashes), tier.block_nbytes, dtype=torch.uint8)
    start = time.perf_counter()
    for i, h in enumerate(hashes):
        if tier.get(h, buffer[i]) is None:
            raise RuntimeError("a block file failed to read")
    return time.perf_counter() - start


def read_on_thread(tier: DiskTier, hashes: list[bytes], busy: LLMEngine | None) -> float:
    """Read on a second thread; meanwhile the calling thread steps `busy` (if given)."""
    result: list[float] = []
    reader = threading.Thread(target=lambda: result.append(read_all(tier, hashes)))
    if busy is not None:
        for _ in range(3):
            busy.step()  # decoding, not prefilling, when the read starts
    reader.start()
    while reader.is_alive():
        if busy is not None and busy.has_unfinished_requests():
            busy.step()
        else:
            time.sleep(0.001)
    reader.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the run, seconds (Python's default: 0.005)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    engine = LLMEngine(EngineArgs(kv_cache_memory="256MiB", max_model_len=2048))
    block_nbytes = engine.kv_cache.block_nbytes
    modes = {"crc32": None, "hmac_sha256": secrets.token_bytes(32)}
    times: dict[str, dict[str, list[float]]] = {m: {"alone": [], "busy": [], "write": []} for m in modes}
    with tempfile.TemporaryDirectory(prefix="kvserve-disk-reads-") as root:
        tiers = {m: DiskTier(f"{root}/{m}", hashlib.sha256(b"bench").digest(), 2 ** 34, block_nbytes, key)
                 for m, key in modes.items()}
        hashes = {}
        for _ in range(args.rounds):
            for mode, tier in tiers.items():
                hashes[mode], written = write_blocks(tier, args.blocks)
                times[mode]["write"].append(written)
                times[mode]["alone"].append(read_on_thread(tier, hashes[mode], None))
                for i in range(args.batch):
                    engine.add_request(list(range(100 + i, 164 + i)),
                                       SamplingParams(temperature=0, max_tokens=1_900, ignore_eos=True), f"r{i}")
                times[mode]["busy"].append(read_on_thread(tier, hashes[mode], engine))
                for i in range(args.batch):
                    engine.abort_request(f"r{i}")
    result = {
        "blocks": args.blocks, "block_bytes": block_nbytes, "batch": args.batch, "rounds": args.rounds,
        **{f"{mode}_{what}_per_block_ms": 1e3 * statistics.median(t[what]) / args.blocks
           for mode, t in times.items() for what in ("write", "alone", "busy")},
        "all": times, "switch_interval_s": sys.getswitchinterval(),
        "cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
        "dtype": str(engine.dtype),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "all"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
