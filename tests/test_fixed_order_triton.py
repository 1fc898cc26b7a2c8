"""`--deterministic` on the Triton path (CUDA), under Triton's interpreter on CPU: the fixed-blocking
GEMM gives each row the same bits at any row count and any place in its tile, the model's plain and
dequantized linears take it, and an engine whose every kernel is Triton's (attention, fused ops,
linears) gives a request the same tokens and logprobs alone and among others, chunked and after
prefix hits. On a machine with CUDA the same tests run on the GPU."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton compiles anything

pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")

from torch import nn  # noqa: E402

from kvserve import LLM, SamplingParams, fixed_order  # noqa: E402
from kvserve.engine import llm_engine  # noqa: E402
from kvserve.fixed_order_triton import fixed_order_linear  # noqa: E402
from kvserve.model import quant_linear  # noqa: E402
from kvserve.model.batch_invariant import make_batch_invariant  # noqa: E402
from kvserve.model.fixed_order_linear import FixedOrderLinear  # noqa: E402
from kvserve.model.quantized import quantize_int8  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(96, 64), (130, 200), (4160, 24)])
def test_a_rows_bits_do_not_depend_on_the_other_rows(dtype, n, k):
    """Rows alone, in slices starting inside a tile, and in the whole call: the same bits; close to
    torch's float32 product. (4160 columns: the wider tiles of wide layers; 200: a ragged K.)"""
    rows = 70 if n < 4096 else 40
    x, weight, bias = _randn(rows, k, seed=0, dtype=dtype), _randn(n, k, seed=1, dtype=dtype), \
        _randn(n, seed=2, dtype=dtype)
    full = fixed_order_linear(x, weight, bias)
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    ulp = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert torch.allclose(full.float(), expected, rtol=ulp, atol=ulp * 10)
    for start, count in ((0, 1), (5, 1), (rows - 1, 1), (3, 5), (1, 33), (rows - 17, 17)):
        assert torch.equal(fixed_order_linear(x[start: start + count], weight, bias), full[start: start + count]), \
            (start, count)
    assert torch.equal(fixed_order_linear(x[:6], weight), fixed_order_linear(x[:6].contiguous(), weight))
    assert fixed_order_linear(x[:0], weight).shape == (0, n)


def test_a_transposed_weight_and_leading_dimensions():
    """Strided operands (fixed_order_matmul passes matrix.T) and [..., K] inputs."""
    x, matrix = _randn(2, 5, 48, seed=3, dtype=torch.float32), _randn(48, 40, seed=4, dtype=torch.float32)
    out = fixed_order_linear(x, matrix.T)
    assert out.shape == (2, 5, 40)
    assert torch.allclose(out, x @ matrix, rtol=1e-5, atol=1e-4)
    assert torch.equal(out[1, 2:3], fixed_order_linear(x[1, 2:3], matrix.T))


def test_fixed_order_matmul_off_onednn_takes_the_gemm(monkeypatch):
    """Where oneDNN is not (CUDA), the KV rotations' and key basis' products take the Triton GEMM:
    rows the same bits at any row count."""
    monkeypatch.setattr(fixed_order, "onednn_packing_available", lambda device: False)
    x, matrix = _randn(45, 32, seed=8, dtype=torch.bfloat16), _randn(32, 32, seed=9, dtype=torch.float32)
    whole = fixed_order.fixed_order_matmul(x, matrix)
    assert whole.dtype == torch.bfloat16
    assert torch.equal(torch.cat([fixed_order.fixed_order_matmul(x[i: i + 3], matrix) for i in range(0, 45, 3)]), whole)
    assert torch.allclose(whole.float(), x.float() @ matrix, rtol=1e-2, atol=1e-2)


def test_cuda_refuses_it_without_the_fused_rms_norm(monkeypatch):
    """On CUDA RMSNorm is batch-invariant as the fused kernel's one program per row; with the fused
    ops turned off, start-up says so in one line rather than run torch's rms_norm."""
    from kvserve.engine.platforms.cuda import DISABLE_FUSED_OPS_ENV, CudaPlatform

    monkeypatch.setenv(DISABLE_FUSED_OPS_ENV, "1")
    model = nn.Module()
    model.batch_invariant = True
    with pytest.raises(ValueError, match=f"--deterministic on CUDA needs the fused Triton ops .* "
                                         f"{DISABLE_FUSED_OPS_ENV} is set") as error:
        CudaPlatform().prepare_model(model, None, False)
    assert "\n" not in str(error.value)


def test_the_models_linears_take_it(monkeypatch):
    """make_batch_invariant: a plain nn.Linear becomes a FixedOrderLinear (same parameters); a
    quantized linear that dequantizes on each call (as on CUDA) multiplies through it too."""
    # A QuantizedLinear as CUDA builds one: no CPU kernel, its codes kept to dequantize per call.
    monkeypatch.setattr(quant_linear, "load_lean_decode_module", lambda: (None, None))
    weight = _randn(64, 48, seed=5, dtype=torch.float32)  # 48 columns: not the torch int4 kernel's groups
    quantized = quant_linear.QuantizedLinear(quantize_int8(weight), None, torch.float32, DEVICE, keep_dense=False)
    assert quantized.gemv is None and not quantized.kernel and quantized.matrix is not None
    model = nn.Sequential(nn.Linear(48, 64).to(DEVICE), quantized)
    plain_weight = model[0].weight
    make_batch_invariant(model)
    assert isinstance(model[0], FixedOrderLinear) and model[0].weight is plain_weight and quantized.fixed_order
    x = _randn(37, 48, seed=6, dtype=torch.float32)
    with torch.inference_mode():
        for layer in model:
            whole = layer(x)
            assert torch.equal(torch.cat([layer(x[i: i + 1]) for i in range(len(x))]), whole)
    assert torch.allclose(model[1](x), torch.nn.functional.linear(x, quantized.matrix.dequantize()),
                          rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the refusal is for CPU without the interpreter")
def test_without_triton_a_plain_linear_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="multiplies through torch's float32 GEMM on cpu") as error:
        make_batch_invariant(nn.Sequential(nn.Linear(8, 8)))
    assert "\n" not in str(error.value)


def _prompts() -> list[list[int]]:
    """Four prompts of 17-20 tokens; pairs share a 16-token prefix (one block)."""
    generator = torch.Generator().manual_seed(7)
    prefixes = [torch.randint(5, 500, (16,), generator=generator).tolist() for _ in range(2)]
    return [prefixes[i // 2] + torch.randint(5, 500, (1 + i,), generator=generator).tolist() for i in range(4)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_an_all_triton_engine_gives_a_request_the_same_bits_alone_and_among_others(tiny_model_factory, monkeypatch,
                                                                                  kv_cache_dtype):
    """The CUDA configuration of --deterministic: plain linears (not CPU-prepacked) on the Triton
    GEMM, Triton attention, the fused Triton ops; fp8_e5m2's K/V rotation through the GEMM too.
    Each prompt alone, then all four among four others with 8-token chunks and prefix caching, then
    two of them again on prefix hits: the same tokens and logprobs, bit for bit; greedy and
    seeded sampling."""
    from kvserve.model import fused_ops

    model = tiny_model_factory("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=1)  # head_dim 32: what the Triton kernels take
    load = llm_engine.load_engine_model
    monkeypatch.setattr(llm_engine, "load_engine_model",
                        lambda args, loaded=None, prepack=True: load(args, loaded, prepack=False))
    monkeypatch.setattr(fixed_order, "onednn_packing_available", lambda device: False)  # as on CUDA
    prompts = _prompts()
    fillers = [p[::-1][:12 + i] for i, p in enumerate(prompts)]
    params = [SamplingParams(temperature=0, max_tokens=3, logprobs=0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=3, logprobs=0, ignore_eos=True)
              for i in range(len(prompts))]

    def result(output) -> tuple:
        completion = output.outputs[0]
        return (tuple(completion.token_ids),
                tuple(e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids)))

    def engine(**options) -> LLM:
        llm = LLM(str(model), deterministic=True, dtype="float32", attention_backend="triton",
                  device=str(DEVICE), kv_cache_memory="4MiB", kv_cache_dtype=kv_cache_dtype, **options)
        llm.engine.model.use_fused_ops(fused_ops)
        linears = [m for m in llm.engine.model.modules() if isinstance(m, nn.Linear)]
        assert linears and all(isinstance(m, FixedOrderLinear) for m in linears)
        return llm

    with engine(enable_prefix_caching=False) as llm:
        alone = [result(llm.generate([{"prompt_token_ids": p}], params[i], use_tqdm=False)[0])
                 for i, p in enumerate(prompts)]
    with engine(enable_prefix_caching=True, max_num_batched_tokens=8) as llm:
        requests = [{"prompt_token_ids": p} for pair in zip(prompts, fillers) for p in pair]
        filler_params = [SamplingParams(temperature=0, max_tokens=2)] * len(fillers)
        mixed_params = [p for pair in zip(params, filler_params) for p in pair]
        mixed = [result(o) for o in llm.generate(requests, mixed_params, use_tqdm=False)[::2]]
        again = llm.generate([{"prompt_token_ids": p} for p in prompts[1::2]], params[1::2], use_tqdm=False)
        assert all(o.num_cached_tokens > 0 for o in again)
    assert mixed == alone
    assert [result(o) for o in again] == alone[1::2]
