"""The start-up calibrations (fp8_e4m3's key bases, int4's key centres) are kept in the disk cache
(kvserve/disk_cache.py, kvserve/engine/calibration.py): a second engine with the same options loads
them instead of calibrating, and serves the same greedy tokens; a changed option or model file
calibrates again; a damaged entry is recomputed with a warning."""
from __future__ import annotations

import logging
import os

import pytest
import torch

import kvserve.engine.key_basis as key_basis
import kvserve.engine.key_centering as key_centering
from kvserve import disk_cache
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.loader import load_model

from engine_runs import greedy_tokens

PROMPTS = {"a": (list(range(5, 125)), None), "b": (list(range(40, 49)), None)}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def calibrations(monkeypatch) -> list[str]:
    """The calibrations that really ran (were not loaded from the cache)."""
    ran: list[str] = []

    def spy(module, name: str, label: str) -> None:
        original = getattr(module, name)

        def counted(*args, **kwargs):
            ran.append(label)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    spy(key_basis, "_fit_key_bases", "bases")
    spy(key_centering, "record_projections", "centers")
    return ran


def _engine(path, kv_cache_dtype: str, **options) -> LLMEngine:
    # The torch attention path: calibration does not depend on it, and with KVSERVE_CACHE_DIR moved
    # to a temporary directory the CPU kernel would otherwise be rebuilt there.
    options = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": "4MiB", "attention_backend": "torch",
               **options}
    return LLMEngine(EngineArgs(model=str(path), kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=40, **options),
                     loaded_model=load_model(str(path)))


def _transforms(engine: LLMEngine, kv_cache_dtype: str) -> list[torch.Tensor]:
    attentions = [layer.self_attn for layer in engine.model.layers]
    if kv_cache_dtype == "int4":
        return [a.key_center for a in attentions]
    return [a.key_basis[0] for a in attentions]


@pytest.mark.parametrize("kv_cache_dtype, label", [("fp8_e4m3", "bases"), ("int4", "centers")])
def test_second_start_loads_the_calibration_and_serves_the_same_tokens(tiny_llama, cache_dir, calibrations,
                                                                       kv_cache_dtype, label):
    first = _engine(tiny_llama, kv_cache_dtype)
    assert calibrations == [label]
    assert len(list(cache_dir.glob("calibration-*/*.pt"))) == 1
    second = _engine(tiny_llama, kv_cache_dtype)
    assert calibrations == [label]  # not calibrated again
    for a, b in zip(_transforms(first, kv_cache_dtype), _transforms(second, kv_cache_dtype)):
        assert torch.equal(a, b)
    assert greedy_tokens(second, PROMPTS) == greedy_tokens(first, PROMPTS)


@pytest.mark.parametrize("changed", [{"max_model_len": 200}, {"block_size": 32}, {"dtype": "bfloat16"}])
def test_a_changed_option_calibrates_again(tiny_llama, cache_dir, calibrations, changed):
    _engine(tiny_llama, "fp8_e4m3")
    _engine(tiny_llama, "fp8_e4m3", **changed)
    assert calibrations == ["bases", "bases"]
    assert len(list(cache_dir.glob("calibration-key-bases/*.pt"))) == 2


def test_deterministic_mode_keeps_calibrations_of_its_own(tiny_llama, cache_dir):
    """--deterministic computes the calibration prefill another way (every row as a decode,
    fixed-order linears), so its fitted transforms differ from the default mode's in more than
    last bits: an entry the default mode wrote moved a later deterministic engine's logprobs. The
    mode is part of the key (asked here of the cache itself: a deterministic engine needs the CPU
    kernel, which a moved cache directory would build again)."""
    from kvserve.engine.calibration import cached_calibration

    engine = _engine(tiny_llama, "auto")
    computed: list[bool] = []

    def calibrate(batch_invariant: bool) -> None:
        engine.model.batch_invariant = batch_invariant
        cached_calibration("probe", engine.model, engine.runner.kv_cache, tiny_llama / "model.safetensors", {},
                           lambda: computed.append(batch_invariant) or {"x": torch.zeros(1)}, lambda entry: True)

    for mode in (False, True, False, True):
        calibrate(mode)
    assert computed == [False, True]  # each mode computed once, then loaded
    engine.model.batch_invariant = False


def test_key_centres_of_a_shorter_context_are_its_own(tiny_model_factory, cache_dir, calibrations):
    """RoPE is averaged over positions [0, 4096) when computing a key centre, or over the whole
    table when max-model-len is shorter: at 2,048 the centres differ from 8,192's and must not be
    loaded from its entry (both calibrate 1,024 tokens)."""
    path = tiny_model_factory("llama", max_position_embeddings=8192)
    long = _engine(path, "int4", max_model_len=8192, kv_cache_memory="16MiB")
    short = _engine(path, "int4", max_model_len=2048, kv_cache_memory="16MiB")
    assert calibrations == ["centers", "centers"]
    assert not all(torch.equal(a, b) for a, b in zip(_transforms(long, "int4"), _transforms(short, "int4")))


def test_a_changed_model_file_calibrates_again(tiny_llama, cache_dir, calibrations):
    _engine(tiny_llama, "int4")
    weights = tiny_llama / "model.safetensors"
    stat = os.stat(weights)
    try:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        _engine(tiny_llama, "int4")
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert calibrations == ["centers", "centers"]


@pytest.mark.parametrize("damage", [b"not a torch file", b""])
def test_a_damaged_entry_is_recomputed_with_a_warning(tiny_llama, cache_dir, calibrations, caplog, damage):
    expected = _transforms(_engine(tiny_llama, "fp8_e4m3"), "fp8_e4m3")
    [entry] = cache_dir.glob("calibration-key-bases/*.pt")
    entry.write_bytes(damage)
    with caplog.at_level(logging.WARNING):
        got = _transforms(_engine(tiny_llama, "fp8_e4m3"), "fp8_e4m3")
    assert calibrations == ["bases", "bases"] and "ignoring unreadable entry" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(got, expected))  # the fit is deterministic
    _engine(tiny_llama, "fp8_e4m3")  # and the rewritten entry is used again
    assert calibrations == ["bases", "bases"]


def test_an_entry_of_the_wrong_shape_is_recomputed(tiny_llama, cache_dir, calibrations, caplog):
    _engine(tiny_llama, "int4")
    [entry] = cache_dir.glob("calibration-key-centers/*.pt")
    torch.save({"centers": [torch.zeros(3)]}, entry)
    with caplog.at_level(logging.WARNING):
        _engine(tiny_llama, "int4")
    assert calibrations == ["centers", "centers"] and "not what this model needs" in caplog.text


def test_cache_off_writes_nothing(tiny_llama, tmp_path, monkeypatch, calibrations):
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, "")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    _engine(tiny_llama, "int4")
    _engine(tiny_llama, "int4")
    assert calibrations == ["centers", "centers"] and not any(tmp_path.rglob("*.pt"))


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "kind" / "entry.pt"
    disk_cache.save_tensors(target, {"x": torch.arange(3)})
    assert torch.equal(disk_cache.load_tensors(target)["x"], torch.arange(3))

    def fail(path):
        path.write_bytes(b"partial")
        raise OSError("disk full")

    assert not disk_cache.write_atomically(tmp_path / "kind" / "other.pt", fail)
    assert sorted(p.name for p in (tmp_path / "kind").iterdir()) == ["entry.pt"]
