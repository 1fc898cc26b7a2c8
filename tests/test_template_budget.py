"""A hostile chat template (it ships with the model files) is refused with a clear error within its
rendering budget (engine/template_budget.py), instead of hanging `kvserve chat` or a server's
tokenizer thread."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve import LLM

HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "huge output": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
    "one huge range": "{% for i in range(10 ** 9) %}{% endfor %}",
}


def with_template(tiny: Path, target: Path, template: str) -> Path:
    shutil.copytree(tiny, target)
    (target / "chat_template.jinja").write_text(template + "{{ messages[0]['content'] }}")
    return target


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_template_past_its_budget_is_a_value_error(tiny_llama, tmp_path, name):
    model = with_template(tiny_llama, tmp_path / "model", HOSTILE[name])
    with LLM(str(model), kv_cache_memory="8MiB") as llm:
        start = time.monotonic()
        with pytest.raises(ValueError, match="exceeded its rendering budget"):
            llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
        assert time.monotonic() - start < 60
        # a budget is per render: the engine goes on serving completions
        assert llm.generate(["Hello"], use_tqdm=False)[0].outputs[0].token_ids


def test_kvserve_chat_reports_it_in_one_line_with_exit_2(tiny_llama, tmp_path):
    model = with_template(tiny_llama, tmp_path / "model", HOSTILE["nested loops"])
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "chat", "hi", "--model", str(model)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "error" in line]
    assert "Traceback" not in result.stderr
    assert line.startswith("kvserve chat: error: the model's chat template exceeded its rendering budget"), line


def test_an_ordinary_template_renders_as_before(tiny_llama):
    with LLM(str(tiny_llama), kv_cache_memory="8MiB") as llm:
        out = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert out[0].prompt_token_ids
