"""CPU linears: prepacked weights for batches (bf16 and float32), torch's GEMV for a single bf16 row."""
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
needs_onednn = pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                                       and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")),
                                  reason="torch is built without oneDNN")


def _linear(in_features: int = 96, out_features: int = 160, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)


@needs_prepacking
@pytest.mark.parametrize("rows", [1, 2, 7])
@pytest.mark.parametrize("keep_plain", [True, False])
def test_prepacked_linear_matches_float32_reference(rows, keep_plain):
    linear = _linear()
    x = torch.randn(rows, linear.in_features).to(torch.bfloat16)
    expected = x.float() @ linear.weight.float().T + linear.bias.float()
    out = PrepackedLinear(linear, keep_plain)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, linear.out_features)
    # float32 accumulation, one bfloat16 rounding of the result (8 significant bits)
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -7, atol=1e-2)


@needs_prepacking
def test_single_row_takes_the_native_gemv_and_restores_onednn(monkeypatch):
    calls = []
    native = cpu_linear.native_linear

    def spy(x, weight, bias):
        calls.append(x.shape[0])
        return native(x, weight, bias)

    monkeypatch.setattr(cpu_linear, "native_linear", spy)
    layer = PrepackedLinear(_linear(), keep_plain=True)
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
def test_plain_copy_is_kept_only_when_it_fits_a_quarter_of_available_ram(monkeypatch):
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
def test_no_plain_copy_where_onednn_runs_amx(monkeypatch):
    """On AMX the prepacked kernel beats torch's GEMV at one row too: no second copy of the weights."""
    monkeypatch.setattr(cpu_linear, "onednn_runs_amx", lambda: True)
    model = _TiedModel()
    weight = model.proj.weight.detach().float()
    prepack_linears(model)
    assert model.proj.plain is None and model.head.plain is None
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
    layer = PrepackedLinear(linear, keep_plain=False)
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
    assert model.proj.plain is None and model.head.plain is None
    x = torch.randn(1, 64)
    torch.testing.assert_close(model.proj(x), x @ weight.T, rtol=1e-5, atol=1e-5)
