"""Triton's interpreter with a GPU's dot (each output sums over K in one order, wherever its row
lies), and without its repeated re-patching of `triton.language` on every nested jit call.

Under TRITON_INTERPRET=1 (how CI runs kvserve's Triton kernels on CPU) `tl.dot` is NumPy's matmul,
that is OpenBLAS. OpenBLAS's AVX2 (Haswell/Zen) sgemm kernel sums a row's products in an order
that depends on the row's place in the tile, so the same row gives other bits beside other rows;
its AVX-512 kernel and a GPU's MMA instructions do not. kvserve's batch invariance
(`--deterministic`: the fixed-order GEMM, the attention kernels' chunked prefill) rests on that
property, so its kernel modules swap the interpreter's dot for `np.einsum`, which sums each output
over K in order without BLAS. Nothing changes when Triton compiles for a GPU.

The interpreter also patches `triton.language` again on each call of one `@triton.jit` function
from another, inside a launch that has already patched it: a large share of an interpreted kernel's
overhead where helpers are called in loops (BENCHMARKS.md, "CI on a real AVX2-only CPU").
`skip_repeated_language_patches` leaves such a call to the launch's patch; `skip_overflow_checks`
drops the interpreter's integer overflow checks. All run once per process, under the interpreter only.
"""
from __future__ import annotations

import numpy as np

from kvserve.hardware import triton_interpreting


def prepare_interpreter() -> None:
    """Under the interpreter: row-invariant dots and no repeated language patches; else nothing."""
    if triton_interpreting():
        use_row_invariant_dots()
        skip_repeated_language_patches()
        skip_overflow_checks()


def skip_overflow_checks() -> None:
    """The interpreter checks every 32-bit integer add, subtract and multiply for overflow (in
    int64, then an assert), a third of an fp8 store kernel's time, where the fp8 conversion does
    its rounding on integer bit patterns. A compiled kernel makes no such check (Triton asserts
    only in debug builds), and the tests' tiny pools keep index arithmetic far from 2^31, so
    kvserve's tests run without it; TRITON_INTERPRET_OVERFLOW_CHECKS=1 keeps it."""
    import dataclasses
    import os

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if os.environ.get("TRITON_INTERPRET_OVERFLOW_CHECKS") == "1" or not hasattr(options, "sanitize_overflow"):
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=False)


def use_row_invariant_dots() -> None:
    """Make the interpreter's `tl.dot` row-invariant (once per process)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "row_invariant", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)  # its fp8 widening
        product = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    create_dot.row_invariant = True
    builder.create_dot = create_dot


def skip_repeated_language_patches() -> None:
    """A nested jit call whose `triton.language` modules are already patched within the launch in
    progress runs without patching them again. The interpreter never restores a nested call's
    patch, so what one nested call patched (triton's own jit helpers patch `triton.language.core`)
    stays patched until the launch ends; each launch starts afresh. Does nothing where the
    interpreter lacks the pieces it wraps (written against triton 3.9's)."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "skips_repeats", False):
        return
    launch, nested = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    languages = (interpreter.tl, interpreter.tl.core)
    patched: list[set[int]] = []  # per launch in progress: the modules patched so far
    skip = [False]
    seen: dict[int, frozenset[int]] = {}

    def languages_of(fn) -> frozenset[int]:
        key = id(fn.__globals__)
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values() if any(v is lang for lang in languages))
        return seen[key]

    def patch_lang(fn):
        if skip[0]:
            return None  # a nested call: its result is never used
        return patch(fn)

    def launch_call(self, *args, **kwargs):
        patched.append(set(languages_of(self.fn)))
        outer, skip[0] = skip[0], False
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()
            skip[0] = outer

    def nested_call(self, *args, **kwargs):
        outer, needs = skip[0], languages_of(self.fn)
        skip[0] = bool(patched) and needs <= patched[-1]
        if patched and not skip[0]:
            patched[-1] |= needs  # this call patches them, for the rest of the launch
        try:
            return nested(self, *args, **kwargs)
        finally:
            skip[0] = outer

    patch_lang.skips_repeats = True
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch_call
    interpreter.InterpretedFunction.__call__ = nested_call
