"""Shared fixtures. The real default model is loaded from disk at most once per session: engines
built in tests share its weights (read-only) through a cached loader."""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

# Set before torch loads (the xdist workers and the servers tests start inherit it): a worker's torch
# threads sleep at once when they run out of work instead of spinning for the core that the other
# worker needs; spinning doubled a file's time beside a busy worker (BENCHMARKS.md, "CI time on the
# AVX2-only CPU"). Only the suite sets it; kvserve leaves OpenMP's defaults as they are.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# benchmarks/scenarios.py: the HTTP load scenarios the reliability tests share with benchmarks/soak.py.
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import kvserve.engine.loading as loading_module  # noqa: E402
from tiny_models import build_tiny_model, build_tokenizer  # noqa: E402


# pytest-xdist (pyproject's addopts: -n 2 --dist loadfile) runs the suite as two units of work,
# one per worker, each in file order. Sharing out every file instead would let both workers hold the
# real model's fixtures and servers at once, more than a 24 GiB machine has to spare, so the side
# unit takes only files that never load it (no real model in-process or in a server they start):
# the Triton interpreter's tests (single-threaded Python on tiny models) and tiny-model files
# chosen to even out the two units' times (BENCHMARKS.md, "CI time on the AVX2-only CPU").
SIDE_UNIT_FILES = {
    # the Triton interpreter's
    "test_triton_attention.py", "test_fixed_order_triton.py", "test_step_host_syncs.py", "test_decode_graphs.py",
    "test_fused_ops.py", "test_triton_interpreter.py",
    # tiny models only
    "test_deterministic.py", "test_kv_tiers_server.py", "test_router.py", "test_router_hardening.py",
    "test_bench_compare.py", "test_reliability_fuzz.py", "test_eviction_engine.py", "test_tensor_parallel_features.py",
    "test_dashboard_browser.py", "test_reliability_shutdown.py", "test_disk_tier_trust.py",
    "test_reliability_auth.py", "test_reasoning.py", "test_top.py",
    "test_tensor_parallel.py",  # the default model's header only (preflight), weights never
}


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with two units of work: SIDE_UNIT_FILES, and all the others."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class TwoUnits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return "side" if file in SIDE_UNIT_FILES else "rest"

    return TwoUnits(config, log)


@pytest.fixture(scope="session", autouse=True)
def _load_each_model_once():
    """Engines in one test session reuse a checkpoint's tensors and tokenizer instead of reading
    and dequantizing the file again (the default GGUF takes ~10 s to load)."""
    original = loading_module.load_model
    loading_module.load_model = functools.lru_cache(maxsize=4)(original)
    yield
    loading_module.load_model = original


@pytest.fixture(scope="session")
def cpu_kernel():
    """The CPU paged decode kernel's module for tests that need it; skipped with the reason where it
    cannot run (no compiler, an unsupported CPU, KVSERVE_DISABLE_CPU_KERNEL=1). Only tests that ask
    for it build it (`kvserve build-kernel` in the set-up command normally has)."""
    from kvserve.model.attention.cpu_paged import load_paged_decode_module

    module, why = load_paged_decode_module()
    if module is None:
        pytest.skip(f"the CPU paged decode kernel is unavailable here: {why}")
    return module


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, tiny_tokenizer):
    """tiny_model_factory(arch, **config_overrides) -> path of a random HF checkpoint (built once)."""
    built: dict[tuple[str, str], Path] = {}

    def factory(arch: str = "llama", **overrides) -> Path:
        key = (arch, repr(sorted(overrides.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = build_tiny_model(path, arch, tiny_tokenizer, **overrides)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_llama_d32(tiny_model_factory) -> Path:
    """A tiny llama with head_dim 32 (the Triton kernels' smallest), GQA 2."""
    return tiny_model_factory("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory):
    """server_factory(*serve_args, env=None) -> a running `kvserve serve` subprocess on 127.0.0.1
    (tests/server_process.py). One process per distinct configuration, shared by the whole
    session and stopped at its end."""
    from server_process import ServerProcess, stop_processes

    servers: dict[tuple, ServerProcess] = {}

    def factory(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        key = (args, tuple(sorted((env or {}).items())))
        if key not in servers:
            servers[key] = ServerProcess.start(list(args), tmp_path_factory.mktemp("server"), env)
        return servers[key]

    yield factory
    stop_processes([server.process for server in servers.values()])


@pytest.fixture(scope="session")
def tiny_server(server_factory, tiny_llama):
    """The tiny llama served in float32 (batch-independent greedy output), with two model names
    and a 1 MiB body limit; shared by the server test modules."""
    from server_process import TINY_SERVER_ARGS

    return server_factory(str(tiny_llama), *TINY_SERVER_ARGS)


# ---------------------------------------------------------------------------- the real default model, once
@pytest.fixture(scope="session")
def hf_default_fp32():
    """HF transformers' float32 model from the default GGUF: the reference of the default-model tests."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvserve.model.loader import resolve_model_path

    path = resolve_model_path(None)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_fp32():
    """kvserve's default model in float32 with its weights dequantized (quantization "none"): the
    int kernels round activations to bfloat16, so the quantized path cannot match HF's float32
    model to 1e-3 (test_quantization.py checks it against its own weights)."""
    from kvserve import LLM

    return LLM(dtype="float32", quantization="none", kv_cache_memory="1GiB", max_model_len=2048,
               max_num_batched_tokens=64)
