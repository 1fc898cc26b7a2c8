"""The router's parts without processes: the bounded prefix index, the kv_aware choice against
load, the merged /metrics page, and the arguments `serve --data-parallel-size` gives replicas."""
from __future__ import annotations

from kvserve.entrypoints.data_parallel import replica_argv
from kvserve.router.backends import Backend
from kvserve.cache.kv_events import DISK, HOST, POOL
from kvserve.router.index import PendingHints, PrefixIndex, matched_blocks, matched_media
from kvserve.router.metrics_merge import merge_metrics
from kvserve.router.policy import BALANCE_SLACK, Router
from kvserve.router.prompt_hashes import block_hashes


def test_index_is_bounded_and_forgets_the_oldest():
    index = PrefixIndex(max_entries=3)
    for h in (b"a", b"b", b"c"):
        index.add("0", h)
    index.add("1", b"d")
    assert len(index) == 3 and not index.holds("0", b"a") and index.holds("1", b"d")
    index.remove("0", b"b")
    index.remove("0", b"zz")  # unknown: ignored
    assert index.hashes("0") == {b"c"}
    index.replace("0", [b"x", b"y"])
    assert index.hashes("0") == {b"x", b"y"} and index.hashes("1") == {b"d"}
    index.clear("0")
    assert len(index) == 1


def test_matched_blocks_counts_the_leading_run_only():
    index, hints = PrefixIndex(), PendingHints()
    index.add("0", b"h0")
    index.add("0", b"h2")  # h1 missing: h2 cannot be used
    hints.add("1", [b"h0", b"h1"])
    assert matched_blocks(index, hints, "0", [b"h0", b"h1", b"h2"]) == 1
    assert matched_blocks(index, hints, "1", [b"h0", b"h1", b"h2"]) == 2


def test_the_index_keeps_each_medium_apart_and_matches_as_the_replica_looks_up():
    index, hints = PrefixIndex(), PendingHints()
    index.add("0", b"h0")
    index.add("0", b"h0", HOST)  # in the pool and still on the host tier
    index.add("0", b"h1", DISK)
    index.add("0", b"h2")  # in the pool, but after a tier block: the replica does not look there
    assert matched_media(index, hints, "0", [b"h0", b"h1", b"h2"]) == [POOL, DISK]
    index.add("0", b"h2", HOST)
    assert matched_media(index, hints, "0", [b"h0", b"h1", b"h2"]) == [POOL, DISK, HOST]
    index.remove("0", b"h0")  # a pool removal leaves the host copy
    assert matched_media(index, hints, "0", [b"h0"]) == [HOST]
    index.clear("0", HOST)
    assert index.hashes("0", DISK) == {b"h1"} and index.hashes("0") == {b"h2"} and not index.hashes("0", HOST)
    index.clear("0")
    assert len(index) == 0


def test_kv_aware_prefers_a_pool_hit_over_host_over_disk_over_nothing():
    backends = [Backend(str(i), f"http://replica-{i}") for i in range(4)]
    for b in backends:
        b.up, b.namespace, b.block_size = True, "float32", 4
    index = PrefixIndex()
    router = Router("kv_aware", index, PendingHints(), load_cost_tokens=4)
    tokens = list(range(33))  # 8 full blocks
    hashes = block_hashes(tokens, "float32", 4, None)
    for name, medium in (("1", DISK), ("2", HOST), ("3", POOL)):
        for h in hashes:
            index.add(name, h, medium)
    order = []
    for _ in range(3):
        choice = router.choose(backends, tokens, None)
        assert choice.cached_tokens == 32
        order.append(choice.backend.name)
        index.clear(choice.backend.name)
    assert order == ["3", "2", "1"]
    assert router.choose(backends, tokens, None).cached_tokens == 0
    for h in hashes:  # a disk holder keeps the prefix against a little more load than the others
        index.add("1", h, DISK)
    backends[1].in_flight = 1
    assert router.choose(backends, tokens, None).backend.name == "1"


def _backends() -> list[Backend]:
    backends = [Backend(str(i), f"http://replica-{i}") for i in range(2)]
    for b in backends:
        b.up, b.namespace, b.block_size = True, "float32", 4
    return backends


def test_kv_aware_prefers_the_holder_until_it_is_too_busy():
    index = PrefixIndex()
    router = Router("kv_aware", index, PendingHints(), load_cost_tokens=4)
    backends = _backends()
    tokens = list(range(13))  # 3 full blocks; the last token follows the third
    for h in block_hashes(tokens, "float32", 4, None):
        index.add("1", h)
    assert router.choose(backends, tokens, None).backend.name == "1"
    assert router.choose(backends, tokens, None).cached_tokens == 12
    assert router.choose(backends, tokens, "other-tenant").cached_tokens == 0  # the salt changes every hash
    backends[1].in_flight = 4  # 12 cached tokens are worth 3 queued requests at 4 tokens each
    assert router.choose(backends, tokens, None).backend.name == "0"


def test_round_robin_and_least_loaded():
    backends = _backends()
    rr = Router("round_robin", PrefixIndex(), PendingHints())
    assert [rr.choose(backends, None, None).backend.name for _ in range(4)] == ["0", "1", "0", "1"]
    backends[0].in_flight = 2
    ll = Router("least_loaded", PrefixIndex(), PendingHints())
    assert {ll.choose(backends, [1, 2], None).backend.name for _ in range(4)} == {"1"}
    assert ll.choose([], [1], None) is None


def test_a_request_still_prefilling_weighs_more_than_one_decoding():
    """Replacements for a batch that just finished on one replica must not all pile their prefills
    onto it: a request without its first answer bytes counts twice."""
    backends = _backends()
    ll = Router("least_loaded", PrefixIndex(), PendingHints())
    decoding = [backends[0].open() for _ in range(2)]
    for ticket in decoding:
        ticket.answer()
    backends[1].open().answer()
    fresh = backends[1].open()  # 1 decoding + 1 prefilling on "1" against 2 decoding on "0"
    assert {ll.choose(backends, [1], None).backend.name for _ in range(4)} == {"0"}
    fresh.answer()
    assert {ll.choose(backends, [1], None).backend.name for _ in range(4)} == {"0", "1"}  # a tie: in turn
    fresh.close()
    fresh.close()  # a second close (stream end after an error) counts nothing
    assert (backends[1].in_flight, backends[1].prefilling) == (1, 0)


def test_kv_aware_takes_turns_on_ties_whatever_the_reported_kv_usage():
    """With nothing cached and equal load, kv_aware spreads requests like least_loaded: a stale,
    lower KV usage report (the replica whose batch just finished) must not draw every new prompt."""
    backends = _backends()
    backends[0].kv_usage, backends[1].kv_usage = 0.1, 0.5
    router = Router("kv_aware", PrefixIndex(), PendingHints())
    assert [router.choose(backends, [7, 8, 9], None).backend.name for _ in range(4)] == ["0", "1", "0", "1"]


def test_kv_aware_takes_turns_when_the_cache_prefers_no_replica_unless_one_is_much_busier():
    """Nothing cached (or the same prefix everywhere): kv_aware places in turn like round_robin, so the
    replacements of a cohort that finished together on one replica are split, not all sent back
    there by load; a replica whose load exceeds the other's by more than BALANCE_SLACK is skipped."""
    backends = _backends()
    index = PrefixIndex()
    router = Router("kv_aware", index, PendingHints())
    backends[0].in_flight = int(BALANCE_SLACK)  # busier, within the slack
    assert [router.choose(backends, [7, 8, 9], None).backend.name for _ in range(4)] == ["0", "1", "0", "1"]
    least = Router("least_loaded", index, PendingHints())
    assert {least.choose(backends, [7, 8, 9], None).backend.name for _ in range(4)} == {"1"}
    tokens = list(range(9))
    for name in ("0", "1"):  # the same two blocks on both: still no reason to prefer one
        for h in block_hashes(tokens, "float32", 4, None):
            index.add(name, h)
    assert [router.choose(backends, tokens, None).backend.name for _ in range(2)] == ["0", "1"]
    backends[0].in_flight = int(BALANCE_SLACK) + 1  # past the slack: the idle one, every time
    assert {router.choose(backends, [7, 8, 9], None).backend.name for _ in range(4)} == {"1"}


def test_kv_aware_without_the_prompts_tokens_takes_turns_like_with_nothing_cached():
    """No tokens to look up (the router's tokenizer still loading, a body it cannot read): the cache
    can prefer no replica, so kv_aware places in turn within BALANCE_SLACK, not by load alone."""
    backends = _backends()
    router = Router("kv_aware", PrefixIndex(), PendingHints())
    backends[0].in_flight = int(BALANCE_SLACK)  # busier, within the slack
    assert [router.choose(backends, None, None).backend.name for _ in range(4)] == ["0", "1", "0", "1"]
    backends[0].in_flight = int(BALANCE_SLACK) + 1
    assert {router.choose(backends, None, None).backend.name for _ in range(4)} == {"1"}


def test_merged_metrics_label_each_replica_and_keep_families_together():
    page = ('# HELP kvserve:x doc\n# TYPE kvserve:x counter\nkvserve:x_total{model_name="m"} 1.0\n'
            '# HELP kvserve:y doc\n# TYPE kvserve:y gauge\nkvserve:y 2.0\n')
    merged = merge_metrics({"0": page, "1": page.replace("1.0", "3.0")}).splitlines()
    assert merged == ['# HELP kvserve:x doc', '# TYPE kvserve:x counter',
                      'kvserve:x_total{replica="0",model_name="m"} 1.0',
                      'kvserve:x_total{replica="1",model_name="m"} 3.0',
                      '# HELP kvserve:y doc', '# TYPE kvserve:y gauge',
                      'kvserve:y{replica="0"} 2.0', 'kvserve:y{replica="1"} 2.0']


def test_replicas_do_not_get_the_front_ends_options():
    argv = ["model", "--dtype", "float32", "--data-parallel-size", "2", "--port=9000", "--host", "0.0.0.0",
            "--api-key", "k", "--routing-policy", "round_robin", "--ssl-certfile", "c.pem", "--ssl-keyfile=k.pem",
            "--max-num-seqs", "8"]
    assert replica_argv(argv) == ["model", "--dtype", "float32", "--max-num-seqs", "8"]


def test_bad_flags_are_one_line_errors(capsys):
    from kvserve.cli import main

    cases = [(["serve", "--routing-policy", "round_robin"], "--routing-policy needs --data-parallel-size > 1"),
             (["serve", "--data-parallel-size", "0"], "--data-parallel-size must be at least 1"),
             (["serve", "--stream-interval", "0"], "--stream-interval must be at least 1"),
             (["serve", "--data-parallel-size", "2", "--nnodes", "2"], "does not take --nnodes"),
             (["router", "--backend", "ftp://host:1"], "is not an http(s) URL"),
             (["router", "--backend", "http://a:1", "--backend", "http://a:1/"], "a --backend is given twice"),
             (["serve", "--allowed-origins", "https://a.example"], "--allowed-origins must be a JSON list"),
             (["serve", "--override-generation-config", '{"temp": 1}'], "'temp' would do nothing"),
             (["router", "--backend", "http://a:1", "--allowed-headers", '["x", 1]'],
              "--allowed-headers must be a JSON list of strings"),
             (["router", "--backend", "http://a:1", "--tokenizer", "/nonexistent/tok"], "no such file or directory"),
             (["router", "--backend", "http://a:1", "--routing-policy", "round_robin", "--tokenizer", "."],
              "only serve(s) --routing-policy kv_aware")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_kv_aware_renders_chat_as_the_replica_does_with_the_requests_template_options(tiny_tokenizer):
    """The router's prompt for a chat request is the replica's: chat_template_kwargs (which a
    template may read, e.g. a reasoning switch in its system header) and continue_final_message
    change the text, so its block hashes, and so which replica holds the prefix."""
    from kvserve.router.prompt_hashes import PromptTokens

    template = ("{% if thinking %}THINK {% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                "{% if not loop.last or not continue_final_message %}</{{ m['role'] }}>{% endif %}{% endfor %}")
    prompts = PromptTokens(tiny_tokenizer, chat_template=template)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Sure"}]

    def routed(**options) -> str:
        ids = prompts.token_ids("chat", {"model": "m", "messages": messages, **options})
        return tiny_tokenizer.decode(ids)
    assert routed() == "<user>hello</user><assistant>Sure</assistant>"
    assert routed(chat_template_kwargs={"thinking": True}).startswith("THINK <user>")
    assert routed(continue_final_message=True, add_generation_prompt=False).endswith("<assistant>Sure")
