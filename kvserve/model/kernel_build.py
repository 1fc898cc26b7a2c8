"""Build, cache and load kvserve's C++ CPU kernels, safely across processes.

A kernel is compiled with torch's extension builder (`torch.utils.cpp_extension`: a C++
compiler and ninja) for one vector ISA, with the flags ATen compiles that `CPU_CAPABILITY` with,
and only for an ISA this CPU really has (never -march=native: a shared cache must not hold a
binary another CPU cannot run). `kvserve build-kernel` does it at set-up time; on first use it
happens just in time, for users who change torch later.

The cache (``kernels/`` in kvserve's disk cache, default ``~/.cache/kvserve``) is keyed by
kernel, ISA, platform, Python, torch version and a hash of source and flags:

    <key>/<name>.so     complete builds only: a build happens in <key>.build-<pid>, renamed in one step
    <key>.lock          an OS file lock (fcntl.flock) serialising builders; released when its holder dies
    <key>.failed        why the last build failed, so later processes do not retry it on every start
    <key>.failed.log    the compiler's output for that failure
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from kvserve.disk_cache import cache_root
from kvserve.hardware import cpu_flags, machine

logger = logging.getLogger(__name__)

DISABLE_ENV = "KVSERVE_DISABLE_CPU_KERNEL"  # =1: never build or load; decode attention uses torch ops
BUILD_TIMEOUT_S = 900


@dataclass(frozen=True)
class IsaLevel:
    """One vector ISA torch dispatches to: its compiler flags (ATen's set for that CPU_CAPABILITY,
    plus F16C, which ATen's half-precision vector conversions need) and the CPU flags it requires."""

    name: str
    compiler_flags: tuple[str, ...]
    cpu_flags: frozenset[str]


_SPLIT_UNALIGNED = ("-mno-avx256-split-unaligned-load", "-mno-avx256-split-unaligned-store")
ISA_LEVELS = {
    "AVX512": IsaLevel("AVX512", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"),
                       frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"})),
    "AVX2": IsaLevel("AVX2", ("-mavx2", "-mfma", "-mf16c", *_SPLIT_UNALIGNED), frozenset({"avx2", "fma", "f16c"})),
    "DEFAULT": IsaLevel("DEFAULT", (), frozenset()),  # no x86 flags: aarch64 (NEON) and anything else
}
_X86 = ("x86_64", "amd64", "i686", "i386")


def runnable_isa_levels() -> list[str]:
    """The ISA levels this CPU can run, best first."""
    if machine() not in _X86:
        return ["DEFAULT"]
    flags = cpu_flags()
    return [name for name, level in ISA_LEVELS.items() if level.cpu_flags <= flags]


def current_isa() -> str:
    """The ISA torch dispatches its own kernels to (ATEN_CPU_CAPABILITY can lower it), stepped
    down to one this CPU really has."""
    reported = torch.backends.cpu.get_cpu_capability().upper()
    runnable = runnable_isa_levels()
    if reported in runnable:
        return reported
    order = list(ISA_LEVELS)
    below = [name for name in runnable if reported not in order or order.index(name) > order.index(reported)]
    return below[0] if below else "DEFAULT"


def kernel_cache_dir() -> Path:
    """Where built kernels live: the disk cache's directory; with that cache turned off
    (KVSERVE_CACHE_DIR=""), still ~/.cache/kvserve, since a kernel is not optional start-up work."""
    return (cache_root() or Path.home() / ".cache" / "kvserve") / "kernels"


@dataclass(frozen=True)
class KernelBuild:
    """One kernel source built for one ISA."""

    name: str  # the Python module name (TORCH_EXTENSION_NAME)
    source: Path
    isa: str
    headers: tuple[Path, ...] = ()  # local headers the source includes (part of the cache key)

    @property
    def flags(self) -> list[str]:
        level = ISA_LEVELS[self.isa]
        return ["-O3", "-fopenmp", *level.compiler_flags, f"-DCPU_CAPABILITY={self.isa}",
                f"-DCPU_CAPABILITY_{self.isa}"]

    @functools.cached_property
    def key(self) -> str:
        text = self.source.read_bytes() + b"".join(header.read_bytes() for header in self.headers)
        digest = hashlib.sha256(text + " ".join(self.flags).encode()).hexdigest()[:16]
        py = f"py{sys.version_info.major}{sys.version_info.minor}"
        return f"{self.name}-{machine()}-{py}-torch{torch.__version__}-{digest}"

    @property
    def directory(self) -> Path:
        return kernel_cache_dir() / self.key

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    def _sibling(self, suffix: str) -> Path:
        return self.directory.with_name(self.key + suffix)


def load_kernel(build: KernelBuild, compile_if_missing: bool = True, retry_failed: bool = False
                ) -> tuple[ModuleType | None, str]:
    """The built module, or None and why not. Builds it when missing (`compile_if_missing`),
    unless an earlier build with the same key failed (`retry_failed` tries again)."""
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None, f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    if build.library.exists():
        return _import(build)
    if not retry_failed and (why := _failed_reason(build)):
        return None, why
    if not compile_if_missing:
        return None, "not built"
    try:
        build.directory.parent.mkdir(parents=True, exist_ok=True)
        lock = open(build._sibling(".lock"), "a")
    except OSError as error:  # a read-only or misconfigured cache directory
        return None, f"cannot use the kernel cache {build.directory.parent}: {error.strerror or error}"
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process building the %s kernel (%s)", build.isa, build.directory)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:  # whoever held the lock may have finished or failed the same build
            if build.library.exists():
                return _import(build)
            if not retry_failed and (why := _failed_reason(build)):
                return None, why
            return _compile(build)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _import(build: KernelBuild) -> tuple[ModuleType | None, str]:
    try:
        spec = importlib.util.spec_from_file_location(build.name, build.library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module, ""
    except Exception as error:  # e.g. a library built against another torch under the same key
        return None, f"cannot load {build.library}: {_last_line(error)}"


def _failed_reason(build: KernelBuild) -> str | None:
    try:
        failure = json.loads(build._sibling(".failed").read_text())
        return (f"an earlier build failed ({failure['reason']}; compiler output in "
                f"{build._sibling('.failed.log')}; `kvserve build-kernel` tries again)")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _compile(build: KernelBuild) -> tuple[ModuleType | None, str]:
    """Build in a child process into a private directory, then rename that into place; called
    holding the lock. The child keeps torch's in-process extension state (which renames a module
    built twice under one name) out of this process, and its output goes to the failure log."""
    for stale in build.directory.parent.glob(build.key + ".build-*"):  # left by a builder that died
        shutil.rmtree(stale, ignore_errors=True)
    scratch = build._sibling(f".build-{os.getpid()}")
    scratch.mkdir()
    start = time.monotonic()
    logger.info("Building the CPU %s kernel for %s (once per machine and torch version; `kvserve build-kernel` "
                "does it at set-up)", build.name, build.isa)
    script = ("import sys, torch.utils.cpp_extension as ext; "
              "ext.load(name=sys.argv[1], sources=[sys.argv[2]], build_directory=sys.argv[3], "
              "extra_cflags=sys.argv[4:], extra_ldflags=['-fopenmp'])")
    command = [sys.executable, "-c", script, build.name, str(build.source), str(scratch), *build.flags]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                                stdin=subprocess.DEVNULL)
        output = result.stdout + result.stderr
        if result.returncode != 0 or not (scratch / f"{build.name}.so").exists():
            raise RuntimeError(output or f"the build exited with status {result.returncode}")
    except Exception as error:  # no compiler, no ninja, a compile error, a timeout: all mean "use torch ops"
        reason = _last_line(error)
        _write_atomic(build._sibling(".failed.log"), str(error))
        _write_atomic(build._sibling(".failed"), json.dumps({"reason": reason, "isa": build.isa, "time": time.time()}))
        shutil.rmtree(scratch, ignore_errors=True)
        return None, f"the build failed: {reason}"
    shutil.rmtree(build.directory, ignore_errors=True)  # a directory whose library was deleted by hand
    os.replace(scratch, build.directory)
    build._sibling(".failed").unlink(missing_ok=True)
    logger.info("CPU %s kernel (%s) built in %.1f s", build.name, build.isa, time.monotonic() - start)
    return _import(build)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _last_line(error: BaseException) -> str:
    """The informative line of an error: the compiler's first `error:` line where there is one
    (the last line of a failed build is ninja's 'build stopped')."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"(^|: )(fatal )?error:", line)]
    return (errors[0] if errors else lines[-1] if lines else type(error).__name__)[:400]
