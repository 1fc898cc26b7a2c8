"""kvserve's adjustments to Triton's interpreter (kvserve/triton_interpreter.py), which is how CI runs
the GPU kernels on CPU: a kernel calling jit helpers in a loop gives NumPy's answer and patches
`triton.language` a bounded number of times per launch, not once per helper call."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the interpreter's adjustments apply on CPU only; CUDA compiles the kernels",
                allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from kvserve.triton_interpreter import prepare_interpreter  # noqa: E402

STEPS = 16


@triton.jit
def _row_max_plus(x, y):
    return tl.max(x, axis=0) + y  # tl.max: a jit helper of triton's own (triton.language.core)


@triton.jit
def _loop_kernel(x_ptr, out_ptr, N: tl.constexpr, STEPS: tl.constexpr):
    offsets = tl.arange(0, N)
    total = tl.zeros((), dtype=tl.float32)
    for step in range(STEPS):
        x = tl.load(x_ptr + step * N + offsets)
        total = _row_max_plus(x, total)
    tl.store(out_ptr, total)


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rows, inner, cols = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rows[:, None] * K + inner[None, :])
    b = tl.load(b_ptr + inner[:, None] * N + cols[None, :])
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], tl.dot(a, b, input_precision="ieee"))


def test_nested_helpers_patch_the_language_a_bounded_number_of_times_per_launch(monkeypatch):
    prepare_interpreter()
    calls = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    x = torch.randn(STEPS, 32, generator=torch.Generator().manual_seed(0))
    out = torch.zeros(1)
    for _ in range(2):  # a second launch starts afresh and gives the same answer
        _loop_kernel[(1,)](x, out, N=32, STEPS=STEPS)
        assert out.item() == pytest.approx(x.max(dim=1).values.sum().item(), rel=1e-6)
    # One patch of triton.language for the launch, one of triton.language.core for the first call of
    # tl.max (each a handful of _patch_builtin calls); without the adjustment, every one of the
    # 2 x 16 helper calls (and tl.max's own nested calls) patches again.
    assert len(calls) <= 2 * 10, len(calls)


def test_a_rows_dot_does_not_depend_on_its_place_in_the_tile():
    prepare_interpreter()
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 64, generator=gen), torch.randn(64, 32, generator=gen)
    whole = torch.empty(64, 32)
    _dot_kernel[(1,)](a, b, whole, M=64, K=64, N=32)
    for shift in (1, 3, 7):
        shifted = torch.roll(a, shift, dims=0)
        out = torch.empty(64, 32)
        _dot_kernel[(1,)](shifted, b, out, M=64, K=64, N=32)
        assert torch.equal(torch.roll(out, -shift, dims=0), whole), shift
    np.testing.assert_allclose(whole.numpy(), (a.double() @ b.double()).numpy(), rtol=1e-4, atol=1e-4)
