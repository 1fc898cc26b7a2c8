"""KV offload tiers (issue 21): blocks the pool reclaims go to host memory and disk and come back on
a prefix hit with identical outputs; every KV dtype round-trips bit for bit; a bad disk file is a
miss; a failing disk stops writing while serving goes on; nothing leaks."""
from __future__ import annotations

import errno
import logging
import os
import random
import stat

import pytest
import torch

from kvserve import SamplingParams
from kvserve.cache.formats import KV_CACHE_DTYPES, make_kv_format
from kvserve.cache.kv_cache import KVCache, KVCacheSpec
from kvserve.cache.tiers import DiskTier, HostTier, TierConfig, TieredStore
from kvserve.cache.tiers import disk as disk_module
from kvserve.engine.args import EngineArgs
from kvserve.engine.kv_identity import weights_fingerprint
from kvserve.engine.llm_engine import LLMEngine

BLOCK = 16
# The tiny model (2 layers, 2 KV heads of 16) in float32 takes 512 bytes per token: 8 KiB a block.
TOKEN_BYTES = 512
POOL_BLOCKS = 40
GIB = 1 << 30


def engine_for(model, **options) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model), dtype="float32", kv_cache_memory=POOL_BLOCKS * BLOCK * TOKEN_BYTES,
                                max_model_len=512, **options))


def multi_turn(engine: LLMEngine, sessions: int = 5, turns: int = 3, seed: int = 0) -> list[list[int]]:
    """Sessions sharing a 64-token system prompt take turns one after the other; each turn resends
    the whole conversation plus 48 new tokens and gets 8 greedy tokens. The pool holds fewer
    blocks than the sessions' histories, so each turn reclaims others' cached blocks."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(64)]
    history = {s: list(system) for s in range(sessions)}
    outputs = []
    for turn in range(turns):
        for s in range(sessions):
            prompt = history[s] + [rng.randrange(3, 500) for _ in range(48)]
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), f"{s}-{turn}")
            tokens = None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        tokens = list(out.outputs[0].token_ids)
            outputs.append(tokens)
            history[s] = prompt + tokens
    return outputs


@pytest.fixture(scope="module")
def baseline(tiny_llama) -> list[list[int]]:
    engine = engine_for(tiny_llama)
    return multi_turn(engine)


def assert_no_leak(engine: LLMEngine) -> None:
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    tiers = engine.tiers
    if tiers is not None:
        if tiers.writer is not None:
            tiers.writer.drain()
        assert not tiers._pending
        if tiers.host is not None:
            assert tiers.host.used_bytes <= tiers.host.capacity_bytes
            assert all(t.numel() == tiers.block_nbytes for _, t in tiers.host.items())


def test_multi_turn_outputs_identical_with_hits_from_each_tier(tiny_llama, baseline, tmp_path):
    engine = engine_for(tiny_llama, kv_offloading_size=6 * BLOCK * TOKEN_BYTES / GIB,
                        kv_offloading_disk_path=str(tmp_path / "kv"))
    assert multi_turn(engine) == baseline
    stats = engine.kv_manager.stats
    assert stats.tier_hits["host"] > 0 and stats.tier_hits["disk"] > 0
    assert stats.external_hits == stats.tier_hits["host"] + stats.tier_hits["disk"] <= stats.external_queries
    assert_no_leak(engine)
    engine.close()
    # Block files are private to the user that runs the server.
    namespace_dir = next((tmp_path / "kv").iterdir())
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
    files = list(namespace_dir.rglob("*.kvb"))
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)


def test_a_restarted_engine_serves_its_prefixes_from_disk(tiny_llama, baseline, tmp_path):
    options = dict(kv_offloading_disk_path=str(tmp_path / "kv"))
    first = engine_for(tiny_llama, **options)
    assert multi_turn(first) == baseline
    first.close()  # flushes the pool's cached blocks to disk
    second = engine_for(tiny_llama, **options)
    assert multi_turn(second) == baseline
    assert second.kv_manager.stats.tier_hits["disk"] > 0
    assert_no_leak(second)
    second.close()


def test_closing_after_a_failed_step_writes_no_block_the_step_never_computed(tiny_llama, tmp_path):
    """A prefill's blocks are published when it is scheduled; if its forward pass fails and the
    engine is then closed, the shutdown flush must not write them to disk, where a restarted
    engine would read them as the prompt's K/V."""
    options = dict(kv_offloading_disk_path=str(tmp_path / "kv"))
    engine = engine_for(tiny_llama, **options)
    prompt = list(range(10, 10 + 4 * BLOCK + 1))
    real_launch = engine.runner.launch

    def fail(*args, **kwargs):
        raise RuntimeError("injected fault")

    engine.runner.launch = fail
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "failed")
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.runner.launch = real_launch
    engine.close()
    assert not list((tmp_path / "kv").rglob("*.kvb"))


def test_a_failing_disk_stops_writing_and_serving_goes_on(tiny_llama, baseline, tmp_path, monkeypatch, caplog):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    engine = engine_for(tiny_llama, kv_offloading_disk_path=str(tmp_path / "kv"))
    monkeypatch.setattr(disk_module, "_create_file", no_space)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert multi_turn(engine) == baseline
    assert engine.tiers.disk.disabled is not None
    assert sum("writes stopped" in r.getMessage() for r in caplog.records) == 1
    assert engine.tiers.usage().disk_writes_stopped
    assert_no_leak(engine)
    engine.close()


def test_a_full_file_system_lowers_the_bound_and_writing_goes_on(tiny_llama, baseline, tmp_path, monkeypatch,
                                                                    caplog):
    """ENOSPC before the bound (a file system smaller than the tier, or filled by others): the
    least recently used files make room, the bound comes down to what fits, writes go on."""
    create, limit = disk_module._create_file, 3

    def small_file_system(name, dir_fd):
        if len(list((tmp_path / "kv").rglob("*.kvb"))) >= limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return create(name, dir_fd)

    engine = engine_for(tiny_llama, kv_offloading_disk_path=str(tmp_path / "kv"))
    monkeypatch.setattr(disk_module, "_create_file", small_file_system)
    bound = engine.tiers.disk.max_bytes
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert multi_turn(engine) == baseline
    disk = engine.tiers.disk
    assert disk.disabled is None and disk.num_evicted_files > 0 and disk.max_bytes < bound
    assert any("file system is full" in r.getMessage() for r in caplog.records)
    assert len(list((tmp_path / "kv").rglob("*.kvb"))) <= limit
    assert_no_leak(engine)
    engine.close()


def test_an_unusable_disk_directory_fails_at_start_up(tiny_llama, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="kv-offloading-disk-path"):
        engine_for(tiny_llama, kv_offloading_disk_path=str(not_a_dir))


def test_a_host_tier_smaller_than_one_block_fails_at_start_up(tiny_llama):
    with pytest.raises(ValueError, match=r"^--kv-offloading-size 1e-09 GiB holds no KV block: one block takes "):
        engine_for(tiny_llama, kv_offloading_size=1e-9)


@pytest.mark.parametrize("options", [dict(kv_offloading_size=-1.0), dict(kv_offloading_disk_size=0),
                                     dict(kv_offloading_disk_size=5.0),  # no --kv-offloading-disk-path to size
                                     dict(kv_offloading_size=1.0, enable_prefix_caching=False)])
def test_bad_tier_options_are_refused(options):
    with pytest.raises(ValueError, match="kv-offloading|prefix"):
        EngineArgs(**options).validate()


# ---------------------------------------------------------------------- the tiers without a model
def random_cache(kv_dtype: str, num_blocks: int = 6) -> KVCache:
    cache = KVCache(KVCacheSpec(2, 2, 16, BLOCK), make_kv_format(kv_dtype, torch.float32), num_blocks,
                    torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        for t in layer.values():
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return cache


def block_bytes(cache: KVCache, block_id: int) -> list[torch.Tensor]:
    return [t.view(torch.uint8)[:, block_id].clone() for layer in cache.layers for t in layer.values()]


def assert_same_block(cache: KVCache, a: int, b: int) -> None:
    assert all(torch.equal(x, y) for x, y in zip(block_bytes(cache, a), block_bytes(cache, b)))


@pytest.mark.parametrize("kv_dtype", sorted(set(KV_CACHE_DTYPES) - {"auto"}))
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_every_kv_dtype_round_trips_bit_exactly(kv_dtype, tier, tmp_path):
    cache = random_cache(kv_dtype)
    config = TierConfig(host_bytes=GIB) if tier == "host" else TierConfig(disk_path=str(tmp_path))
    store = TieredStore(config, cache, "ns")
    hashes = [bytes([i]) * 32 for i in range(3)]
    store.offload([(1, hashes[0]), (2, hashes[1]), (3, hashes[2])])
    if store.writer is not None:
        store.writer.drain()
        assert len(list(tmp_path.rglob("*.kvb"))) == 3
    assert store.lookup(hashes + [b"\xff" * 32]) == [tier] * 3
    fetched = store.fetch(hashes)
    store.load([4, 5, 6], [data for _, data in fetched])
    for src, dst in ((1, 4), (2, 5), (3, 6)):
        assert_same_block(cache, src, dst)
    store.close()


def disk_with_block(tmp_path, namespace: bytes = b"n" * 32) -> tuple[DiskTier, bytes, torch.Tensor]:
    tier = DiskTier(tmp_path, namespace, GIB, 64)
    block_hash, data = b"h" * 32, torch.arange(64, dtype=torch.uint8)
    tier.put(block_hash, data)
    return tier, block_hash, data


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "flip a header byte"])
def test_a_damaged_disk_block_is_a_miss_with_a_warning(tmp_path, damage, caplog):
    tier, block_hash, data = disk_with_block(tmp_path)
    path = tier.path(block_hash)
    assert torch.equal(tier.get(block_hash), data)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:-10]
    else:
        raw[-5 if damage == "flip a payload byte" else 5] ^= 0x40
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert tier.get(block_hash) is None
    assert len(caplog.records) == 1 and tier.num_bad_files == 1
    assert not path.exists()  # removed, so a good copy can be written again


def test_a_block_of_another_namespace_is_never_read(tmp_path, caplog):
    ours, block_hash, _ = disk_with_block(tmp_path, b"a" * 32)
    foreign = DiskTier(tmp_path, b"b" * 32, GIB, 64)
    assert not foreign.contains(block_hash) and foreign.get(block_hash) is None
    # Even a foreign file copied under our name fails its header check.
    foreign.path(block_hash).parent.mkdir(parents=True, exist_ok=True)
    foreign.path(block_hash).write_bytes(ours.path(block_hash).read_bytes())
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert foreign.get(block_hash) is None
    assert "another model" in caplog.text


def test_the_model_fingerprint_follows_the_weights(tiny_llama, tmp_path):
    import shutil
    copy = tmp_path / "model"
    shutil.copytree(tiny_llama, copy)
    assert weights_fingerprint(copy) == weights_fingerprint(tiny_llama)
    weights = next(copy.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1  # one bit of the last tensor
    weights.write_bytes(bytes(raw))
    assert weights_fingerprint(copy) != weights_fingerprint(tiny_llama)


def test_a_half_written_file_is_never_read(tmp_path):
    """A writer killed mid-write leaves only a temporary file, which no lookup reads."""
    tier, block_hash, data = disk_with_block(tmp_path)
    tier.path(block_hash).unlink()
    partial = tier.path(block_hash).parent / (disk_module.TMP_PREFIX + "killed")
    partial.write_bytes(b"KVSB" + bytes(20))
    assert not tier.contains(block_hash) and tier.get(block_hash) is None


def test_the_disk_bound_evicts_least_recently_used_files(tmp_path):
    file_bytes = disk_module.HEADER.size + 64
    tier = DiskTier(tmp_path, b"n" * 32, 10 * file_bytes, 64)
    hashes = [bytes([i]) * 32 for i in range(30)]
    for i, h in enumerate(hashes):
        tier.put(h, torch.full((64,), i, dtype=torch.uint8))
        os.utime(tier.path(h), (1000 + i, 1000 + i))
        if i == 5:
            tier.get(hashes[0])  # touched: now the most recent
    assert tier.used_bytes <= 10 * file_bytes
    assert sum(f.stat().st_size for f in tmp_path.rglob("*.kvb")) == tier.used_bytes
    assert tier.contains(hashes[-1]) and not tier.contains(hashes[1])


def test_host_overflow_spills_to_the_next_tier():
    spilled = []
    host = HostTier(2 * 64, 64, on_evict=lambda h, d: spilled.append(h))
    for i in range(3):
        host.put(bytes([i]) * 32, torch.zeros(64, dtype=torch.uint8))
    assert spilled == [bytes([0]) * 32] and host.used_bytes == 128


def test_a_request_waiting_for_disk_reads_does_not_hold_up_others(tmp_path, monkeypatch):
    """Scheduler and block manager without a model: a prefix that is on disk only is read on the
    loader thread while a request queued behind it runs; it is admitted with its hit once read."""
    import threading

    from kvserve.cache.kv_cache_manager import KVCacheManager
    from kvserve.engine.request import Request
    from kvserve.engine.scheduler import Scheduler, SchedulerConfig

    cache = random_cache("float32", num_blocks=8)
    store = TieredStore(TierConfig(disk_path=str(tmp_path)), cache, "ns")
    kv = KVCacheManager(8, BLOCK, True, "ns", tiers=store)
    scheduler = Scheduler(SchedulerConfig(8, 256, 256), kv)

    def request(rid: str, tokens: list[int]) -> Request:
        return Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True))

    def run(*requests: Request) -> list[list[str]]:
        for r in requests:
            scheduler.add(r)
        steps = []
        while scheduler.has_unfinished():
            scheduled = scheduler.schedule()
            steps.append([s.request.request_id for s in scheduled])
            scheduler.update(scheduled, {s.request.request_id: 1 for s in scheduled if s.samples})
        return steps

    shared = list(range(3 * BLOCK + 1))
    run(request("first", shared))
    run(request("filler", list(range(100, 100 + 8 * BLOCK - 1))))  # reclaims every block: first's go to disk
    store.writer.drain()
    released = threading.Event()
    slow_get = store.disk.get
    monkeypatch.setattr(store.disk, "get", lambda h, out=None: released.wait(30) and slow_get(h, out))
    again, other = request("again", shared), request("other", list(range(300, 300 + BLOCK)))
    scheduler.add(again)
    scheduler.add(other)
    assert [s.request.request_id for s in scheduler.schedule()] == ["other"]
    released.set()
    store.loader.submit(lambda: None).result()  # the read has finished
    scheduled = scheduler.schedule()
    assert [s.request.request_id for s in scheduled] == ["other", "again"]
    assert again.num_cached_tokens == 3 * BLOCK and kv.stats.tier_hits["disk"] == 3 * BLOCK
    store.close()


def test_a_tier_load_waits_for_the_copies_a_compaction_planned_before_it():
    """Block manager and pool tensors without a model: two sequences under KV eviction compact
    while a step is scheduled, each releasing a block its planned copies still read; a waiting
    request's tier hit is then loaded into the first of those blocks. The copies are made before
    the load (the engine's `carry_out_moves`), so the evicting sequences keep their own K/V."""
    from kvserve.cache.eviction.config import EvictionConfig
    from kvserve.cache.eviction.evictor import Evictor
    from kvserve.cache.eviction.moves import move_tokens
    from kvserve.cache.kv_cache_manager import KVCacheManager, TierHit
    from kvserve.engine.request import Request

    cache = random_cache("float32", num_blocks=8)
    store = TieredStore(TierConfig(host_bytes=1 << 20), cache, "ns")
    kv = KVCacheManager(8, BLOCK, True, "ns", evictor=Evictor(BLOCK, 256), tiers=store)
    moved: list[tuple[list[int], list[int]]] = []

    def carry_out(src: list[int], dst: list[int]) -> None:  # the runner's move_tokens, recorded
        moved.append((src, dst))
        move_tokens(cache, src, dst)

    kv.carry_out_moves = carry_out
    streaming = EvictionConfig("streaming", 2 * BLOCK, 4, 2 * BLOCK - 4)
    evicting = [Request(rid, list(range(4 * BLOCK)), SamplingParams(max_tokens=8, ignore_eos=True), eviction=streaming)
                for rid in ("a", "b")]
    for _ in range(2):  # the second chunk of each evicts and compacts
        for request in evicting:
            assert kv.allocate(request, 28)
            request.num_computed_tokens += 28
    tensors = [t.view(torch.uint8) for layer in cache.layers for t in layer.values()]  # bytes: NaNs compare
    before = [t.clone() for t in tensors]
    released = list(kv.pool.free_queue)
    waiting = Request("w", list(range(500, 500 + BLOCK + 1)), SamplingParams(max_tokens=1))
    tier_block = torch.full_like(cache.read_blocks([1], torch.device("cpu"))[0], 7)
    assert kv.allocate(waiting, 1, [], TierHit(0, [b"h" * 32], [tier_block], ["host"]))
    carry_out(*kv.take_moves())  # what the engine does once the step is scheduled
    loaded = kv.block_ids("w")[0]
    src = [s for sources, _ in moved for s in sources]
    dst = [d for _, targets in moved for d in targets]
    assert loaded == released[0] and loaded in {s // BLOCK for s in src}  # the load hit a copy's source
    for old, new in zip(before, tensors):
        rows = lambda t: t.view(t.shape[0], t.shape[1] * BLOCK, -1)  # noqa: E731 (slots along dim 1)
        assert torch.equal(rows(new)[:, dst], rows(old)[:, src])
    assert torch.equal(cache.read_blocks([loaded], torch.device("cpu"))[0], tier_block)
    store.close()


def test_a_request_under_kv_eviction_reuses_its_blocks_from_the_tiers(tiny_llama, tmp_path):
    """Like the pool, the tiers serve an evicting sequence the blocks it published before its first
    eviction (under its own keys-before-RoPE root); a plain request never sees them."""
    engine = engine_for(tiny_llama, kv_offloading_disk_path=str(tmp_path / "kv"))
    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(5 * BLOCK + 3)]
    evicting = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                              kv_eviction={"policy": "streaming", "budget": 256})

    def run(rid: str, tokens: list[int], params: SamplingParams):
        engine.add_request(tokens, params, rid)
        done = None
        while engine.has_unfinished_requests():
            done = next((o for o in engine.step() if o.finished), done)
        return done

    first = run("first", prompt, evicting)
    for i in range(2):  # distinct prompts that reclaim every pool block: the first's go to disk
        run(f"filler-{i}", [rng.randrange(3, 500) for _ in range(300)], SamplingParams(max_tokens=1))
    engine.tiers.writer.drain()
    again = run("again", prompt, evicting)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 5 * BLOCK and engine.kv_manager.stats.tier_hits["disk"] > 0
    plain = run("plain", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert plain.num_cached_tokens == 0
    assert_no_leak(engine)
    engine.close()


def test_a_waiting_request_keeps_its_disk_reads_when_its_pool_hit_shrinks(tmp_path, monkeypatch):
    """Model-free: blocks read from disk for a waiting request stay usable when the pool then
    reclaims part of its pool hit (those blocks just went down and are taken from memory): no
    second read, and the blocks written into the pool are the ones first computed."""
    import threading

    from kvserve.cache.kv_cache_manager import KVCacheManager
    from kvserve.engine.request import Request

    cache = random_cache("float32", num_blocks=8)
    store = TieredStore(TierConfig(disk_path=str(tmp_path)), cache, "ns")
    written = threading.Event()  # disk writes wait: the offloaded blocks stay queued in memory
    real_put = store.disk.put
    monkeypatch.setattr(store.disk, "put", lambda h, d: written.wait(30) and real_put(h, d))
    reads = []
    real_read = store.read_disk_async
    monkeypatch.setattr(store, "read_disk_async", lambda hashes: reads.append(len(hashes)) or real_read(hashes))
    kv = KVCacheManager(8, BLOCK, True, "ns", tiers=store)

    def request(rid: str, tokens: list[int]) -> Request:
        return Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True))

    try:
        prompt = list(range(4 * BLOCK + 1))
        first = request("first", prompt)
        assert kv.allocate(first, first.num_tokens)
        original = {i: cache.read_blocks([b]) for i, b in enumerate(kv.block_ids("first")[:4])}
        first.num_computed_tokens = first.num_tokens  # its step ran: the K/V are written
        kv.free(first)
        filler = request("filler", list(range(1000, 1000 + 6 * BLOCK)))
        assert kv.allocate(filler, filler.num_tokens)  # reclaims the first's blocks 2 and 3
        filler.num_computed_tokens = filler.num_tokens  # its step ran: the K/V are written
        kv.free(filler)
        again = request("again", prompt)
        assert len(kv.find_cached_prefix(again)) == 2
        assert kv.fetch_tier_prefix(again, 2) is None  # blocks 2 and 3 are being read
        store.loader.submit(lambda: None).result()
        assert kv.fetch_tier_prefix(again, 2).num_blocks == 2
        other = request("other", [7])
        assert kv.allocate(other, 1)  # the pool reclaims block 1 of the prefix while `again` waits
        cached = kv.find_cached_prefix(again)
        hit = kv.fetch_tier_prefix(again, len(cached))
        assert len(cached) == 1 and hit is not None and hit.num_blocks == 3 and reads == [2]
        assert kv.allocate(again, again.num_tokens - 4 * BLOCK, cached, hit)
        for i, block_id in enumerate(kv.block_ids("again")[:4]):
            assert torch.equal(cache.read_blocks([block_id]), original[i]), i
        again.num_computed_tokens = again.num_tokens  # its step ran: the K/V are written
        kv.free(again)
        other.num_computed_tokens = other.num_tokens  # its step ran: the K/V are written
        kv.free(other)
    finally:
        written.set()
        store.close()


def test_the_host_tier_holds_only_blocks_the_pool_does_not():
    """A block loaded from the host tier into the pool leaves the host tier (no copy held twice in
    RAM); when the pool reclaims it again it goes back down."""
    from kvserve.cache.kv_cache_manager import KVCacheManager
    from kvserve.engine.request import Request

    cache = random_cache("float32", num_blocks=8)
    store = TieredStore(TierConfig(host_bytes=32 * cache.block_nbytes), cache, "ns")
    kv = KVCacheManager(8, BLOCK, True, "ns", tiers=store)
    hits = []

    def cycle(rid: str, tokens: list[int]) -> list[bytes]:
        r = Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True))
        cached = kv.find_cached_prefix(r)
        hit = kv.fetch_tier_prefix(r, len(cached))
        hits.append(hit.num_blocks)
        assert kv.allocate(r, r.num_tokens - (len(cached) + hit.num_blocks) * BLOCK, cached, hit)
        hashes = list(kv.block_hashes(r))
        r.num_computed_tokens = r.num_tokens  # its step ran: the K/V are written
        kv.free(r)
        return hashes

    prompt = list(range(2 * BLOCK + 1))
    hashes = cycle("first", prompt)[:2]
    cycle("filler", list(range(1000, 1000 + 8 * BLOCK - 1)))  # reclaims every block
    assert all(store.host.contains(h) for h in hashes)
    cycle("again", prompt)
    assert hits[-1] == 2
    assert not any(store.host.contains(h) for h in hashes)
    cycle("filler-2", list(range(2000, 2000 + 8 * BLOCK - 1)))
    assert all(store.host.contains(h) for h in hashes)
    store.close()


def test_host_blocks_of_a_hit_that_overflow_to_disk_during_its_read_still_count(tmp_path, monkeypatch):
    """Model-free: a prefix lies partly in the host tier and partly on disk; while the disk part is
    read, the host tier passes the other part on to the disk. The hit still covers every block."""
    import threading

    from kvserve.cache.kv_cache_manager import KVCacheManager
    from kvserve.engine.request import Request

    cache = random_cache("float32", num_blocks=8)
    store = TieredStore(TierConfig(host_bytes=2 * cache.block_nbytes, disk_path=str(tmp_path)), cache, "ns")
    kv = KVCacheManager(8, BLOCK, True, "ns", tiers=store)

    def request(rid: str, tokens: list[int]) -> Request:
        return Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True))

    prompt = list(range(4 * BLOCK + 1))
    first = request("first", prompt)
    assert kv.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens  # its step ran: the K/V are written
    kv.free(first)
    filler = request("filler", list(range(1000, 1000 + 8 * BLOCK)))
    assert kv.allocate(filler, filler.num_tokens)  # reclaims every block: two to the host, two to disk
    filler.num_computed_tokens = filler.num_tokens  # its step ran: the K/V are written
    kv.free(filler)
    store.writer.drain()
    again = request("again", prompt)
    assert store.lookup(kv.block_hashes(again)[:4]) == ["host", "host", "disk", "disk"]
    released = threading.Event()
    slow_get = store.disk.get
    monkeypatch.setattr(store.disk, "get", lambda h, out=None: released.wait(30) and slow_get(h, out))
    assert kv.fetch_tier_prefix(again, 0) is None
    for i in range(2):  # newer blocks push the prefix's host blocks on to the disk
        store.host.put(bytes([i]) * 32, torch.zeros(cache.block_nbytes, dtype=torch.uint8))
    store.writer.drain()
    released.set()
    store.loader.submit(lambda: None).result()
    hit = kv.fetch_tier_prefix(again, 0)
    assert hit.num_blocks == 4 and hit.tiers == ["host", "host", "disk", "disk"]
    store.close()


def test_a_sliding_window_hit_loads_only_the_tier_blocks_inside_its_window():
    """Window of one block: a prompt of 5 blocks found in the host tier loads only its last block
    (the queries from position 80 on see positions 65 on); the others stay in the host tier, and
    the request holds 2 blocks, not 6."""
    from kvserve.cache.kv_cache_manager import KVCacheManager
    from kvserve.engine.request import Request

    cache = random_cache("float32", num_blocks=8)
    store = TieredStore(TierConfig(host_bytes=32 * cache.block_nbytes), cache, "ns")
    kv = KVCacheManager(8, BLOCK, True, "ns", tiers=store, window=BLOCK)
    prompt = list(range(5 * BLOCK + 1))
    first = Request("first", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    assert kv.allocate(first, 3 * BLOCK)
    first.num_computed_tokens = 3 * BLOCK
    assert kv.allocate(first, 2 * BLOCK + 1)  # queries from position 48 on: blocks 0 and 1 go back
    assert len(kv.held_block_ids("first")) == 4
    first.num_computed_tokens = first.num_tokens
    hashes, table = list(kv.block_hashes(first)), kv.block_ids("first")
    written = block_bytes(cache, table[4])
    kv.free(first)
    filler = Request("filler", list(range(1000, 1000 + 8 * BLOCK - 1)), SamplingParams(max_tokens=1))
    assert kv.allocate(filler, filler.num_tokens)  # reclaims every block: the cached ones go to the host
    filler.num_computed_tokens = filler.num_tokens
    kv.free(filler)
    assert all(store.host.contains(h) for h in hashes)
    again = Request("again", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    cached = kv.find_cached_prefix(again)
    hit = kv.fetch_tier_prefix(again, len(cached))
    assert cached == [] and hit.num_blocks == 5
    assert kv.allocate(again, 1, cached, hit)
    assert kv.block_ids("again")[:4] == [0] * 4 and len(kv.held_block_ids("again")) == 2
    assert all(torch.equal(a, b) for a, b in zip(block_bytes(cache, kv.block_ids("again")[4]), written))
    assert all(store.host.contains(h) for h in hashes[:4]) and not store.host.contains(hashes[4])
    again.num_computed_tokens = again.num_tokens
    kv.free(again)
    assert kv.pool.num_free_blocks == 8
    store.close()


def test_the_shutdown_flush_counts_only_the_blocks_it_wrote(tmp_path):
    cache = random_cache("float32", num_blocks=4)
    store = TieredStore(TierConfig(disk_path=str(tmp_path)), cache, "ns")
    store.disk.disable("full")
    assert store.flush([(1, b"a" * 32), (2, b"b" * 32)]) == 0
    store.close()


@pytest.mark.parametrize("failing", ["offload", "load"])
def test_a_tier_copy_that_raises_loses_no_pool_block(failing):
    """A copy down that fails (no pinned memory left) only loses those blocks to the tiers; a load
    that fails leaves the request holding nothing, as if never admitted. The pool stays whole."""
    from kvserve.cache.kv_cache_manager import KVCacheManager
    from kvserve.engine.request import Request

    cache = random_cache("float32", num_blocks=8)
    store = TieredStore(TierConfig(host_bytes=32 * cache.block_nbytes), cache, "ns")
    kv = KVCacheManager(8, BLOCK, True, "ns", tiers=store)

    def run(rid: str, tokens: list[int]) -> None:
        r = Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True))
        cached = kv.find_cached_prefix(r)
        hit = kv.fetch_tier_prefix(r, len(cached))
        try:
            assert kv.allocate(r, r.num_tokens - (len(cached) + hit.num_blocks) * BLOCK, cached, hit)
        finally:
            r.num_computed_tokens = r.num_tokens
            kv.free(r)

    prompt = list(range(3 * BLOCK + 1))
    run("first", prompt)
    if failing == "offload":
        kv.pool.on_evict = lambda evicted: 1 / 0
        run("filler", list(range(1000, 1000 + 8 * BLOCK - 1)))  # reclaims the cached blocks
    else:
        run("filler", list(range(1000, 1000 + 8 * BLOCK - 1)))
        store.load = lambda *args: 1 / 0
        with pytest.raises(ZeroDivisionError):
            run("again", prompt)
    assert kv.pool.num_free_blocks == 8 and kv.pool.reset_prefix_cache()
    store.close()


def test_a_disk_read_that_missed_is_looked_up_again_next_time(tmp_path, monkeypatch):
    """A request whose disk read found nothing (a transient I/O error) asks the tiers again the
    next time it is considered, instead of holding on to its empty hit."""
    from kvserve.cache.kv_cache_manager import KVCacheManager
    from kvserve.engine.request import Request

    cache = random_cache("float32", num_blocks=8)
    store = TieredStore(TierConfig(disk_path=str(tmp_path)), cache, "ns")
    kv = KVCacheManager(8, BLOCK, True, "ns", tiers=store)
    prompt = list(range(3 * BLOCK + 1))
    first = Request("first", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    assert kv.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    kv.free(first)
    filler = Request("filler", list(range(1000, 1000 + 8 * BLOCK - 1)), SamplingParams(max_tokens=1))
    assert kv.allocate(filler, filler.num_tokens)  # the cached blocks go down to the disk
    filler.num_computed_tokens = filler.num_tokens
    kv.free(filler)
    store.writer.drain()
    again = Request("again", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    real_get = store.disk.get
    monkeypatch.setattr(store.disk, "get", lambda *args: None)  # the first read fails
    assert kv.fetch_tier_prefix(again, 0) is None
    store.loader.submit(lambda: None).result()
    assert kv.fetch_tier_prefix(again, 0).num_blocks == 0
    monkeypatch.setattr(store.disk, "get", real_get)
    assert kv.fetch_tier_prefix(again, 0) is None  # read again
    store.loader.submit(lambda: None).result()
    assert kv.fetch_tier_prefix(again, 0).num_blocks == 3
    store.close()
