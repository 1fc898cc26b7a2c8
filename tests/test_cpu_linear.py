"""CPU linears: bf16 weights on kvserve's AVX512-BF16 kernel where the CPU has it; elsewhere
oneDNN-prepacked weights (bf16 and float32) and torch's GEMV for a single bf16 row."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve import hardware
from kvserve.model import cpu_linear
from kvserve.model.cpu_linear import PrepackedLinear, prepack_linears, prepacking_available

needs_prepacking = pytest.mark.skipif(not prepacking_available(torch.device("cpu"), torch.bfloat16),
                                      reason="needs oneDNN bf16 prepacking on CPU")
# (not prepacking_available itself, which the float32 tests check)
needs_bf16_kernel = pytest.mark.skipif(cpu_linear.bf16_kernel() is None,
                                       reason="needs AVX512-BF16 without AMX and the lean decode kernel built")
needs_onednn = pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                                       and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")),
                                  reason="torch is built without oneDNN")


def _linear(in_features: int = 96, out_features: int = 160, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)


@pytest.fixture
def without_bf16_kernel(monkeypatch):
    """The machine as one without kvserve's bf16 kernel: oneDNN's packed weight, and the plain one."""
    monkeypatch.setattr(cpu_linear, "bf16_kernel", lambda: None)


@needs_prepacking
@pytest.mark.parametrize("rows", [1, 2, 7])
@pytest.mark.parametrize("keep_copy", [True, False])
def test_prepacked_linear_matches_float32_reference(rows, keep_copy, without_bf16_kernel):
    linear = _linear()
    x = torch.randn(rows, linear.in_features).to(torch.bfloat16)
    expected = x.float() @ linear.weight.float().T + linear.bias.float()
    out = PrepackedLinear(linear, keep_copy)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, linear.out_features)
    # float32 accumulation, one bfloat16 rounding of the result (8 significant bits)
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -7, atol=1e-2)


@needs_prepacking
@needs_bf16_kernel
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_kernel_takes_every_row_count_and_matches_float32_reference(bias, monkeypatch):
    """One copy of the weight, in the kernel's layout, for every row count (every remainder of its
    4-row, 96-column tiles: 160 columns are one full panel and four blocks)."""
    linear = _linear(bias=bias)
    layer = PrepackedLinear(linear, keep_copy=True)
    assert layer.kernel_weight is not None and layer.packed is None and layer.plain is None
    calls = []
    kernel = layer._kernel_matmul
    monkeypatch.setattr(layer, "_kernel_matmul", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    row_counts = [1, 2, 3, 4, 5, 11, 32, 33, 300]
    for rows in row_counts:
        x = torch.randn(rows, linear.in_features).to(torch.bfloat16)
        expected = x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0)
        out = layer(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, linear.out_features)
        torch.testing.assert_close(out.float(), expected, rtol=2 ** -7, atol=1e-2)
    assert calls == row_counts
    x = torch.randn(2, 3, linear.in_features).to(torch.bfloat16)  # leading dimensions kept
    torch.testing.assert_close(layer(x), layer(x.view(6, -1)).view(2, 3, -1))


@needs_bf16_kernel
def test_bf16_kernel_rejects_what_it_cannot_multiply():
    kernel = cpu_linear.bf16_kernel()
    assert not kernel.bf16_fits(100, 64) and not kernel.bf16_fits(64, 63) and kernel.bf16_fits(64, 64)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.bf16_pack(torch.zeros(100, 64, dtype=torch.bfloat16))
    packed = kernel.bf16_pack(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="columns"):
        kernel.bf16_matmul(torch.zeros(2, 32, dtype=torch.bfloat16), packed, None)
    # 100 outputs: oneDNN's packed weight and the GEMV's plain copy
    layer = PrepackedLinear(nn.Linear(64, 100, bias=False).to(torch.bfloat16), keep_copy=True)
    assert layer.kernel_weight is None and layer.packed is not None and layer.plain is not None


@needs_bf16_kernel
def test_bf16_kernel_is_not_used_where_onednn_runs_amx(monkeypatch):
    monkeypatch.setattr(cpu_linear, "onednn_runs_amx", lambda: True)
    assert cpu_linear.bf16_kernel() is None


@needs_prepacking
def test_single_row_takes_the_native_gemv_and_restores_onednn(monkeypatch, without_bf16_kernel):
    calls = []
    native = cpu_linear.native_linear

    def spy(x, weight, bias):
        calls.append(x.shape[0])
        return native(x, weight, bias)

    monkeypatch.setattr(cpu_linear, "native_linear", spy)
    layer = PrepackedLinear(_linear(), keep_copy=True)
    x = torch.randn(3, layer.in_features).to(torch.bfloat16)
    layer(x[:1])
    layer(x)
    assert calls == [1], "one row goes to the GEMV, several rows to the prepacked kernel"
    assert torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        native(x[:1], layer.plain, layer.bias)
        assert not torch._C._get_mkldnn_enabled(), "the caller's setting is restored, not forced on"
    finally:
        torch._C._set_mkldnn_enabled(True)


class _TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(200, 64).to(torch.bfloat16)
        self.proj = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
        self.head = nn.Linear(64, 200, bias=False).to(torch.bfloat16)
        self.head.weight = self.embed.weight


@needs_prepacking
def test_plain_copy_is_kept_only_when_it_fits_a_quarter_of_available_ram(monkeypatch, without_bf16_kernel):
    proj_bytes = 64 * 64 * 2  # the tied head shares the embedding: its plain weight costs nothing
    monkeypatch.setattr(cpu_linear, "onednn_runs_amx", lambda: False)
    monkeypatch.setattr(cpu_linear, "available_ram_bytes", lambda: 4 * proj_bytes)
    model = _TiedModel()
    assert prepack_linears(model) == 2
    assert model.proj.plain is not None
    assert model.head.plain.data_ptr() == model.embed.weight.data_ptr()

    monkeypatch.setattr(cpu_linear, "available_ram_bytes", lambda: 4 * proj_bytes - 1)
    model = _TiedModel()
    weight = model.proj.weight.detach().float()
    prepack_linears(model)
    assert model.proj.plain is None and model.head.plain is None
    x = torch.randn(1, 64).to(torch.bfloat16)  # a single row still works, through the packed weights
    torch.testing.assert_close(model.proj(x).float(), x.float() @ weight.T, rtol=2 ** -7, atol=1e-2)


@needs_prepacking
@needs_bf16_kernel
def test_layers_on_the_bf16_kernel_keep_one_copy(monkeypatch):
    """A layer the kernel fits holds its weight once; a head of 200 outputs (not a multiple of 16)
    stays on oneDNN and keeps its plain weight, the embedding's, at no cost; no RAM is needed for
    copies then, so the kernel's layers do not depend on the quarter-of-RAM rule."""
    monkeypatch.setattr(cpu_linear, "onednn_runs_amx", lambda: False)
    monkeypatch.setattr(cpu_linear, "available_ram_bytes", lambda: 0)
    model = _TiedModel()
    weight = model.proj.weight.detach().float()
    prepack_linears(model)
    assert model.proj.kernel_weight is not None and model.proj.packed is None and model.proj.plain is None
    assert model.head.kernel_weight is None and model.head.plain.data_ptr() == model.embed.weight.data_ptr()
    x = torch.randn(3, 64).to(torch.bfloat16)
    torch.testing.assert_close(model.proj(x).float(), x.float() @ weight.T, rtol=2 ** -7, atol=1e-2)


@needs_prepacking
def test_no_plain_copy_where_onednn_runs_amx(monkeypatch):
    """On AMX the prepacked kernel beats torch's GEMV at one row too: no second copy of the weights."""
    monkeypatch.setattr(cpu_linear, "onednn_runs_amx", lambda: True)
    model = _TiedModel()
    weight = model.proj.weight.detach().float()
    prepack_linears(model)
    assert model.proj.plain is None and model.head.plain is None
    assert model.proj.kernel_weight is None and model.head.kernel_weight is None
    x = torch.randn(1, 64).to(torch.bfloat16)
    torch.testing.assert_close(model.proj(x).float(), x.float() @ weight.T, rtol=2 ** -7, atol=1e-2)


def test_amx_is_seen_only_where_the_cpu_has_it_and_onednn_may_use_it(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16", "amx_tile"}))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert hardware.onednn_runs_amx()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert not hardware.onednn_runs_amx()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert hardware.onednn_runs_amx()
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert not hardware.onednn_runs_amx()


@needs_onednn
def test_no_bf16_prepacking_where_onednn_cannot_run_bf16(monkeypatch):
    """An AVX2-only CPU: torch's bf16 reorder would raise, so bf16 linears stay plain nn.Linear;
    float32 ones are still prepacked there."""
    monkeypatch.setattr(cpu_linear, "onednn_bf16_missing", lambda: "no avx512bw here")
    assert not prepacking_available(torch.device("cpu"), torch.bfloat16)
    assert prepacking_available(torch.device("cpu"), torch.float32)
    assert not prepacking_available(torch.device("meta"), torch.float32)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 300])
def test_prepacked_float32_linear_matches_f_linear(rows):
    linear = _linear().float()
    x = torch.randn(rows, linear.in_features)
    expected = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    layer = PrepackedLinear(linear, keep_copy=False)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, linear.out_features)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # a leading batch dimension, as the model's [tokens, hidden] views may have
    torch.testing.assert_close(layer(x.view(1, rows, -1)).view(rows, -1), out)


@needs_onednn
def test_float32_model_is_prepacked_without_plain_copies():
    """float32's packed kernel is the faster one at one row too (cpu_linear.py), so no second copy."""
    model = _TiedModel().float()
    weight = model.proj.weight.detach().clone()
    assert prepack_linears(model) == 2
    assert model.proj.plain is None and model.head.plain is None and model.proj.kernel_weight is None
    x = torch.randn(1, 64)
    torch.testing.assert_close(model.proj(x), x @ weight.T, rtol=1e-5, atol=1e-5)
