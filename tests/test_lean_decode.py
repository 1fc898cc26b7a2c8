"""The lean decode step (kvserve/model/lean_decode.py): decode-only steps of a model on the quantized
small-batch kernel run each layer as two fused C++ calls, and compute what the module path computes.

Both paths quantize each matmul's input row to 8 bits per group of 32 (quant_gemv.h), so a last-bit
difference upstream (the fused RMSNorm sums in another order) can move one code by one step: the
paths agree to within that (LOGPROB_TOLERANCE), not bit for bit; a wrong RoPE, norm or residual
would be far outside it."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.quant_linear import gemv_operands
from kvserve.model.quantized import quantize_int4, quantize_int8
from kvserve.model.lean_decode import LeanDecoder
from kvserve.model.lean_kernel import load_lean_decode_module

LOGPROB_TOLERANCE = 0.1
PROMPTS = [{"prompt_token_ids": list(range(5 + i, 21 + 3 * i))} for i in range(3)]  # decode batch of 3


@pytest.fixture(scope="module")
def lean_module():
    module, why = load_lean_decode_module()
    if module is None:
        pytest.skip(f"the lean decode kernel is unavailable here: {why}")
    return module


@pytest.fixture(autouse=True)
def _kernel_builds(lean_module):
    pass


def served_weight(operands: tuple, bits: int, out: int, cols: int) -> torch.Tensor:
    """The float32 weight the kernel multiplies by, from its operands (quant_gemv.h's layout: 4-bit
    codes of eight rows interleaved, each byte holding columns 4c+j low and 16+4c+j high)."""
    codes, scales, offsets = operands
    if bits == 8:
        return (codes.float().view(out, -1, 32) * scales.float()[..., None]).view(out, cols)
    blocks, groups = out // 8, cols // 32
    packed = codes.view(blocks, groups, 4, 8, 4)  # [block, group, chunk, row, column]
    codes4 = torch.stack((packed & 15, packed >> 4), dim=2)  # [block, group, half, chunk, row, column]
    codes4 = codes4.permute(0, 4, 1, 2, 3, 5).reshape(out, groups, 32).float()

    def rows_first(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(blocks, groups, 8).transpose(1, 2).reshape(out, groups, 1)

    return (codes4 * rows_first(scales) + rows_first(offsets)).view(out, cols)


def quantized_rows(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x rounded per group of 32 to `levels` steps each side of zero (the kernel's activations)."""
    groups = x.float().view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    # (not `levels / amax`: torch computes that as a reciprocal times levels, not the kernel's quotient)
    inverse = torch.where(amax > 0, torch.full_like(amax, levels) / amax, 0)
    codes = torch.round(groups * inverse)
    return (codes * amax / levels).view(x.shape)


def check_gemv_against_the_definition(module) -> None:
    """gemv(x) = x_q W^T to float32 summation error, for 4-bit (odd and even group counts) and
    8-bit weights, 1 to 70 rows (every tail of the kernel's tiles of four), float32 and bfloat16
    activations."""
    torch.manual_seed(0)
    for quantize, cols in ((quantize_int4, 128), (quantize_int4, 96), (quantize_int8, 128)):
        matrix = quantize(torch.randn(80, cols))
        operands = gemv_operands(matrix)
        weight = served_weight(operands, matrix.bits, 80, cols)
        assert (weight - matrix.dequantize()).abs().max() <= 2e-3 * matrix.dequantize().abs().max()  # float16 scales
        for rows in (1, 3, 5, 16, 70):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, cols).to(dtype)
                expected = quantized_rows(x, 127 if matrix.bits == 4 else 32767) @ weight.T
                assert (module.gemv(x, *operands) - expected).abs().max() <= 1e-5 * cols, (matrix.bits, rows, dtype)


def test_gemv_computes_with_its_served_weight_and_quantized_activations(lean_module):
    check_gemv_against_the_definition(lean_module)


@pytest.mark.slow
def test_gguf_weights_are_served_exactly():
    """Every Q4_1 and Q8_0 matrix of the default GGUF in the kernel's form: float16 scales and offsets
    are exact for them, so the served weight is the dequantized one bit for bit."""
    import kvserve.engine.loading as loading  # its load_model is the session's cached loader (conftest.py)
    from kvserve.model.loader import quantized_sources

    sources = quantized_sources(loading.load_model(None))
    for name, matrix in sources.items():
        out, cols = matrix.shape
        assert torch.equal(served_weight(gemv_operands(matrix), matrix.bits, out, cols), matrix.dequantize()), name


def _run(llm: LLM, lean: bool, monkeypatch) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens, their logprobs and the number of fused steps, with the lean path on or off."""
    model = llm.engine.model
    saved = model.lean
    model.lean = saved if lean else None
    try:
        return _run_prompts(llm, PROMPTS, monkeypatch)
    finally:
        model.lean = saved


def _run_prompts(llm: LLM, prompts: list, monkeypatch) -> tuple[list[list[int]], list[list[float]], int]:
    calls = []
    original = LeanDecoder.run

    def counted(self, *args):
        calls.append(args[0].shape[0])
        return original(self, *args)

    monkeypatch.setattr(LeanDecoder, "run", counted)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=1), use_tqdm=False)
    completions = [o.outputs[0] for o in outs]
    return ([c.token_ids for c in completions],
            [[e[t].logprob for e, t in zip(c.logprobs, c.token_ids)] for c in completions], len(calls))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: a qkv bias; qwen3: q/k norms
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_fused_decode_layers_compute_what_the_modules_compute_at_float32(tiny_model_factory, arch, quantization,
                                                                         monkeypatch):
    llm = LLM(str(tiny_model_factory(arch)), dtype="float32", quantization=quantization, kv_cache_memory="16MiB")
    assert llm.engine.model.lean is not None
    fused_tokens, fused_logprobs, fused_steps = _run(llm, True, monkeypatch)
    plain_tokens, plain_logprobs, plain_steps = _run(llm, False, monkeypatch)
    assert fused_steps == 7 and plain_steps == 0  # every decode step (the 8th token's), none of the prefill
    assert fused_tokens == plain_tokens
    for fused, plain in zip(fused_logprobs, plain_logprobs):
        assert fused == pytest.approx(plain, abs=LOGPROB_TOLERANCE)


def test_an_8_bit_kv_pool_keeps_its_own_write_and_read_under_the_fused_layers(tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), dtype="float32", quantization="int4", kv_cache_dtype="int8", kv_cache_memory="16MiB")
    fused_tokens, fused_logprobs, fused_steps = _run(llm, True, monkeypatch)
    plain_tokens, plain_logprobs, _ = _run(llm, False, monkeypatch)
    assert fused_steps == 7 and fused_tokens == plain_tokens
    for fused, plain in zip(fused_logprobs, plain_logprobs):
        assert fused == pytest.approx(plain, abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int4"])  # a calibrated key basis; key centres and a rotation
def test_kv_formats_that_transform_keys_take_the_module_path(tiny_llama, kv_cache_dtype, monkeypatch):
    llm = LLM(str(tiny_llama), dtype="float32", quantization="int4", kv_cache_dtype=kv_cache_dtype,
              kv_cache_memory="16MiB")
    fused_tokens, _, fused_steps = _run(llm, True, monkeypatch)
    assert fused_steps == 0 and fused_tokens == _run(llm, False, monkeypatch)[0]


def test_bfloat16_model_agrees_within_its_rounding(tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), dtype="bfloat16", quantization="int4", kv_cache_memory="16MiB")
    fused_tokens, fused_logprobs, fused_steps = _run(llm, True, monkeypatch)
    plain_tokens, plain_logprobs, _ = _run(llm, False, monkeypatch)
    assert fused_steps == 7 and fused_tokens == plain_tokens
    for fused, plain in zip(fused_logprobs, plain_logprobs):
        assert fused == pytest.approx(plain, abs=2 * LOGPROB_TOLERANCE)  # and bfloat16 rounding


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batches_past_the_kernel_rows_run_fused_through_the_dense_copies(tiny_llama, dtype, monkeypatch):
    """A decode batch larger than the int kernel takes (here 2 rows) still runs the fused layers,
    multiplying through the layers' oneDNN-packed dense copies, and gives the module path's tokens."""
    import kvserve.model.quant_linear as quant_linear
    from kvserve.model.cpu_linear import prepacking_available

    if not prepacking_available(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"oneDNN cannot prepack {dtype} linears on this CPU, so the dense copies are plain")
    monkeypatch.setattr(quant_linear, "kernel_max_rows", lambda dtype, bits=None: 2)
    llm = LLM(str(tiny_llama), dtype=dtype, quantization="int4", kv_cache_memory="16MiB")
    lean = llm.engine.model.lean
    assert lean.kernel_rows == 2 and lean.max_rows > len(PROMPTS)
    # bf16: RoPE rounds once here and after each product on the module path, which can flip a
    # near-tied token of this random model late in a sequence, not before half of it
    _check_fused_decode_steps_match_the_modules(llm, dtype, monkeypatch, agree_for_half=True)


def _check_fused_decode_steps_match_the_modules(llm: LLM, dtype: str, monkeypatch,
                                                agree_for_half: bool = False) -> None:
    """Every decode step fused, and the module path's tokens: all of them in float32; in bf16, which
    rounds in other places (RoPE once here, after each product there; the norms' output) and can
    flip a near tie of the random model, the same logprobs up to the first difference (at least half
    the tokens with `agree_for_half`) and there two picks within rounding."""
    fused_tokens, fused_logprobs, fused_steps = _run(llm, True, monkeypatch)
    plain_tokens, plain_logprobs, _ = _run(llm, False, monkeypatch)
    assert fused_steps == 7
    if dtype == "float32":
        assert fused_tokens == plain_tokens
    for fused, plain, fused_lp, plain_lp in zip(fused_tokens, plain_tokens, fused_logprobs, plain_logprobs):
        same = next((i for i, (a, b) in enumerate(zip(fused, plain)) if a != b), len(plain))
        assert not agree_for_half or same >= len(plain) // 2, (fused, plain)
        assert fused_lp[:same] == pytest.approx(plain_lp[:same], abs=2 * LOGPROB_TOLERANCE)
        if same < len(plain):
            assert abs(fused_lp[same] - plain_lp[same]) <= 2 * LOGPROB_TOLERANCE, (fused, plain)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_precision_weights_run_fused_through_their_packed_weights(tiny_llama, dtype, monkeypatch):
    """`--quantization none`: the layers' packed weights (oneDNN's, or in bf16 on AVX512-BF16 the
    kernel's) take every decode batch the fused layers serve (not a single row where the module path
    keeps a plain copy for torch's GEMV), with the module path's tokens."""
    from kvserve.model.cpu_linear import bf16_kernel, prepacking_available

    if not prepacking_available(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"oneDNN cannot prepack {dtype} linears on this CPU, so the layers stay nn.Linear")
    llm = LLM(str(tiny_llama), dtype=dtype, quantization="none", kv_cache_memory="16MiB")
    lean = llm.engine.model.lean
    assert lean is not None and lean.kernel_rows == 0 and lean.max_rows > len(PROMPTS)
    down_proj = llm.engine.model.layers[0].mlp.down_proj
    plain_copy = down_proj.plain is not None
    assert lean.min_rows == (2 if plain_copy else 1)
    if dtype == "bfloat16" and bf16_kernel() is not None:
        # AVX512-BF16: both paths multiply through the kernel's one copy of each weight
        assert down_proj.kernel_weight is not None and not plain_copy
        assert lean.layers[0].dense.down[0] is down_proj.kernel_weight
    _check_fused_decode_steps_match_the_modules(llm, dtype, monkeypatch)
    if lean.min_rows == 2:  # a lone sequence decodes through the plain copy, off the fused path
        _, _, single_steps = _run_prompts(llm, PROMPTS[:1], monkeypatch)
        assert single_steps == 0


def test_not_used_where_the_linears_are_plain_modules(tiny_llama, monkeypatch):
    import kvserve.model.llama as llama

    monkeypatch.setattr(llama, "prepacking_available", lambda device, dtype: False)
    llm = LLM(str(tiny_llama), dtype="float32", quantization="none", kv_cache_memory="16MiB")
    assert llm.engine.model.lean is None
    decoder, why = LeanDecoder.for_model(llm.engine.model)
    assert decoder is None and "quantized small-batch kernel or oneDNN-packed" in why


def test_big_batches_and_prefill_take_the_module_path(tiny_llama, monkeypatch):
    """More decode rows than the fused layers take (lean_decode.MAX_ROWS, or the rows the kernel
    serves before a dense copy): no fused step."""
    llm = LLM(str(tiny_llama), dtype="float32", quantization="int4", kv_cache_memory="16MiB")
    llm.engine.model.lean.max_rows = rows = 4
    calls = []
    original = LeanDecoder.run
    monkeypatch.setattr(LeanDecoder, "run", lambda self, *a: calls.append(a[0].shape[0]) or original(self, *a))
    prompts = [{"prompt_token_ids": list(range(5 + i, 15 + i))} for i in range(rows + 1)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert all(n <= rows for n in calls)
