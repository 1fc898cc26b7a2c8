"""The fused Triton ops of the CUDA step (model/fused_ops.py) against the torch ops they replace,
under Triton's interpreter on CPU (the compiled kernels where CUDA is present): each kernel alone,
then a tiny model whose layers run through them gives the torch path's greedy tokens and logits."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported

pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model import fused_ops  # noqa: E402
from kvserve.model.llama import RMSNorm  # noqa: E402
from kvserve.model.rope import apply_rotary  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """float32: to float32 rounding; bfloat16: within one bfloat16 step of the value (exp and the
    square root may differ in their last bits between torch and the kernel, and a rounding then
    lands one step apart)."""
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
    return torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rms_norm_is_the_residual_add_then_rmsnorm(dtype, hidden):
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, hidden, generator=gen).to(DEVICE, dtype) for _ in range(2))
    norm = RMSNorm(hidden, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
        total = x + residual
        want = norm(total)
    got, got_total = fused_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert close(got_total, total, dtype) and close(got, want, dtype)
    alone, same = fused_ops.add_rms_norm(x, None, norm.weight, norm.eps)
    assert same is x
    with torch.no_grad():
        assert close(alone, norm(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_silu_of_gate_times_up(dtype):
    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert close(fused_ops.silu_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_apply_rotary(dtype):
    gen = torch.Generator().manual_seed(2)
    heads = torch.randn(7, 12, 64, generator=gen).to(DEVICE, dtype)
    angles = torch.rand(7, 1, 32, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(DEVICE, dtype)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1).to(DEVICE, dtype)
    qk = heads[:, :9]  # the q and k heads of a packed qkv row: not contiguous over heads
    assert close(fused_ops.rotary(qk, cos, signed_sin), apply_rotary(qk, cos, signed_sin), dtype)


def test_a_model_on_the_fused_ops_gives_the_torch_paths_tokens_and_logits(tiny_llama):
    """What the CUDA platform installs (CudaPlatform.prepare_model), on a float32 tiny model:
    chunked prefill and decodes of several lengths through the fused layers."""
    prompts = ["It is a truth universally acknowledged", "Hello", "Mr. Bennet was so odd a mixture of quick parts"]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=16,
              attention_backend="torch", device=str(DEVICE))
    want = llm.generate(prompts, greedy, use_tqdm=False)
    full = want[0].prompt_token_ids + want[0].outputs[0].token_ids
    want_logits = llm.engine.score(full, chunk_size=7)
    llm.engine.model.use_fused_ops(fused_ops)
    got = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert (llm.engine.score(full, chunk_size=7) - want_logits).abs().max().item() <= 1e-4


def test_the_cuda_platform_installs_the_fused_ops_unless_disabled(tiny_llama, monkeypatch):
    """What CudaPlatform.prepare_model does to a loaded model (here a CPU one, the kernels under the
    interpreter): the fused ops on every layer, or none with KVSERVE_DISABLE_FUSED_OPS=1."""
    from kvserve.engine.platforms import CudaPlatform

    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="4MiB", attention_backend="torch",
              device=str(DEVICE))
    model = llm.engine.model
    monkeypatch.setenv("KVSERVE_DISABLE_FUSED_OPS", "1")
    CudaPlatform().prepare_model(model, llm.engine.attention_backend, tensor_parallel=False)
    assert model.fused is None
    monkeypatch.delenv("KVSERVE_DISABLE_FUSED_OPS")
    CudaPlatform().prepare_model(model, llm.engine.attention_backend, tensor_parallel=False)
    assert model.fused is fused_ops
    assert all(layer.self_attn.fused is fused_ops and layer.mlp.fused is fused_ops for layer in model.layers)
