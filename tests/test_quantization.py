"""Weight-only quantization (`--quantization`; kvserve/model/quantized.py, quant_linear.py): a GGUF's
quantized blocks are served as stored, the int kernels compute with the weights they were given,
and each mode is a working engine option."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams
from kvserve.model.gguf_file import GGUFTensor, quantized_matrix
from kvserve.model import quant_linear
from kvserve.model.quant_linear import QuantizedLinear, quantize_linears, quantized_bytes, served_matrix_bytes
from kvserve.model.quantized import CompactMatrix, pack_nibbles, quantize_int4, quantize_int8, unpack_nibbles

from tiny_models import random_k_quant_blocks

QUANTIZED_TYPES = [gguf.GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q8_0")]


def _gguf_tensor(qtype: gguf.GGMLQuantizationType, values: np.ndarray) -> tuple[GGUFTensor, np.ndarray]:
    """`values` quantized by the gguf package, as kvserve's reader would hold them, and gguf's
    own float32 dequantization of them."""
    raw = gguf.quants.quantize(values, qtype)
    tensor = GGUFTensor("t", values.shape, int(qtype), torch.from_numpy(raw.reshape(-1).copy()))
    return tensor, gguf.quants.dequantize(raw, qtype).astype(np.float32)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_gguf_blocks_kept_quantized_dequantize_like_gguf_bit_for_bit(qtype):
    values = np.random.default_rng(int(qtype)).standard_normal((12, 256)).astype(np.float32) * 0.05
    values[3] += 0.2  # rows whose minimum is far from zero (Q4_1's m)
    tensor, expected = _gguf_tensor(qtype, values)
    matrix = quantized_matrix(tensor)
    assert matrix.bits == (8 if qtype == gguf.GGMLQuantizationType.Q8_0 else 4) and matrix.group_size == 32
    if matrix.bits == 4:  # one value per byte, 0..15: the int4 kernel's input
        assert matrix.q.dtype == torch.uint8 and int(matrix.q.max()) <= 15
    got = matrix.dequantize()
    assert torch.equal(got.view(torch.int32), torch.from_numpy(expected).view(torch.int32)), qtype.name


def _k_quant_tensor(qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> tuple[GGUFTensor, torch.Tensor]:
    """Random k-quant super-blocks as kvserve's reader holds them, and gguf's float32 dequantization of them."""
    raw = random_k_quant_blocks(qtype, rows, cols)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).copy())
    return GGUFTensor("t", (rows, cols), int(qtype), torch.from_numpy(raw.reshape(-1).copy())), expected


def test_q4_k_is_served_as_its_own_4_bit_codes():
    """Q4_K (a Q4_K_M file's most tensors): each 32-value sub-block is a 4-bit group with scale d*s
    and offset -dmin*m: the codes as stored, the values gguf's (to float32 rounding of the sums)."""
    tensor, expected = _k_quant_tensor(gguf.GGMLQuantizationType.Q4_K, 24, 512)
    matrix = quantized_matrix(tensor)
    assert matrix.bits == 4 and matrix.group_size == 32 and int(matrix.q.max()) <= 15
    assert torch.allclose(matrix.dequantize(), expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("name", ["Q5_K", "Q6_K", "Q2_K", "Q3_K", "Q5_0", "IQ4_NL", "IQ4_XS"])
def test_other_quantized_types_are_served_as_int8_groups(name):
    """Q5_K and Q6_K (a k-quant file's attn_v, ffn_down, output), the 2- and 3-bit k-quants, Q5_0
    and the IQ types as int8 per 32 values: within half an 8-bit step of gguf's values."""
    tensor, expected = _k_quant_tensor(gguf.GGMLQuantizationType[name], 8, 512)
    matrix = quantized_matrix(tensor)
    assert matrix.bits == 8 and matrix.group_size == 32
    steps = expected.view(8, -1, 32).abs().amax(-1, keepdim=True) / 127
    assert ((matrix.dequantize() - expected).view(8, -1, 32).abs() <= steps / 2 * 1.001).all()


@pytest.mark.slow
def test_default_gguf_quantized_weights_are_the_dequantized_ones():
    """Every Q4_1/Q8_0 matrix of the default model kept quantized (q/k rows un-permuted as the
    dense path does) dequantizes to exactly the float32 weight `--quantization none` loads."""
    from kvserve.model.loader import load_model, quantized_sources

    loaded = load_model(None)
    sources = quantized_sources(loaded)
    assert len(sources) == 211  # 30 layers x 7 matrices + token_embd
    assert sources["embed_tokens.weight"].bits == 8 and sources["layers.0.self_attn.q_proj.weight"].bits == 4
    assert "embed_tokens.weight" not in quantized_sources(loaded, with_head=False)  # the tied head's
    for name, matrix in sources.items():
        assert torch.equal(matrix.dequantize(), loaded.weights[f"model.{name}"]), name


def test_a_type_gguf_cannot_dequantize_is_a_one_line_error_naming_the_tensor():
    from kvserve.model.gguf_file import dequantize

    q8_1 = gguf.GGMLQuantizationType.Q8_1
    tensor = GGUFTensor("blk.0.attn_q.weight", (2, 32), int(q8_1),
                        torch.zeros(2 * gguf.GGML_QUANT_SIZES[q8_1][1], dtype=torch.uint8))  # two blocks
    for read in (dequantize, quantized_matrix):
        with pytest.raises(ValueError, match=r"^tensor blk\.0\.attn_q\.weight is stored as Q8_1, which kvserve "
                                             r"cannot read \(the gguf package has no dequantization for it\)$"):
            read(tensor)


def test_the_embedding_tables_source_is_offered_only_to_a_tied_head(tiny_model_factory, tmp_path):
    """The model reads its embedding table whole: the table's quantized source serves a tied LM
    head only, so a file with its own output matrix does not requantize the table (a Q3_K 8B's
    table is 525M values through float32); tensor-parallel ranks (with_head=False) keep either
    head dense and take neither."""
    from kvserve.model.loader import load_model, quantized_sources
    from tiny_models import write_gguf

    hf_dir = tiny_model_factory("llama", tie_word_embeddings=False)
    write_gguf(hf_dir, tmp_path / "untied.gguf", "llama", linears="Q4_0")  # the table Q8_0, the head Q4_0
    loaded = load_model(str(tmp_path / "untied.gguf"), tokenizer=str(hf_dir))
    assert not loaded.config.tie_word_embeddings
    sources = quantized_sources(loaded)
    assert "lm_head.weight" in sources and "embed_tokens.weight" not in sources
    assert "layers.0.self_attn.q_proj.weight" in sources
    ranks = quantized_sources(loaded, with_head=False)
    assert not {"lm_head.weight", "embed_tokens.weight"} & ranks.keys() and len(ranks) == len(sources) - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", ["int4", "int8", "Q4_1", "Q8_0"])
def test_quantized_linear_computes_with_its_quantized_weight(form, dtype):
    """The kernel (few rows) and the dense copy (many rows) both multiply by the quantized weight:
    within bfloat16 rounding of it (the kernel takes bf16 activations and scales; 8-bit weights go
    through it as two nibbles)."""
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    if form.startswith("Q"):
        matrix = quantized_matrix(_gguf_tensor(gguf.GGMLQuantizationType[form], weight.numpy())[0])
    else:
        matrix = quantize_int4(weight) if form == "int4" else quantize_int8(weight)
    reference_weight = matrix.dequantize()
    assert (reference_weight - weight).abs().max() <= matrix.scale.max() * 0.51  # round to nearest
    bias = torch.randn(96).to(dtype)
    layer = QuantizedLinear(matrix, bias, dtype, torch.device("cpu"), keep_dense=True)
    limit = layer.max_kernel_rows or 16  # (None: the kernel takes every row count, no dense copy)
    assert (layer.dense is None) == (layer.max_kernel_rows is None)
    for rows in (1, limit, limit + 3):
        x = torch.randn(rows, 128).to(dtype)
        expected = F.linear(x.float(), reference_weight, bias.float())
        got = layer(x)
        assert got.dtype == dtype and got.shape == (rows, 96)
        error = (got.float() - expected).abs().max().item()
        assert error <= 0.02 * expected.abs().max().item(), (rows, error)


@pytest.mark.parametrize("form", ["int4", "int8", "Q4_0", "Q4_1", "Q8_0"])
def test_a_layer_with_no_kernel_holds_the_bytes_plan_counts_and_multiplies_by_the_same_weight(form, monkeypatch):
    """Where no int kernel runs (CUDA), a quantized layer holds its codes compact: 4-bit two a byte
    with float16 scales and offsets, what `kvserve plan` counts (served_matrix_bytes), not a byte a
    code and float32 scales (twice that). It multiplies by the checkpoint's weight: exactly for a
    GGUF's (float16 scales), within float16's rounding of the scales for one quantized here."""
    monkeypatch.setattr(quant_linear, "load_lean_decode_module", lambda: (None, None))
    monkeypatch.setattr(quant_linear, "_torch_int4_kernel_takes", lambda matrix, device: False)
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    if form.startswith("Q"):
        matrix = quantized_matrix(_gguf_tensor(gguf.GGMLQuantizationType[form], weight.numpy())[0])
    else:
        matrix = quantize_int4(weight) if form == "int4" else quantize_int8(weight)
    layer = QuantizedLinear(matrix, None, torch.float32, torch.device("cpu"), keep_dense=True)
    assert not layer.kernel and layer.dense is None and isinstance(layer.matrix, CompactMatrix)
    held = quantized_bytes(layer)
    if matrix.group_size == 32:
        assert held == served_matrix_bytes(96 * 128, matrix.bits, torch.float32)
    else:  # int8 per channel: one scale a row
        assert held == 96 * 128 + 96 * 2
    if matrix.bits == 4:  # 0.625 bytes a weight (a byte a code and float32 scales were 1.25)
        assert held == 96 * 128 * 5 // 8
    reference = matrix.dequantize()
    served = layer.matrix.dequantize(torch.float32, chunk_values=3 * 128)  # in blocks of 3 rows
    if form.startswith("Q"):
        assert torch.equal(served, reference)
    else:
        # float16 scales: far inside a code step (a group's range / 15)
        assert (served - reference).abs().max() <= 2 ** -10 * reference.abs().max()
    assert torch.equal(layer.matrix.dequantize(torch.bfloat16), served.to(torch.bfloat16))
    x = torch.randn(5, 128)
    assert torch.allclose(layer(x), F.linear(x, served), rtol=1e-5, atol=1e-5)


def test_nibbles_pack_two_a_byte_and_unpack_to_the_same_codes():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_nibbles(codes)
    assert packed.shape == (7, 32) and torch.equal(packed[:, 0] & 15, codes[:, 0]) and torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(unpack_nibbles(packed), codes)


def test_a_flag_value_outside_the_choices_fails_with_one_line(tiny_llama):
    with pytest.raises(ValueError, match="--quantization must be one of auto, none, int8, int4"):
        LLM(str(tiny_llama), quantization="fp4")


@pytest.fixture(scope="module")
def tiny_engines(tiny_llama):
    """The tiny float32 llama under each mode (tiny engines: a fraction of a second each)."""
    return {mode: LLM(str(tiny_llama), dtype="float32", quantization=mode, kv_cache_memory="16MiB")
            for mode in ("auto", "none", "int8", "int4")}


def test_auto_keeps_a_full_precision_checkpoint_and_int_modes_quantize_every_linear(tiny_engines):
    def kinds(llm):  # the model's own linears (not the dense copies a QuantizedLinear keeps for big batches)
        return {type(m).__name__ for name, m in llm.engine.model.named_modules()
                if "Linear" in type(m).__name__ and not name.endswith(".dense")}

    assert "QuantizedLinear" not in kinds(tiny_engines["auto"]) | kinds(tiny_engines["none"])
    for mode in ("int8", "int4"):
        model = tiny_engines[mode].engine.model
        assert kinds(tiny_engines[mode]) == {"QuantizedLinear"}
        assert model.layers[0].mlp.gate_up_proj.bits == int(mode[3:])
        assert model.lm_head.bits == 8  # int4 keeps the LM head at 8 bits


def test_quantized_engines_score_close_to_full_precision(tiny_engines):
    ids = list(range(5, 69))
    reference = tiny_engines["none"].engine.score(ids, chunk_size=16).log_softmax(-1)
    for mode, limit in (("int8", 0.01), ("int4", 0.1)):
        logprobs = tiny_engines[mode].engine.score(ids, chunk_size=16).log_softmax(-1)
        kl = (reference.exp() * (reference - logprobs)).sum(-1).mean().item()
        assert 0 <= kl <= limit, (mode, kl)
        # decode steps (few rows: the int kernels) and prefill chunks (the dense copy) agree
        out = tiny_engines[mode].generate([{"prompt_token_ids": ids[:8]}], SamplingParams(max_tokens=6, temperature=0),
                                          use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 6


def test_4_bit_float32_layers_on_the_avx2_kernel_keep_no_dense_copy_and_take_every_batch():
    """On an AVX2 build (and AVX-512 with VNNI) kvserve's 4-bit GEMM outruns the float32 dense one at
    every row count (BENCHMARKS.md), so such a layer holds only its codes; an 8-bit LM head keeps
    its dense copy."""
    from kvserve.model.kernel_build import current_isa
    from kvserve.model.lean_kernel import load_lean_decode_module
    from kvserve.model.quant_linear import own_4bit_kernel_beats_float32_gemm

    if not own_4bit_kernel_beats_float32_gemm() or load_lean_decode_module()[0] is None:
        pytest.skip(f"needs kvserve's kernel built for AVX2, or AVX-512 with VNNI (this build: {current_isa()})")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 64, bias=False), torch.nn.Linear(64, 40, bias=False))
    targets = {"0": quantize_int4(model[0].weight.detach()), "1": quantize_int8(model[1].weight.detach())}
    from kvserve.model.quant_linear import install_quantized

    report = install_quantized(model, targets, "int4", torch.float32, torch.device("cpu"))
    assert model[0].max_kernel_rows is None and model[0].dense is None
    assert model[1].max_kernel_rows == 16 and model[1].dense is not None
    assert report.dense_copy_bytes == 40 * 64 * 4  # the 8-bit layer's float32 copy only
    x = torch.randn(300, 96)
    expected = F.linear(x, targets["0"].dequantize())
    assert (model[0](x) - expected).abs().max() <= 0.02 * expected.abs().max()


def test_no_dense_copy_when_memory_is_short(monkeypatch):
    """Under the RAM rule every batch size runs through the kernel and nothing else is kept."""
    import kvserve.model.quant_linear as quant_linear

    monkeypatch.setattr(quant_linear, "available_ram_bytes", lambda: 0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    served = quantize_int8(model[0].weight.detach()).dequantize()
    report = quantize_linears(model, "int8", {}, torch.float32, torch.device("cpu"))
    assert report.dense_copy_bytes == 0 and model[0].dense is None and model[0].kernel
    x = torch.randn(model[0].max_kernel_rows + 5, 64)
    expected = F.linear(x, served)
    assert (model[0](x) - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.slow
def test_int8_weights_greedy_output_agrees_with_full_precision_on_the_readme_prompts():
    readme_prompts = ["The capital of France is", "What is the capital of France?"]
    params = SamplingParams(temperature=0, max_tokens=16)
    outputs = {}
    for mode in ("none", "int8"):
        llm = LLM(quantization=mode, kv_cache_memory="256MiB", max_model_len=512)
        outputs[mode] = [o.outputs[0].text for o in llm.generate(readme_prompts, params, use_tqdm=False)]
        outputs[mode].append(llm.chat([{"role": "user", "content": readme_prompts[1]}], params,
                                      use_tqdm=False)[0].outputs[0].text)
    assert outputs["int8"] == outputs["none"]
    assert "Paris" in outputs["int8"][-1]


def _plan(capsys, *args: str) -> dict:
    import json

    from kvserve.cli import main

    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_counts_weights_at_their_served_size_so_the_kv_budget_grows(capsys):
    common = ("--gpu-memory", "2GiB", "--max-model-len", "2048", "--dtype", "bfloat16")
    plans = {mode: _plan(capsys, *common, "--quantization", mode) for mode in ("none", "auto", "int8", "int4")}
    dense = plans["none"]["weights"]["bytes"]
    assert dense == 2 * plans["none"]["weights"]["num_params"]
    # the default GGUF is Q4_1 with a Q8_0 embedding, tied: auto = int4 here
    assert plans["auto"]["weights"]["bytes"] == plans["int4"]["weights"]["bytes"] < plans["int8"]["weights"]["bytes"] < dense
    assert plans["auto"]["weights"]["quantization"] == "auto"
    assert plans["auto"]["kv_budget"]["bytes"] - plans["none"]["kv_budget"]["bytes"] == \
        dense - plans["auto"]["weights"]["bytes"]
    preset = {mode: _plan(capsys, "llama-2-7b", "--gpu-memory", "32GiB", "--max-model-len", "2048", "--quantization",
                          mode)["weights"] for mode in ("auto", "int4")}
    assert preset["auto"]["quantization"] == "none" and preset["int4"]["bytes"] < preset["auto"]["bytes"] / 3
