"""The disk KV tier across server restarts (issue 21): a server killed with SIGKILL while it serves
and writes blocks, restarted on the same directory, gives the same outputs and serves prefixes
from disk (/metrics shows it); stopped normally, it flushes its cached prefixes (the engine-level
restart test in test_kv_tiers.py checks that a restart finds them)."""
from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import threading

import httpx

from server_process import ServerProcess

BLOCK_BYTES = 16 * 512  # the tiny model in float32
SERVER_ARGS = ("--dtype", "float32", "--kv-cache-memory", str(40 * BLOCK_BYTES), "--max-model-len", "512")


def run_workload(server: ServerProcess, seed: int = 0, sessions: int = 4, turns: int = 3) -> list[str]:
    """Sessions take turns; each resends its whole history plus 48 tokens and gets 8 greedy tokens
    (the history grows by 8 fixed tokens a turn: what matters here is the prefix reuse)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(64)]
    history = {s: list(system) for s in range(sessions)}
    outputs = []
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for _ in range(turns):
            for s in range(sessions):
                prompt = history[s] + [rng.randrange(3, 500) for _ in range(48)]
                body = {"model": client.get("/v1/models").json()["data"][0]["id"], "prompt": prompt,
                        "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                reply = client.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                outputs.append(reply.json()["choices"][0]["text"])
                history[s] = prompt + [rng.randrange(3, 500) for _ in range(8)]
    return outputs


def disk_hits(server: ServerProcess) -> float:
    return server.metrics().get('kvserve:prefix_cache_tier_hits_total{tier="disk"}', 0.0)


def test_a_server_killed_mid_write_restarts_on_its_disk_tier_with_identical_outputs(tiny_llama, tmp_path):
    args = [str(tiny_llama), *SERVER_ARGS, "--kv-offloading-disk-path", str(tmp_path / "kv")]
    for name in "ab":
        (tmp_path / name).mkdir()
    first = ServerProcess.start(args, tmp_path / "a")
    try:
        expected = run_workload(first)
        # More work that reclaims blocks (disk writes), killed while in flight.
        busy = threading.Thread(target=lambda: _ignore_errors(run_workload, first, 1), daemon=True)
        busy.start()
        busy.join(1.0)
    finally:
        first.process.kill()
        first.process.wait()
    assert list((tmp_path / "kv").rglob("*.kvb"))

    second = ServerProcess.start(args, tmp_path / "b")
    try:
        assert run_workload(second) == expected
        assert disk_hits(second) > 0
        metrics = second.metrics()
        assert metrics["kvserve:external_prefix_cache_hits_total"] > 0
        assert metrics["kvserve:external_prefix_cache_queries_total"] >= metrics[
            "kvserve:external_prefix_cache_hits_total"]
        tiers = httpx.get(second.base_url + "/dashboard/state", timeout=10).json()["kv_offload_tiers"]
        assert tiers["disk_capacity_bytes"] == 10 << 30 and tiers["host_capacity_bytes"] == 0
        assert tiers["tier_hits"]["disk"] == disk_hits(second)
    finally:
        second.stop()  # SIGTERM: the pool's cached prefixes go to disk
    assert second.process.returncode == 0, second.log()
    assert "blocks at shutdown" in second.log()


def _ignore_errors(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:
        pass


def test_with_a_key_forged_blocks_and_a_planted_fifo_are_misses_and_outputs_stay_right(tiny_llama, tmp_path):
    """Someone who can write the directory but not read the key rewrites every block file (a
    recomputed CRC-32, or a tag under their own key); later puts FIFOs in the blocks' places. Each
    time the restarted server serves the same outputs, from recomputation (a FIFO neither hangs a
    request nor the shutdown), and says why in its log."""
    from test_disk_tier_trust import forge
    from kvserve.cache.tiers import disk as disk_module

    kv = tmp_path / "kv"
    args = [str(tiny_llama), *SERVER_ARGS, "--kv-offloading-disk-path", str(kv), "--kv-offloading-disk-key", "auto"]
    for name in "ab":
        (tmp_path / name).mkdir()
    first = ServerProcess.start(args, tmp_path / "a")
    try:
        expected = run_workload(first)
    finally:
        first.stop()  # SIGTERM: the cached prefixes go to disk
    assert stat.S_IMODE((kv / disk_module.KEY_FILE).stat().st_mode) == 0o600
    files = sorted(kv.rglob("*.kvb"))
    assert len(files) > 4
    for i, path in enumerate(files):
        forge(path, disk_module.CRC32 if i % 2 else disk_module.HMAC_SHA256, b"not the key" * 3)
    second = ServerProcess.start(args, tmp_path / "b")
    try:
        assert run_workload(second) == expected
        assert disk_hits(second) == 0
    finally:
        second.stop()
    log = second.log_path.read_text()
    assert "fails its authentication tag" in log or "carries no authentication tag" in log, log

    for path in kv.rglob("*.kvb"):  # what the second server wrote at shutdown
        path.unlink()
        os.mkfifo(path)
    kv.chmod(0o777)
    (tmp_path / "c").mkdir()
    third = ServerProcess.start(args, tmp_path / "c")
    try:
        assert run_workload(third) == expected
    finally:
        third.stop()
    log = third.log_path.read_text()
    assert third.process.returncode == 0 and "is not a regular file" in log, third.log()
    assert "was writable by other users (mode 777); made 0700" in log and stat.S_IMODE(kv.stat().st_mode) == 0o700

    # The namespace directory swapped for a link to elsewhere: refused at start-up, in one line.
    namespace = next(p for p in kv.iterdir() if p.is_dir())
    elsewhere = tmp_path / "elsewhere"
    namespace.rename(elsewhere)
    namespace.symlink_to(elsewhere)
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("is a symbolic link")


def test_a_key_file_others_can_read_stops_serve_with_one_line(tiny_llama, tmp_path):
    key = tmp_path / "key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o644)
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", str(tiny_llama), "--kv-offloading-disk-path",
                           str(tmp_path / "kv"), "--kv-offloading-disk-key", str(key)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("can be read or written by other users (mode 644; make it 0600)")
