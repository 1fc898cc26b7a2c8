"""`kvserve eval --long-context` on a tiny random checkpoint: the protocol's shape (dense stops at
max-model-len, the evicting configurations continue past it), its per-token scoring, passkey
rows per budget, JSON / table / plot, and clean errors."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvserve.cli import main
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.eval.long_context import LongContextConfig, evaluate_long_context, next_token_nll, plot, render_tables
from tiny_models import BOOK

OPTIONS = dict(dtype="float32", block_size=8, kv_cache_memory="16MiB", max_model_len=256)


def test_next_token_nll_matches_full_logits(tiny_llama, tiny_tokenizer):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), **OPTIONS))
    tokens = tiny_tokenizer.encode(BOOK.read_text()[:3000])[:100]
    nll = next_token_nll(engine, tokens, 7, None)
    logits = engine.score(tokens).double().log_softmax(-1)
    expected = -logits[np.arange(99), tokens[1:]].numpy()
    np.testing.assert_allclose(nll, expected, rtol=1e-5, atol=1e-5)


def test_protocol_report(tiny_llama, tmp_path):
    config = LongContextConfig(num_tokens=600, budget=64, chunk_size=8, segment=100, passkey_length=96,
                               passkey_depths=(0.1, 0.9), passkey_trials=1)
    report = evaluate_long_context(str(tiny_llama), BOOK, config, **OPTIONS)
    curves = {c.config: c for c in report.curves}
    evicting = ["window", "streaming", "h2o", "snapkv", "tova"]  # by default every registered policy
    assert list(curves) == ["dense", *evicting]
    assert curves["dense"].num_tokens == 255 and curves["dense"].perplexity_beyond is None
    for name in evicting:
        assert curves[name].num_tokens == 599 and math.isfinite(curves[name].perplexity_beyond)
        assert len(curves[name].segment_perplexity) == 6
    assert [(r.config, r.budget) for r in report.passkey] == [
        ("dense", None), *((name, budget) for name in evicting for budget in (24, 48))]
    assert all(r.total == 2 and set(r.by_depth) == {0.1, 0.9} for r in report.passkey)
    assert len(render_tables(report)) == 2
    assert plot(report, tmp_path / "long.png").stat().st_size > 0


def test_cli_json(tiny_llama, capsys, tmp_path):
    """--json output; --long-passkey-length 0 (no passkey) agrees with --no-passkey, so it is no error."""
    code = main(["eval", "--long-context", "--model", str(tiny_llama), "--dtype", "float32", "--block-size", "8",
                 "--max-model-len", "128", "--kv-budget", "32", "--long-tokens", "300", "--long-chunk-size", "4",
                 "--long-configs", "streaming,h2o", "--no-passkey", "--long-passkey-length", "0", "--json",
                 "--output-json", str(tmp_path / "long.json")])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert [c["config"] for c in data["curves"]] == ["streaming", "h2o"] and data["passkey"] == []
    assert data["config"]["budget"] == 32 and data["max_model_len"] == 128
    assert json.loads((tmp_path / "long.json").read_text()) == data


@pytest.mark.parametrize("argv, fragment", [
    (["--long-configs", "dense,lru"], "unknown long-context configuration lru"),
    (["--long-chunk-size", "40", "--kv-budget", "32"], "chunk size (40) must be at most"),
    (["--long-tokens", "10000000"], "the text has"),
    # the KV dtype comparison's options and a policy of its own: refused, not ignored
    (["--kv-eviction", "h2o", "--num-tokens", "50"], "--num-tokens, --kv-eviction: not read by --long-context"),
    (["--max-num-batched-tokens", "64"], "--max-num-batched-tokens: not read by --long-context"),
])
def test_cli_errors_are_one_line(tiny_llama, capsys, argv, fragment):
    code = main(["eval", "--long-context", "--model", str(tiny_llama), "--dtype", "float32", "--no-passkey",
                 "--max-model-len", "128", *argv])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert fragment in err[-1] and "Traceback" not in "".join(err)
