"""The tiers below the pool as one store the block manager talks to.

    pool ──(published block about to be reclaimed: copied out, synchronously)──> host tier
    host tier ──(LRU overflow; or directly when there is no host tier)──> writer thread ──> disk tier
    prefix lookup past the pool ──> host tier, then disk tier ──> bytes written into fresh pool blocks

Only the copy out of the pool runs on the engine thread (cheap: one index_select per pool tensor
for all the blocks reclaimed at once); disk writes run on the writer thread, and blocks queued
for it are served from memory until written. Disk reads run on a loader thread (`read_disk_async`):
the scheduler lets a request whose blocks are still being read wait while others run. `flush` (at shutdown) writes the pool's published
blocks and the host tier to disk, so a restarted server finds its prefixes there.
"""
from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvserve.cache.kv_cache import KVCache
from kvserve.cache.kv_events import KVEventLog
from kvserve.cache.tiers.disk import DiskTier, key_path, load_key
from kvserve.cache.tiers.host import HostTier
from kvserve.cache.tiers.writer import BackgroundWriter
from kvserve.units import GiB

DEFAULT_DISK_GIB = 10.0
WRITER_QUEUE_BLOCKS = 1024


@dataclass(frozen=True)
class TierConfig:
    """Sizes in bytes; a tier is off when its size is 0 (host) or its path is None (disk)."""

    host_bytes: int = 0
    disk_path: str | None = None
    disk_bytes: int = int(DEFAULT_DISK_GIB * GiB)
    disk_key: str | None = None  # `auto` or a key file: HMAC-SHA256 blocks (disk.load_key)

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_path is not None


@dataclass(frozen=True)
class TierUsage:
    """Plain numbers for logs, metrics and the dashboard."""

    host_used_bytes: int
    host_capacity_bytes: int
    disk_used_bytes: int
    disk_capacity_bytes: int
    dropped_writes: int
    disk_writes_stopped: bool


class TieredStore:
    def __init__(self, config: TierConfig, kv_cache: KVCache, namespace: str,
                 writer_queue: int = WRITER_QUEUE_BLOCKS):
        self.kv_cache = kv_cache
        self.block_nbytes = kv_cache.block_nbytes
        on_cuda = kv_cache.device.type == "cuda"
        key = (load_key(key_path(config.disk_path, config.disk_key))
               if config.disk_path is not None and config.disk_key is not None else None)
        self.disk = (DiskTier(config.disk_path, hashlib.sha256(namespace.encode()).digest(), config.disk_bytes,
                              self.block_nbytes, key) if config.disk_path is not None else None)
        self.host = (HostTier(config.host_bytes, self.block_nbytes, pin_memory=on_cuda,
                              on_evict=self._spill if self.disk is not None else None)
                     if config.host_bytes > 0 else None)
        self.writer = BackgroundWriter(writer_queue) if self.disk is not None else None
        self.loader = (ThreadPoolExecutor(1, thread_name_prefix="kvserve-kv-loader")
                       if self.disk is not None else None)
        self._pending: dict[bytes, torch.Tensor] = {}  # queued for the disk, not yet written
        self._lock = threading.Lock()
        self.num_offloaded = 0  # blocks copied out of the pool
        self.offload_s = 0.0  # engine-thread time spent copying blocks out (what going down costs a step)

    # ------------------------------------------------------------------ going down
    def offload(self, evicted: list[tuple[int, bytes]]) -> None:
        """Called by the block pool with (block id, hash) of published blocks it is about to reuse,
        while their contents are still intact."""
        start = time.perf_counter()
        try:
            self._offload(evicted)
        finally:
            self.offload_s += time.perf_counter() - start

    def _offload(self, evicted: list[tuple[int, bytes]]) -> None:
        todo = [(block_id, h) for block_id, h in evicted if not self._keep(h)]
        if not todo:
            return
        on_host = self.host is not None
        data = self.kv_cache.read_blocks([block_id for block_id, _ in todo],
                                         None if on_host else torch.device("cpu"))
        self.num_offloaded += len(todo)
        for i, (_, block_hash) in enumerate(todo):
            if on_host:
                self.host.put(block_hash, data[i])
            else:
                self._spill(block_hash, data[i])  # a row of `data`, freed once every row is written

    def _keep(self, block_hash: bytes) -> bool:
        """True if a tier already holds the block (then only its recency is refreshed)."""
        if self.host is not None:
            if self.host.contains(block_hash):
                self.host.touch(block_hash)
                return True
            return False  # the host tier takes it; the disk copy, if any, stays
        return self._on_disk(block_hash)

    def _on_disk(self, block_hash: bytes) -> bool:
        with self._lock:
            if block_hash in self._pending:
                return True
        return self.disk.contains(block_hash)

    def _spill(self, block_hash: bytes, data: torch.Tensor) -> None:
        """Queue one block for the disk tier (host overflow, or offload without a host tier)."""
        if self.disk is None or self.disk.disabled is not None or self._on_disk(block_hash):
            return
        if data.is_pinned():
            self._wait_for_copies()
        with self._lock:
            self._pending[block_hash] = data
        if not self.writer.submit(lambda: self._write(block_hash, data)):
            with self._lock:
                self._pending.pop(block_hash, None)

    def _write(self, block_hash: bytes, data: torch.Tensor) -> None:
        try:
            self.disk.put(block_hash, data)
        finally:
            with self._lock:
                self._pending.pop(block_hash, None)

    # ------------------------------------------------------------------ coming up
    def lookup(self, hashes: list[bytes]) -> list[str]:
        """The tier ("host" or "disk") of each block of the longest run of `hashes` held below the pool."""
        found = []
        for block_hash in hashes:
            if self.host is not None and self.host.contains(block_hash):
                found.append("host")
            elif self.disk is not None and self._on_disk(block_hash):
                found.append("disk")
            else:
                break
        return found

    def fetch(self, hashes: list[bytes]) -> list[tuple[str, torch.Tensor]]:
        """The bytes of the longest run of `hashes` that can be read (and pass the disk checks),
        each with its tier."""
        out = []
        for block_hash in hashes:
            data = self.host.get(block_hash) if self.host is not None else None
            tier = "host"
            if data is None and self.disk is not None:
                tier = "disk"
                with self._lock:
                    data = self._pending.get(block_hash)
                if data is None:
                    data = self.disk.get(block_hash)
            if data is None:
                break
            out.append((tier, data))
        return out

    def fetch_from_memory(self, hashes: list[bytes]) -> list[tuple[str, torch.Tensor]] | None:
        """The bytes of every one of `hashes` from the host tier or the disk writer's queue (blocks
        the pool has just reclaimed are there), each with its tier; None if one is elsewhere."""
        out = []
        for block_hash in hashes:
            found = self._from_memory(block_hash)
            if found is None:
                return None
            out.append(found)
        return out

    def _from_memory(self, block_hash: bytes) -> tuple[str, torch.Tensor] | None:
        data = self.host.get(block_hash) if self.host is not None else None
        if data is not None:
            return "host", data
        with self._lock:
            data = self._pending.get(block_hash)
        return None if data is None else ("disk", data)

    def read_disk_async(self, hashes: list[bytes]) -> Future:
        """Read blocks from the disk tier on the loader thread; the future's result maps each hash
        read (a prefix of `hashes`: reading stops at the first miss) to its bytes."""
        return self.loader.submit(self._read_disk, list(hashes))

    def _read_disk(self, hashes: list[bytes]) -> dict[bytes, torch.Tensor]:
        """Files are read straight into the rows of one buffer (no copy per block)."""
        out = {}
        buffer = torch.empty(len(hashes), self.block_nbytes, dtype=torch.uint8)
        for i, block_hash in enumerate(hashes):
            with self._lock:
                data = self._pending.get(block_hash)
            if data is None:
                data = self.disk.get(block_hash, buffer[i])
            if data is None:
                break
            out[block_hash] = data
        return out

    def load(self, block_ids: list[int], blocks: list[torch.Tensor], hashes: list[bytes] = ()) -> None:
        """Write fetched blocks into the pool. The host tier then lets go of them (`hashes`): the
        pool holds them now, and copies them down again if it reclaims them, so host memory
        holds only blocks the pool does not (disk copies stay: the disk tier is for capacity)."""
        if block_ids:
            self.kv_cache.write_blocks(block_ids, _as_rows(blocks, self.kv_cache.device))
        if self.host is not None:
            for block_hash in hashes:
                self.host.discard(block_hash)

    # ------------------------------------------------------------------ shutdown and usage
    def flush(self, pool_blocks: list[tuple[int, bytes]]) -> int:
        """Write the given published pool blocks and the host tier to disk and wait for the writer;
        returns the blocks written. Nothing without a disk tier."""
        if self.disk is None:
            return 0
        self.writer.drain()
        written = 0
        todo = [(block_id, h) for block_id, h in pool_blocks if not self._on_disk(h)]
        for start in range(0, len(todo), 64):
            chunk = todo[start:start + 64]
            data = self.kv_cache.read_blocks([block_id for block_id, _ in chunk], torch.device("cpu"))
            self._wait_for_copies()
            for i, (_, block_hash) in enumerate(chunk):
                written += self.disk.put(block_hash, data[i])
        self._wait_for_copies()  # the host tier's latest copies too
        for block_hash, data in self.host.items() if self.host is not None else ():
            if not self.disk.contains(block_hash):
                written += self.disk.put(block_hash, data)
        return written

    def _wait_for_copies(self) -> None:
        """Block until the device's queued copies have run: on CUDA, blocks reach host memory
        (read_blocks to the host, the host tier's copies) without blocking, so their bytes may be
        read only after this."""
        if self.kv_cache.device.type == "cuda":
            torch.cuda.current_stream(self.kv_cache.device).synchronize()

    def attach_events(self, log: KVEventLog) -> None:
        """Publish each tier's stored / removed blocks in `log` (kv_events.py), for routers."""
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.attach_events(log)

    def close(self) -> None:
        if self.loader is not None:
            self.loader.shutdown(wait=True, cancel_futures=True)
        if self.writer is not None:
            self.writer.close()

    def usage(self) -> TierUsage:
        host, disk = self.host, self.disk
        return TierUsage(host.used_bytes if host else 0, host.capacity_bytes if host else 0,
                         disk.used_bytes if disk else 0, disk.capacity_bytes if disk else 0,
                         self.writer.num_dropped if self.writer else 0,
                         disk is not None and disk.disabled is not None)


def _as_rows(blocks: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[n, block bytes]: the consecutive rows of one buffer as they are (the loader's usual case),
    else stacked. Blocks in pinned memory (the host tier's, on CUDA) may still be arriving from the
    device (HostTier.put copies without blocking), so they are stacked on `device`, after their
    copies in stream order, never read on the host."""
    first = blocks[0]
    nbytes = first.numel()
    if first.dim() == 1 and all(b.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                                and b.data_ptr() == first.data_ptr() + i * nbytes for i, b in enumerate(blocks)):
        return first.as_strided((len(blocks), nbytes), (nbytes, 1))
    if device.type != "cpu" and any(b.is_pinned() for b in blocks):
        return torch.stack([b.view(-1).to(device, non_blocking=True) for b in blocks])
    return torch.stack([b.view(-1) for b in blocks])
