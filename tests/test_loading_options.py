"""vLLM's loading flags. `--tokenizer` and `--trust-remote-code`: a model's tokenizer loaded from
elsewhere (a checkpoint without one, a GGUF's base model), checked against the vocabulary; a
tokenizer that is code runs only when trusted, and is refused with a hint otherwise, never asked
about on stdin. `--load-format`: dummy weights from a config alone; a format the path is not."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import kvserve.engine.loading as loading_module
from kvserve import LLM, SamplingParams
from kvserve.model.loader import ModelLoadError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def split_model(tiny_llama, tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny model without its tokenizer files, a directory with only them)."""
    root = tmp_path_factory.mktemp("split")
    weights, tokenizer = root / "weights", root / "tokenizer"
    shutil.copytree(tiny_llama, weights)
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        if (weights / name).exists():
            shutil.move(weights / name, tokenizer / name)
    return weights, tokenizer


def test_a_model_without_a_tokenizer_runs_with_one_from_elsewhere(tiny_llama, split_model):
    weights, tokenizer = split_model
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        LLM(str(weights), dtype="float32", kv_cache_memory="8MiB")
    llm = LLM(str(weights), tokenizer=str(tokenizer), dtype="float32", kv_cache_memory="8MiB")
    reference = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    prompts = ["Mr. Darcy", "It is a truth universally acknowledged"]
    assert [o.outputs[0].text for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].text for o in reference.generate(prompts, GREEDY, use_tqdm=False)]
    messages = [{"role": "user", "content": "Hello"}]
    assert llm.engine.apply_chat_template(messages, True) == reference.engine.apply_chat_template(messages, True)


def test_a_tokenizer_path_that_names_nothing_fails_before_the_weights_load(tiny_llama, monkeypatch, tmp_path):
    def load_model(*args, **kwargs):
        raise AssertionError("weights were loaded before the options were checked")

    monkeypatch.setattr(loading_module, "load_model", load_model)
    with pytest.raises(ModelLoadError, match="model not found"):
        LLM(str(tiny_llama), tokenizer=str(tmp_path / "nothing"))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    big = AutoTokenizer.from_pretrained(tiny_llama)
    big.add_tokens([f"extra{i}" for i in range(4096)])
    big.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="tokenizer mismatch"):
        LLM(str(tiny_llama), tokenizer=str(tmp_path), dtype="float32", kv_cache_memory="8MiB")


def test_a_tokenizer_that_is_code_runs_only_when_trusted(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(tiny_llama)
    source.save_pretrained(tmp_path)
    base = type(source).__name__
    (tmp_path / "tokenization_marked.py").write_text(
        f"from transformers import {base}\n\n\nclass MarkedTokenizer({base}):\n    pass\n")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": [None, "tokenization_marked.MarkedTokenizer"]},
                  tokenizer_class="MarkedTokenizer")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="pass --trust-remote-code"):
        LLM(str(tiny_llama), tokenizer=str(tmp_path), dtype="float32", kv_cache_memory="8MiB")
    llm = LLM(str(tiny_llama), tokenizer=str(tmp_path), trust_remote_code=True, dtype="float32",
              kv_cache_memory="8MiB")
    assert type(llm.engine.tokenizer).__name__ == "MarkedTokenizer"
    assert llm.generate(["Mr. Darcy"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_dummy_weights_from_a_config_alone(tiny_llama, tmp_path):
    config_only = tmp_path / "config-only"
    shutil.copytree(tiny_llama, config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        LLM(str(config_only), dtype="float32", kv_cache_memory="8MiB")
    runs = [LLM(str(config_only), load_format="dummy", dtype="float32", kv_cache_memory="8MiB") for _ in range(2)]
    tokens = [llm.generate(["Mr. Darcy"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for llm in runs]
    assert len(tokens[0]) == GREEDY.max_tokens and tokens[0] == tokens[1]  # the same config, the same weights
    real = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    # Random weights compute other K/V: their cached blocks are never shared with the checkpoint's.
    assert runs[0].engine.kv_manager.namespace != real.engine.kv_manager.namespace
    assert LLM(str(tiny_llama), load_format="dummy", dtype="float32",
               kv_cache_memory="8MiB").engine.kv_manager.namespace == runs[0].engine.kv_manager.namespace


def test_a_load_format_the_path_is_not_fails_before_the_weights_load(tiny_llama, monkeypatch):
    from kvserve.model.loader import default_model_path

    def load_model(*args, **kwargs):
        raise AssertionError("weights were loaded before the options were checked")

    monkeypatch.setattr(loading_module, "load_model", load_model)
    with pytest.raises(ModelLoadError, match="--load-format gguf takes a .gguf file"):
        LLM(str(tiny_llama), load_format="gguf")
    try:
        gguf = default_model_path()
    except ModelLoadError:
        return  # the default GGUF is not installed
    for load_format in ("dummy", "safetensors"):
        with pytest.raises(ModelLoadError, match=f"--load-format {load_format} takes a Hugging Face directory"):
            LLM(str(gguf), load_format=load_format)
