"""The KV eviction plug-in interface without a model: a policy module is found by the registry
(in a package of its own, too) and shows up in every place that lists policies; what each
policy observes per step; SnapKV and TOVA keep what their definitions say on hand-built
attention, where H2O's accumulated sum keeps something else; their state follows compaction."""
from __future__ import annotations

import argparse
import sys
import textwrap

import pytest
import torch

from kvserve.cache.eviction import POLICIES, POLICY_CHOICES, EvictionConfig, EvictionSpec
from kvserve.cache.eviction.config import resolve_eviction
from kvserve.cache.eviction.evictor import Evictor
from kvserve.cache.eviction.policies import discover
from kvserve.cache.eviction.policies.h2o import H2OPolicy
from kvserve.cache.eviction.policies.snapkv import WINDOW, SnapKVPolicy
from kvserve.cache.eviction.policies.tova import TOVAPolicy
from kvserve.engine.args import EngineArgs
from kvserve.eval.long_context import CONFIGS, LongContextConfig


# ---------------------------------------------------------------------------- registry
def test_a_policy_module_in_a_package_is_registered_by_its_name(tmp_path, monkeypatch):
    package = tmp_path / "more_policies"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "oldest.py").write_text(textwrap.dedent('''
        import torch
        from kvserve.cache.eviction.policy import EvictionPolicy

        class Helper:  # not a policy
            pass

        class OldestFirst(EvictionPolicy):
            name = "oldest"

            def score(self, cache_len):
                return -torch.arange(cache_len, dtype=torch.float32)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    found = discover("more_policies")
    assert list(found) == ["oldest"]
    policy = found["oldest"](16)
    assert policy.select(policy.score(10), 5, sink=1, recent=1) == [0, 1, 2, 3, 9]
    config = resolve_eviction(EvictionSpec("oldest", 64), EvictionSpec(), 128, found)
    assert config == EvictionConfig("oldest", 64, 4, 30)  # the base class's default recent share
    sys.modules.pop("more_policies.oldest", None)
    sys.modules.pop("more_policies", None)


def test_every_registered_policy_is_offered_everywhere():
    assert {"streaming", "h2o", "snapkv", "tova"} <= set(POLICIES)
    assert POLICY_CHOICES == ("none", *POLICIES)
    assert CONFIGS == ("dense", "window", *POLICIES) and LongContextConfig().configs == CONFIGS
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    for name in POLICIES:
        assert parser.parse_args(["--kv-eviction", name]).kv_eviction == name
        assert LongContextConfig(configs=(name,)).eviction(name)["policy"] == name


def test_default_recent_windows():
    def recent(name: str) -> int:
        return resolve_eviction(EvictionSpec(name, 1024), EvictionSpec(), 2048, POLICIES).recent_tokens

    assert [recent(n) for n in ("streaming", "h2o", "snapkv", "tova")] == [1020, 510, WINDOW, 0]


def test_what_each_policy_observes():
    ev = Evictor(4, 1000)

    def rows(name: str, num_queries: int):
        return ev.observed_rows(EvictionConfig(name, 64, 4, 0 if name != "streaming" else 60), num_queries)

    assert rows("streaming", 10) is None
    assert rows("h2o", 10) == (0, 1, True)  # every query, summed
    assert rows("tova", 10) == (9, 1, False)  # the last query
    assert rows("snapkv", 100) == (100 - WINDOW, WINDOW, False) and rows("snapkv", 5) == (0, 5, False)


# ---------------------------------------------------------------------------- hand-built attention
def attention_to(token: int, length: int, rows: int = 1, weight: float = 1.0) -> torch.Tensor:
    """[rows, length]: each row puts `weight` on `token` and spreads the rest evenly."""
    out = torch.full((rows, length), (1.0 - weight) / (length - 1))
    out[:, token] = weight
    return out


def test_tova_keeps_what_the_last_query_attends_to_h2o_what_was_attended_all_along():
    length = 12
    h2o, tova = H2OPolicy(16), TOVAPolicy(16)
    for policy in (h2o, tova):
        for _ in range(5):  # five earlier steps look at token 3
            policy.observe(attention_to(3, length))
        policy.observe(attention_to(7, length))  # the current query looks only at token 7
    # keep 4 of 12: sink 0, recent 11, and the best two of 1..10
    assert 3 in h2o.select(h2o.score(length), 4, sink=1, recent=1)
    kept = tova.select(tova.score(length), 4, sink=1, recent=1)
    assert 7 in kept and 3 not in kept


def test_snapkv_votes_with_the_last_window_of_queries_pooled_over_neighbours():
    length = 200
    snap, h2o = SnapKVPolicy(256), H2OPolicy(256)
    old = attention_to(40, length, rows=3 * WINDOW)  # a long past looking at token 40
    recent = attention_to(120, length, rows=WINDOW, weight=0.5)  # the window looks at token 120
    snap.observe(old)
    snap.observe(recent)
    h2o.observe(old.sum(0, keepdim=True))
    h2o.observe(recent.sum(0, keepdim=True))
    assert snap.rows.shape[0] == WINDOW  # older rows are forgotten
    # Keep 8 + sink + recent: SnapKV takes 120 and its neighbours (kernel 7: 117..123), not 40.
    kept = snap.select(snap.score(length), 10, sink=1, recent=1)
    assert set(range(117, 124)) <= set(kept) and 40 not in kept
    assert 40 in h2o.select(h2o.score(length), 10, sink=1, recent=1)


def test_snapkv_window_spans_steps_of_any_size():
    snap = SnapKVPolicy(64)
    snap.observe(attention_to(5, 20, rows=WINDOW - 1))  # a chunk's last rows
    snap.observe(attention_to(9, 21))  # a decode step
    assert snap.rows.shape[0] == WINDOW
    snap.observe(attention_to(9, 22))  # the first chunk row leaves the window
    assert snap.rows.shape[0] == WINDOW and snap.rows[:, 5].gt(0.5).sum() == WINDOW - 2


@pytest.mark.parametrize("policy_class", [TOVAPolicy, SnapKVPolicy, H2OPolicy])
def test_scores_follow_their_tokens_when_the_cache_is_compacted(policy_class):
    policy = policy_class(16)
    policy.observe(torch.arange(1.0, 11.0)[None] / 55)
    before = policy.score(10).clone()
    kept = [0, 2, 3, 9]
    policy.compacted(torch.tensor(kept))
    if policy_class is SnapKVPolicy:  # pooled scores mix neighbours: compare the votes themselves
        torch.testing.assert_close(policy.rows[0, :4], torch.tensor([1.0, 3.0, 4.0, 10.0]) / 55)
        assert policy.rows[0, 4:].eq(0).all()
    else:
        torch.testing.assert_close(policy.score(4), before[kept])
        assert policy.score(16)[4:].eq(0).all()
