"""GGUF loading (kvserve/model/gguf_file.py, loader.py): kvserve's own reader and torch
dequantization give exactly what the `gguf` package gives, and the tokenizer transformers builds
from a GGUF's metadata is cached on disk, reused only for the same file and library versions, and
rebuilt when its entry is damaged."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers

from kvserve.model.gguf_file import GGUFTensor, dequantize, read_gguf
from kvserve.model.loader import load_model, resolve_model_path

from tiny_models import BOOK, write_gguf

NATIVE_TYPES = [gguf.GGMLQuantizationType[name] for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")]


def _random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, row_values: int) -> np.ndarray:
    """[rows, bytes per row] in the layout of `qtype`: random codes, finite float16 scales of all
    magnitudes (subnormal ones included); float types hold random normals."""
    rng = np.random.default_rng(int(qtype))
    floats = rng.standard_normal(rows * row_values).astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F32:
        return floats.view(np.uint8).reshape(rows, -1)
    if qtype == gguf.GGMLQuantizationType.F16:
        return floats.astype(np.float16).view(np.uint8).reshape(rows, -1)
    if qtype == gguf.GGMLQuantizationType.BF16:  # the high half of each float32
        return (floats.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    values_per_block, bytes_per_block = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * row_values // values_per_block, bytes_per_block), dtype=np.uint8)
    scales = rng.choice([1e-7, 3e-5, 0.01, -0.02, 1.5, 60000.0], size=(blocks.shape[0], 2)).astype(np.float16)
    scale_bytes = 4 if qtype == gguf.GGMLQuantizationType.Q4_1 else 2  # Q4_1: scale and minimum
    blocks[:, :scale_bytes] = scales[:, : scale_bytes // 2].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", NATIVE_TYPES, ids=lambda t: t.name)
def test_torch_dequantization_equals_gguf_bit_for_bit(qtype):
    rows, row_values = 7, 96
    raw = _random_blocks(qtype, rows, row_values)
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    got = dequantize(GGUFTensor("t", (rows, row_values), int(qtype), torch.from_numpy(raw.reshape(-1).copy())))
    assert got.dtype == torch.float32 and got.shape == (rows, row_values)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(expected.view(np.int32))), qtype.name


@pytest.mark.slow
def test_default_gguf_reads_like_the_gguf_package():
    """Metadata, tensor table and every dequantized tensor of the default model, bit for bit."""
    path = resolve_model_path(None)
    ours, reference = read_gguf(path), gguf.GGUFReader(path)
    metadata = {key: field for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert set(ours.fields) == set(metadata)  # the gguf package adds the header's counts as "GGUF.*"
    for key, field in metadata.items():
        assert ours.field(key) == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    tensors = {tensor.name: dequantize(tensor) for tensor in ours.tensors}
    for tensor in reference.tensors:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        got = tensors[tensor.name]
        assert got.shape == expected.shape, tensor.name
        assert torch.equal(got.view(torch.int32), torch.from_numpy(np.ascontiguousarray(expected).view(np.int32))), tensor.name


# ---------------------------------------------------------------------------- the tokenizer cache
@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tokenizer_builds(monkeypatch) -> list[str]:
    """The GGUF files transformers is asked to build a tokenizer from."""
    builds: list[str] = []
    original = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        if kwargs.get("gguf_file"):
            builds.append(kwargs["gguf_file"])
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    return builds


def _assert_same_tokenizer(got, expected) -> None:
    text = BOOK.read_text()[20_000:30_000] + " <|im_start|>user\nÜnïcödé 你好\t  x<|im_end|>"
    assert got(text).input_ids == expected(text).input_ids
    assert got.decode(got(text).input_ids) == expected.decode(expected(text).input_ids)
    assert len(got) == len(expected) and got.get_vocab() == expected.get_vocab()
    assert got.all_special_ids == expected.all_special_ids
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id) == (expected.bos_token_id, expected.eos_token_id,
                                                                      expected.pad_token_id)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert (got.apply_chat_template(chat, add_generation_prompt=True)
            == expected.apply_chat_template(chat, add_generation_prompt=True))


@pytest.mark.slow
def test_gguf_tokenizer_is_cached_and_reused_only_for_the_same_file(tmp_path, cache_dir, tokenizer_builds):
    model = shutil.copy(resolve_model_path(None), tmp_path / "model.gguf")
    first = load_model(model).tokenizer
    assert len(tokenizer_builds) == 1 and len(list((cache_dir / "tokenizer").iterdir())) == 1
    second = load_model(model).tokenizer
    assert len(tokenizer_builds) == 1  # loaded from the cache
    _assert_same_tokenizer(second, first)

    stat = os.stat(model)  # a changed file (here only its mtime) never reuses the entry
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    load_model(model)
    assert len(tokenizer_builds) == 2 and len(list((cache_dir / "tokenizer").iterdir())) == 2


@pytest.mark.slow
def test_damaged_tokenizer_entry_is_rebuilt_with_a_warning(tmp_path, cache_dir, tokenizer_builds, caplog):
    model = shutil.copy(resolve_model_path(None), tmp_path / "model.gguf")
    built = load_model(model).tokenizer
    [entry] = (cache_dir / "tokenizer").iterdir()
    (entry / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    with caplog.at_level(logging.WARNING):
        rebuilt = load_model(model).tokenizer
    assert len(tokenizer_builds) == 2 and "ignoring the unreadable tokenizer entry" in caplog.text
    _assert_same_tokenizer(rebuilt, built)
    caplog.clear()
    _assert_same_tokenizer(load_model(model).tokenizer, built)  # the rewritten entry is good again
    assert len(tokenizer_builds) == 2 and not caplog.text


def test_starting_the_default_model_imports_neither_dynamo_nor_triton():
    """Building the model on the meta device leaves the embedding uninitialised: nn.Embedding's
    random init there runs through torch's reference ops, whose import pulls in torch._dynamo and
    Triton (~1 s of every start; and Triton's nanobind lines at every exit)."""
    script = ("import sys\nfrom kvserve import LLM\nLLM(kv_cache_memory='64MiB')\n"
              "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout


def test_qwen3_gguf_serves_like_its_checkpoint(tmp_path, tiny_model_factory):
    """A Qwen3 GGUF (llama.cpp's names: attn_q_norm/attn_k_norm; head size 32 from the key length,
    not hidden / heads = 16) gives the HF checkpoint's greedy tokens."""
    from kvserve import LLM, SamplingParams

    hf_dir = tiny_model_factory("qwen3")
    path = tmp_path / "qwen3.gguf"
    write_gguf(hf_dir, path, "qwen3")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 19)]
    from_gguf = LLM(str(path), tokenizer=str(hf_dir), dtype="float32", kv_cache_memory="8MiB")
    assert from_gguf.engine.model.config.head_dim == 32 and from_gguf.engine.model.config.qk_norm
    from_hf = LLM(str(hf_dir), dtype="float32", kv_cache_memory="8MiB")
    got = [o.outputs[0].token_ids for o in from_gguf.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in from_hf.generate(prompts, params, use_tqdm=False)]


def test_layers_served_from_their_blocks_are_never_dequantized(tmp_path, tiny_model_factory, monkeypatch):
    """A Q4_0 GGUF served as stored (`--quantization auto`) dequantizes only what the model reads
    dense (embedding, norms): its linears go from the file's blocks to the kernel without a float32
    copy; `--quantization none` reads every tensor."""
    from kvserve import LLM, SamplingParams
    from kvserve.model import loader

    hf_dir = tiny_model_factory("qwen3")
    path = tmp_path / "qwen3-q4_0.gguf"
    write_gguf(hf_dir, path, "qwen3", linears="Q4_0")
    read = []
    dequantize_one = loader.dequantize
    monkeypatch.setattr(loader, "dequantize", lambda tensor: read.append(tensor.name) or dequantize_one(tensor))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    served = LLM(str(path), tokenizer=str(hf_dir), dtype="float32", kv_cache_memory="8MiB", quantization="auto")
    assert served.generate([{"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert read and not [name for name in read if name.startswith("blk.") and not name.endswith("norm.weight")]
    assert "token_embd.weight" in read and "output.weight" not in read  # the head is served from its blocks
    read.clear()
    LLM(str(path), tokenizer=str(hf_dir), dtype="float32", kv_cache_memory="8MiB", quantization="none")
    assert {"blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output.weight"} <= set(read)


def test_llama_3_gguf_takes_its_rope_scaling_from_rope_freqs(tmp_path, tiny_model_factory):
    """A Llama 3.1-style GGUF (llama.cpp writes the RoPE scaling as a rope_freqs tensor of divisors,
    and q/k rows permuted for its kernel) gives its checkpoint's greedy tokens (HF transformers)."""
    from kvserve import LLM, SamplingParams

    hf_dir = tiny_model_factory("llama", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})
    path = tmp_path / "llama3.gguf"
    write_gguf(hf_dir, path, "llama")
    llm = LLM(str(path), tokenizer=str(hf_dir), dtype="float32", kv_cache_memory="8MiB")
    assert llm.engine.model_config.rope_freq_factors is not None
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt = list(range(3, 60))
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids == expected
