"""The disk KV tier's directory as a trust boundary (cache/tiers/disk.py): what someone who can put
files or links there can and cannot make the tier do. A FIFO or a link in place of a block is a
miss (never a hang, never a read of another file); a namespace directory swapped for a link
redirects no write; the size bound counts only what the tier wrote; a directory others can write
is made private, and one another user owns is refused. A disk read that does not finish in time is
a miss (kv_cache_manager.TIER_LOAD_TIMEOUT_S). A block forged with a recomputed CRC-32 is read as
genuine; with a key (--kv-offloading-disk-key) it is a miss."""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time

import pytest
import torch

from kvserve.cache import kv_cache_manager
from kvserve.cache.tiers import DiskTier
from kvserve.cache.tiers import disk as disk_module

BLOCK_BYTES = 4096
NAMESPACE = bytes(range(32))


def tier(root, capacity=1 << 30) -> DiskTier:
    return DiskTier(root, NAMESPACE, capacity, BLOCK_BYTES)


def block(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def get_within(disk: DiskTier, block_hash: bytes, seconds: float = 5.0):
    """disk.get(block_hash), failing the test if it does not return within `seconds`."""
    result = {}
    reader = threading.Thread(target=lambda: result.setdefault("data", disk.get(block_hash)), daemon=True)
    reader.start()
    reader.join(seconds)
    assert not reader.is_alive(), "the read hung"
    return result["data"]


def read_planted(disk: DiskTier, key: bytes, plant, caplog) -> str:
    """Write a block, put `plant(path)` in its file's place, read it: a miss at once. The warnings."""
    disk.put(key, block(key[0]))
    path = disk.path(key)
    path.unlink()
    plant(path)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert get_within(disk, key) is None
    return caplog.text


def test_a_fifo_in_place_of_a_block_is_a_miss_not_a_hang(tmp_path, caplog):
    disk = tier(tmp_path)
    assert "is not a regular file" in read_planted(disk, bytes(32), os.mkfifo, caplog)
    assert not disk.path(bytes(32)).exists()  # removed


def test_a_block_file_that_is_a_link_is_not_followed(tmp_path, caplog):
    disk = tier(tmp_path / "kv")
    key = bytes([1] * 32)
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 10_000_000)
    assert "symbolic link" in read_planted(disk, key, lambda path: path.symlink_to(secret), caplog)
    path = disk.path(key)
    assert not os.path.lexists(path) and secret.stat().st_size == 10_000_000  # the link went, not its target
    path.symlink_to(secret)
    assert tier(tmp_path / "kv").used_bytes < 10_000_000  # a link's target is not counted as the tier's


def test_a_namespace_directory_swapped_for_a_link_redirects_no_write(tmp_path):
    disk = tier(tmp_path / "kv")
    disk.put(bytes(32), block(2))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    disk.dir.rename(tmp_path / "kv" / "moved")
    disk.dir.symlink_to(elsewhere)
    for i in range(5):
        disk.put(bytes([i + 3] * 32), block(i))
    assert not any(elsewhere.rglob("*"))  # nothing written through the link
    with pytest.raises(ValueError, match="symbolic link"):
        tier(tmp_path / "kv")  # a new process refuses it


def test_a_directory_other_users_can_write_is_made_private(tmp_path, caplog):
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        tier(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert "was writable by other users (mode 777); made 0700" in caplog.text


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving the directory to another user needs root")
def test_a_directory_another_user_owns_is_refused(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(ValueError, match="belongs to uid 65534, not to this user"):
        tier(root)


def test_a_disk_read_that_does_not_finish_in_time_is_a_miss(tiny_llama, tmp_path, monkeypatch):
    """The loader thread stuck in a read: the request goes on without those blocks, with the same
    output, instead of waiting for ever."""
    from kvserve import LLM, SamplingParams

    monkeypatch.setattr(kv_cache_manager, "TIER_LOAD_TIMEOUT_S", 1.0)
    prompt = list(range(10, 150))
    params = SamplingParams(temperature=0, max_tokens=4)
    options = dict(dtype="float32", kv_offloading_disk_path=str(tmp_path / "kv"))
    with LLM(str(tiny_llama), **options) as llm:
        expected = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    release = threading.Event()
    with LLM(str(tiny_llama), **options) as llm:
        original = llm.engine.tiers.disk.get
        monkeypatch.setattr(llm.engine.tiers.disk, "get", lambda *a, **k: release.wait(30) and original(*a, **k))
        start = time.monotonic()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert time.monotonic() - start < 20
        assert out.outputs[0].token_ids == expected and out.num_cached_tokens == 0
        release.set()


def forge(path, kind: int, key: bytes | None = None) -> None:
    """Rewrite a block file as a writer of the directory would who wants other KV loaded: a new
    payload with a check it computed itself (a CRC-32, or a tag under its own key)."""
    data = bytearray(path.read_bytes())
    payload = bytes(255 - b for b in data[disk_module.HEADER.size:])
    fields = list(disk_module.HEADER.unpack(bytes(data[:disk_module.HEADER.size])))
    fields[2] = kind
    header = disk_module.HEADER.pack(*fields[:6], disk_module.checksum(payload).to_bytes(4, "little"))
    if kind == disk_module.HMAC_SHA256:
        header = header[:disk_module.CHECKED] + disk_module.tag(key, header, payload)
    path.write_bytes(header + payload)


def test_a_block_forged_with_a_recomputed_crc_is_accepted_without_a_key_and_refused_with_one(tmp_path, caplog):
    plain = tier(tmp_path / "plain")
    plain.put(bytes(32), block(1))
    forge(plain.path(bytes(32)), disk_module.CRC32)
    assert torch.equal(plain.get(bytes(32)), 255 - block(1))  # CRC-32 catches accidents only

    key = disk_module.load_key(tmp_path / "key")
    keyed = DiskTier(tmp_path / "keyed", NAMESPACE, 1 << 30, BLOCK_BYTES, key)
    forgeries = {bytes([1] * 32): (disk_module.CRC32, None), bytes([2] * 32): (disk_module.HMAC_SHA256, b"k" * 32)}
    for name, (kind, their_key) in forgeries.items():
        keyed.put(name, block(name[0]))
        assert torch.equal(keyed.get(name), block(name[0]))  # an honest block reads back
        forge(keyed.path(name), kind, their_key)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert all(keyed.get(name) is None for name in forgeries)
    assert "carries no authentication tag" in caplog.text and "fails its authentication tag" in caplog.text
    # A genuine file copied under another block's name fails too: the tag covers the header.
    keyed.put(bytes([3] * 32), block(3))
    keyed.put(bytes([4] * 32), block(4))
    keyed.path(bytes([4] * 32)).write_bytes(keyed.path(bytes([3] * 32)).read_bytes())
    assert keyed.get(bytes([4] * 32)) is None and keyed.get(bytes([3] * 32)) is not None


def test_the_key_file_is_made_private_and_a_key_others_can_read_is_refused(tmp_path):
    path = tmp_path / "key"
    key = disk_module.load_key(path)
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert disk_module.load_key(path) == key  # kept, not remade
    path.chmod(0o640)
    with pytest.raises(ValueError, match="can be read or written by other users"):
        disk_module.load_key(path)
    short = tmp_path / "short"
    short.write_bytes(b"x" * 8)
    short.chmod(0o600)
    with pytest.raises(ValueError, match="a key is at least 16"):
        disk_module.load_key(short)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(ValueError, match="cannot use"):
        disk_module.load_key(link)


def test_servers_with_no_key_and_with_keys_sharing_a_root_keep_each_others_files(tmp_path, caplog):
    """Each keeps its blocks in a directory of its own (the key's digest in its name): none reads,
    refuses or removes another's file."""
    keys = [None, disk_module.load_key(tmp_path / "a.key"), disk_module.load_key(tmp_path / "b.key")]
    tiers = [DiskTier(tmp_path / "kv", NAMESPACE, 1 << 30, BLOCK_BYTES, key) for key in keys]
    assert len({t.dir for t in tiers}) == 3
    for i, disk in enumerate(tiers):
        disk.put(bytes(32), block(i))
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        for i, disk in enumerate(tiers):
            assert torch.equal(disk.get(bytes(32)), block(i))
    assert not caplog.text and len(list((tmp_path / "kv").rglob("*.kvb"))) == 3


def test_a_read_that_fails_now_is_a_miss_that_keeps_the_file_and_a_failing_utime_is_no_miss(tmp_path,
                                                                                            monkeypatch):
    """An I/O error opening or checking a block file (EIO, EMFILE, ESTALE on NFS) is a miss for
    now: the file stays for the next read. A touch that fails (a read-only mount) costs nothing."""
    disk = tier(tmp_path)
    disk.put(bytes(32), block(5))
    real_open, real_fstat = os.open, os.fstat

    def failing(errno_code, real):
        def call(path, *args, **kwargs):
            if str(path).endswith(".kvb"):
                raise OSError(errno_code, os.strerror(errno_code))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "open", failing(errno.EIO, real_open))
    assert disk.get(bytes(32)) is None and disk.path(bytes(32)).exists()
    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(os, "fstat", lambda fd: (_ for _ in ()).throw(OSError(errno.ESTALE, "stale")))
    assert disk.get(bytes(32)) is None and disk.path(bytes(32)).exists()
    monkeypatch.setattr(os, "fstat", real_fstat)
    monkeypatch.setattr(os, "utime", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EROFS, "read-only")))
    assert torch.equal(disk.get(bytes(32)), block(5))


def test_a_disk_read_that_raises_on_the_loader_thread_is_a_miss(tiny_llama, tmp_path, monkeypatch):
    """Scheduling goes on: the request computes the blocks it could not read."""
    from kvserve import LLM, SamplingParams

    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="1MiB", kv_offloading_disk_path=str(tmp_path / "kv"),
              max_model_len=256)
    prompt = {"prompt_token_ids": list(range(10, 110))}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.close()  # its blocks go to disk
    again = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="1MiB", max_model_len=256,
                kv_offloading_disk_path=str(tmp_path / "kv"))
    monkeypatch.setattr(again.engine.tiers, "_read_disk", lambda hashes: 1 / 0)
    assert again.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert again.engine.kv_manager.stats.tier_hits["disk"] == 0
    again.engine.close()
