"""Building the CPU paged decode kernel: every ISA level this CPU runs builds and is correct, builds
are safe when processes start at once or die mid-build, and failures are remembered and explained.
Builds here go to private cache directories (KVSERVE_CACHE_DIR), never the user's."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvserve.model import kernel_build
from kvserve.model.attention.cpu_paged import PagedDecodeKernel, paged_decode_build
from kvserve.model.kernel_build import DISABLE_ENV, KernelBuild, current_isa, load_kernel, runnable_isa_levels
from kvserve.model.lean_kernel import lean_decode_build
from test_attention_paths import SPEC, check_kernel_against_the_definition
from test_lean_decode import check_gemv_against_the_definition

# A kernel that compiles in seconds (pybind11 only, no torch headers), for the tests of the build
# protocol itself: the paged decode kernel takes over a minute on a 2-core AVX2 machine.
TINY_SOURCE = """#include <pybind11/pybind11.h>
int twice(int x) { return 2 * x; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""

# A process that builds (or loads) a KernelBuild given by name, source and ISA through load_kernel,
# as the engine's kernels do, calls it and says whether it got it.
PROBE = """
import logging
import sys
from pathlib import Path
logging.basicConfig(level=logging.INFO)
from kvserve.model.kernel_build import KernelBuild, load_kernel
module, why = load_kernel(KernelBuild(sys.argv[1], Path(sys.argv[2]), sys.argv[3]))
print("KERNEL" if module is not None and module.twice(21) == 42 else f"NONE {why}")
"""


def tiny_build(cache: Path) -> KernelBuild:
    source = cache / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    return KernelBuild("kvserve_tiny_test", source, current_isa())


def probe(cache: Path, build: KernelBuild, **popen_kwargs) -> subprocess.Popen:
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(cache)}
    env.pop(DISABLE_ENV, None)
    return subprocess.Popen([sys.executable, "-c", PROBE, build.name, str(build.source), build.isa], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs)


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    return tmp_path


def test_isa_levels_follow_the_cpu_and_torch(monkeypatch):
    runnable = runnable_isa_levels()
    assert runnable[-1] == "DEFAULT" and current_isa() in runnable
    flags = " ".join(kernel_build.ISA_LEVELS["AVX2"].compiler_flags)
    assert "-mf16c" in flags and "-march=native" not in flags  # ATen's half conversions need F16C
    if "AVX2" in runnable:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # ATEN_CPU_CAPABILITY=avx2
        assert current_isa() == "AVX2"
    monkeypatch.setattr(kernel_build, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: frozenset({"avx2", "fma"}))  # no f16c: no AVX2 build
    assert runnable_isa_levels() == ["DEFAULT"]
    monkeypatch.setattr(kernel_build, "machine", lambda: "aarch64")
    assert runnable_isa_levels() == ["DEFAULT"]


def test_every_isa_level_this_cpu_runs_builds_and_matches_the_definition():
    """AVX2-only flags on an AVX-512 machine (and the flag-less DEFAULT build that aarch64 uses)
    build and compute the same attention. Built into the user's cache like `kvserve build-kernel
    --isa all`; the levels build in parallel, one compiler each."""
    builds = [paged_decode_build(isa) for isa in runnable_isa_levels()]
    lean_builds = [lean_decode_build(isa) for isa in runnable_isa_levels()]
    missing = [b.isa for b, lean in zip(builds, lean_builds) if not (b.library.exists() and lean.library.exists())]
    children = [subprocess.Popen([sys.executable, "-m", "kvserve.cli", "build-kernel", "--isa", isa],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for isa in missing]
    for child in children:
        output = child.communicate(timeout=900)[0]
        assert child.returncode == 0, output
    for build in builds:
        module, why = load_kernel(build, compile_if_missing=False)
        assert module is not None, f"{build.isa}: {why}"
        kernel = PagedDecodeKernel(module, 1 / math.sqrt(SPEC.head_dim))
        for dtype, kv_cache_dtype in ((torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.bfloat16, "int8"),
                                      (torch.bfloat16, "fp8_e4m3"), (torch.bfloat16, "int4")):
            check_kernel_against_the_definition(kernel, dtype, kv_cache_dtype, window=5)
    for build in lean_builds:  # the quantized small-batch matmul, SIMD and portable, against its definition
        module, why = load_kernel(build, compile_if_missing=False)
        assert module is not None, f"{build.isa}: {why}"
        check_gemv_against_the_definition(module)


def test_killed_builder_leaves_no_hang_and_two_starts_at_once_both_get_the_kernel(private_cache):
    """SIGKILL a process in the middle of the build (its lock must not outlive it), then start two
    processes at once on that cache: one builds while the other waits, and both end on the kernel."""
    build = tiny_build(private_cache)
    first = probe(private_cache, build, start_new_session=True)
    scratch = private_cache / "kernels" / f"{build.key}.build-{first.pid}"
    deadline = time.monotonic() + 120
    while not scratch.exists() and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.2)
    assert scratch.exists(), "the first process never started building"
    time.sleep(2)  # inside the compiler now
    os.killpg(first.pid, signal.SIGKILL)  # the process and its compiler, as a killed terminal would
    first.wait()

    start = time.monotonic()
    second, third = probe(private_cache, build), probe(private_cache, build)
    results = [p.communicate(timeout=900) for p in (second, third)]
    elapsed = time.monotonic() - start
    for (out, err), p in zip(results, (second, third)):
        assert p.returncode == 0 and out.startswith("KERNEL"), (out, err[-2000:])
    assert sum("Building the CPU" in err for _, err in results) == 1  # one built, the other waited
    assert build.library.exists()
    assert not scratch.exists()  # the dead builder's half-built directory is gone
    print(f"build after a killed build: {elapsed:.0f} s")


def test_a_failed_build_is_remembered_across_processes_and_retried_on_request(private_cache):
    source = private_cache / "broken.cpp"
    source.write_text('#error "this kernel does not compile"\n')
    build = KernelBuild("kvserve_broken_test", source, current_isa())
    module, why = load_kernel(build)
    assert module is None and "does not compile" in why
    failure = json.loads(build._sibling(".failed").read_text())
    assert "does not compile" in failure["reason"]
    # Another process: remembered, not rebuilt (a compile would take seconds and log "Building").
    code = ("from pathlib import Path; from kvserve.model.kernel_build import KernelBuild, load_kernel; "
            f"print(load_kernel(KernelBuild('kvserve_broken_test', Path({str(source)!r}), {current_isa()!r}))[1])")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "KVSERVE_CACHE_DIR": str(private_cache)})
    assert "an earlier build failed" in child.stdout and "Building" not in child.stderr, child
    # Retried on request: fixed source, new key; the same source with retry_failed builds again.
    module, why = load_kernel(build, retry_failed=True)
    assert module is None and "does not compile" in why and "earlier" not in why


def test_disabled_kernel_gives_the_torch_path_with_the_reason(private_cache, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    module, why = load_kernel(paged_decode_build())
    assert module is None and DISABLE_ENV in why
    assert not (private_cache / "kernels").exists()  # nothing built, nothing locked


def test_an_unusable_cache_directory_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(not_a_directory))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    module, why = load_kernel(paged_decode_build())
    assert module is None and "cannot use the kernel cache" in why
