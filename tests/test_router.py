"""Data-parallel replicas and the KV-cache-aware router, with real processes: two `kvserve serve`
replicas (with host and disk offload tiers) behind a `kvserve router`, and one `kvserve serve
--data-parallel-size 2`, all on the tiny model with small pools (so blocks get evicted and move
down the tiers). The test that kills a replica runs last."""
from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvserve.cache.kv_cache_manager import prompt_block_hashes, root_hash
from router_process import RouterProcess
from server_process import ServerProcess
from tiny_models import BOOK

KEY = "router-test-key"
# 256 KiB of float32 KV is 32 blocks of 16 tokens: a dozen prompts evict.
REPLICA_ARGS = ["--dtype", "float32", "--kv-cache-memory", "256KiB", "--max-model-len", "256",
                "--served-model-name", "tiny"]
BLOCK_TOKENS, BLOCK_BYTES = 16, 16 * 512
HOST_TIER_GIB = 8 * BLOCK_BYTES / (1 << 30)  # the two separate replicas' host tier: 8 blocks, then disk
TEXT = BOOK.read_text()[5000:40000]
SHARED = TEXT[:400]  # about 100 tokens: several full blocks


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    """(replica A, replica B, router over both, serve --data-parallel-size 2), started together."""
    def start(args, env=None):
        return ServerProcess.start([str(tiny_llama), *args], tmp_path_factory.mktemp("replica"), env, wait=False)

    def tiers(name: str) -> list[str]:
        return ["--kv-offloading-size", str(HOST_TIER_GIB),
                "--kv-offloading-disk-path", str(tmp_path_factory.mktemp(f"kv-{name}"))]

    fault_env = {"KVSERVE_FAULT_INJECTION": "1"}
    a = start([*REPLICA_ARGS, *tiers("a"), "--api-key", KEY], fault_env)
    b = start([*REPLICA_ARGS, *tiers("b"), "--api-key", KEY], fault_env)
    dp = start([*REPLICA_ARGS, "--data-parallel-size", "2"])
    router = RouterProcess.start([a.base_url, b.base_url], tmp_path_factory.mktemp("router"), "--api-key", KEY)
    try:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda s: s.wait_healthy(), (a, b, dp)))
        router.wait_until(lambda s: s["tokenizer_loaded"] and all(x["up"] for x in s["backends"]),
                          what="both backends up with the tokenizer loaded")
        # The front end of --data-parallel-size serves once its replicas are up, its tokenizer loaded.
        state = httpx.get(f"{dp.base_url}/router/state", timeout=10).json()
        assert state["tokenizer_loaded"] and all(x["up"] for x in state["backends"]), state
        yield a, b, router, dp
    finally:
        router.stop()
        for server in (a, b, dp):
            server.stop()


def complete(base_url: str, prompt: str, max_tokens: int = 6, key: str | None = KEY, **extra) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{base_url}/v1/completions", headers=headers, timeout=60,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                **extra})
    assert response.status_code == 200, response.text
    return response.json()


def prefix_counters(server: ServerProcess, replica: str | None = None) -> tuple[float, float]:
    m = server.metrics()
    label = f'{{replica="{replica}"}}' if replica is not None else ""
    return m[f"kvserve:prefix_cache_queries_total{label}"], m[f"kvserve:prefix_cache_hits_total{label}"]


def test_router_and_data_parallel_answer_the_openai_client_as_one_engine_does(cluster):
    a, b, router, dp = cluster
    prompt = TEXT[1000:1200]
    expected = complete(a.base_url, prompt)["choices"][0]["text"]
    for base_url, key in ((router.base_url, KEY), (dp.base_url, "unused")):
        client = OpenAI(base_url=f"{base_url}/v1", api_key=key)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        assert client.models.retrieve("tiny").id == "tiny" and httpx.head(f"{base_url}/health").status_code == 200
        for _ in range(2):  # both replicas, whichever gets it
            plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
            assert plain.choices[0].text == expected
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True) if c.choices)
            assert streamed == expected
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=4, temperature=0)
        chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=4, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert httpx.post(f"{router.base_url}/v1/completions", json={"prompt": "x"}).status_code == 401


def test_the_front_ends_pass_priority_on_and_serve_embeddings_and_sagemakers_routes(cluster):
    """X-Vllm-Priority reaches the replicas (fcfs here, so a priority other than 0 is their 400);
    /v1/embeddings, /ping and /invocations answer through both front ends as a replica does."""
    a, b, router, dp = cluster
    auth = {"Authorization": f"Bearer {KEY}"}
    embedding = {"model": "tiny", "input": "Mr. Darcy"}
    expected = httpx.post(f"{a.base_url}/v1/embeddings", json=embedding, headers=auth, timeout=60).json()
    chat = {"model": "tiny", "messages": [{"role": "user", "content": TEXT[:200]}], "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"{a.base_url}/v1/chat/completions", json=chat, headers=auth, timeout=60).json()
    for base_url in (router.base_url, dp.base_url):
        response = httpx.post(f"{base_url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                              headers={**auth, "X-Vllm-Priority": "2"}, timeout=60)
        assert response.status_code == 400 and "Priority scheduling is not enabled" in response.text
        embedded = httpx.post(f"{base_url}/v1/embeddings", json=embedding, headers=auth, timeout=60).json()
        assert embedded["data"][0]["embedding"] == pytest.approx(expected["data"][0]["embedding"], abs=1e-5)
        assert httpx.get(f"{base_url}/ping").status_code == 200  # open, as /health
        invoked = httpx.post(f"{base_url}/invocations", json=chat, headers=auth, timeout=60)
        assert invoked.status_code == 200, invoked.text
        assert invoked.json()["choices"][0]["message"]["content"] == reply["choices"][0]["message"]["content"]


def test_a_responses_conversation_follows_the_replica_that_stored_it(cluster):
    """/v1/responses through both front ends: each turn continuing a stored response (whose
    conversation lives on one replica) reaches that replica, as do GET and cancel."""
    a, b, router, dp = cluster
    auth = {"Authorization": f"Bearer {KEY}"}
    for base_url in (router.base_url, dp.base_url):
        first = httpx.post(f"{base_url}/v1/responses", headers=auth, timeout=60,
                           json={"model": "tiny", "input": TEXT[:80], "max_output_tokens": 4})
        assert first.status_code == 200, first.text
        previous = first.json()["id"]
        for turn in range(4):  # placed in turn, an unpinned request would land on the other replica
            reply = httpx.post(f"{base_url}/v1/responses", headers=auth, timeout=60,
                               json={"model": "tiny", "input": f"And then {turn}?", "max_output_tokens": 2,
                                     "previous_response_id": previous})
            assert reply.status_code == 200, reply.text
            previous = reply.json()["id"]
            stored = httpx.get(f"{base_url}/v1/responses/{previous}", headers=auth, timeout=60)
            assert stored.status_code == 200 and stored.json()["id"] == previous
        cancel = httpx.post(f"{base_url}/v1/responses/{previous}/cancel", headers=auth, timeout=60)
        assert cancel.status_code == 400 and "already completed" in cancel.json()["error"]["message"]
        missing = httpx.get(f"{base_url}/v1/responses/resp_nothing", headers=auth, timeout=60)
        assert missing.status_code == 404 and "not found" in missing.json()["error"]["message"]


def test_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(cluster):
    a, b, router, dp = cluster
    for base_url, key, hits in ((router.base_url, KEY, lambda: [prefix_counters(a)[1], prefix_counters(b)[1]]),
                                (dp.base_url, None, lambda: [prefix_counters(dp, "0")[1], prefix_counters(dp, "1")[1]])):
        def routed() -> list[int]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            state = httpx.get(f"{base_url}/router/state", headers=headers, timeout=10).json()
            return [x["routed"] for x in state["backends"]]

        before_routed, before_hits = routed(), hits()
        salt = f"tenant-{base_url}"  # a prefix neither replica has seen
        for i in range(5):
            complete(base_url, SHARED + f" Question {i}?", max_tokens=2, cache_salt=salt, key=key)
        went = [now - then for now, then in zip(routed(), before_routed)]
        assert sorted(went) == [0, 5], f"requests sharing a prefix were split: {went}"
        holder = went.index(5)
        deadline = time.monotonic() + 10  # the counters follow the engine's step a moment later
        while hits()[holder] - before_hits[holder] < 4 * 5 * 16 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hits()[holder] - before_hits[holder] >= 4 * 5 * 16, "the holder did not reuse the prefix"
        assert hits()[1 - holder] == before_hits[1 - holder]


def test_anthropic_messages_sharing_a_system_prompt_land_on_one_replica(cluster):
    """/v1/messages is routed by its rendered prompt as chat is (an agent's turns share one long
    prefix); the key may come as x-api-key, as Anthropic's clients send it, and a stream comes back
    in Anthropic's events."""
    a, b, router, _ = cluster
    headers = {"x-api-key": KEY}

    def routed() -> list[int]:
        state = httpx.get(f"{router.base_url}/router/state", headers=headers, timeout=10).json()
        return [x["routed"] for x in state["backends"]]

    before = routed()
    for i in range(4):
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "system": SHARED, "cache_salt": "anthropic",
                "messages": [{"role": "user", "content": f"Question {i}?"}], "stream": i == 3}
        response = httpx.post(f"{router.base_url}/v1/messages", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        if i == 3:
            assert response.text.startswith("event: message_start") and "event: message_stop" in response.text
        else:
            assert response.json()["type"] == "message"
    went = [now - then for now, then in zip(routed(), before)]
    assert sorted(went) == [0, 4], f"requests sharing a prefix were split: {went}"
    refused = httpx.post(f"{router.base_url}/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


def test_reset_prefix_cache_reaches_every_replica(cluster):
    a, b, router, dp = cluster
    for base_url, key in ((router.base_url, KEY), (dp.base_url, None)):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        complete(base_url, SHARED + " Reset?", max_tokens=2, key=key)
        assert httpx.post(f"{base_url}/reset_prefix_cache", headers=headers, timeout=30).status_code == 200
    for replica in (a, b):
        pool = httpx.get(f"{replica.base_url}/v1/kv_events/snapshot", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=10).json()
        assert pool["block_hashes"] == [], "the replica's pool still holds cached prefixes"


def snapshot(server: ServerProcess) -> dict:
    return httpx.get(f"{server.base_url}/v1/kv_events/snapshot", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).json()


def settled_snapshot(server: ServerProcess) -> dict:
    """The replica's snapshot once its disk writes have landed: its disk tier's hashes are then the
    block files in its directory, and its host tier's count matches the host tier's usage."""
    args = server.process.args
    directory = Path(args[args.index("--kv-offloading-disk-path") + 1])
    deadline = time.monotonic() + 20
    while True:
        snap = snapshot(server)
        files = sorted(p.name[:64] for p in directory.rglob("*.kvb"))
        host = httpx.get(f"{server.base_url}/dashboard/state", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=10).json()["kv_offload_tiers"]["host_used_bytes"]
        if (snap["tier_block_hashes"]["disk"] == files and len(snap["tier_block_hashes"]["host"]) * BLOCK_BYTES == host
                and snap == snapshot(server)):
            return snap
        assert time.monotonic() < deadline, f"the snapshot's tiers never matched the tiers: {snap}, {files}, {host}"
        time.sleep(0.2)


def test_the_routers_index_equals_the_replicas_cached_blocks_in_every_tier(cluster):
    a, b, router, dp = cluster
    with ThreadPoolExecutor(4) as pool:  # a dozen distinct prompts into 32-block pools: evictions
        list(pool.map(lambda i: complete(router.base_url, TEXT[2000 + 450 * i:2000 + 450 * i + 400], 4), range(12)))
    snapshots = {"0": settled_snapshot(a), "1": settled_snapshot(b)}
    assert any(s["seq"] > len(s["block_hashes"]) for s in snapshots.values()), "no block was removed"
    assert any(s["tier_block_hashes"]["host"] for s in snapshots.values()), "nothing went down to a host tier"
    router.wait_until(lambda s: all(x["seq"] == snapshots[x["name"]]["seq"] for x in s["backends"]),
                      timeout=10, what="the router caught up with the replicas' events")
    state = router.state(hashes=True)
    for backend in state["backends"]:
        snap = snapshots[backend["name"]]
        assert backend["instance_id"] == snap["replica"]["instance_id"]
        assert snap["replica"]["tiers"] == ["host", "disk"]
        assert backend["block_hashes"] == snap["block_hashes"]
        assert backend["tier_block_hashes"] == snap["tier_block_hashes"]
        assert backend["in_flight"] == backend["prefilling"] == 0  # every finished request counted out


def events_until(server: ServerProcess, seq: int) -> list[dict]:
    """The replica's event stream from its start, up to event `seq`."""
    events = []
    with httpx.stream("GET", f"{server.base_url}/v1/kv_events", params={"since": 0}, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                message = json.loads(line[5:])
                assert message["type"] != "Snapshot", "the ring should still hold every event"
                events += message.get("events", [])
                if events and events[-1]["seq"] >= seq:
                    return events


def test_a_prefix_only_on_one_replicas_disk_is_routed_there(cluster):
    """Three prefixes are pushed down replica A's pool and host tier onto its disk: the event
    stream shows each move, and the router, seeing them on A's disk and nowhere else, sends every
    one of them to A (taking turns, it would send some to B), which reads them back from disk."""
    a, b, router, dp = cluster
    salt = "disk-only"
    prompts = [TEXT[25000 + 500 * i:25000 + 500 * i + 360] for i in range(3)]
    for prompt in prompts:
        complete(a.base_url, prompt, max_tokens=1, cache_salt=salt)
    for i in range(6):  # 6 x 12 blocks through A's 32-block pool and 8-block host tier
        complete(a.base_url, TEXT[27000 + 450 * i:27000 + 450 * i + 400], max_tokens=1)
    snap = settled_snapshot(a)
    namespace, block_size = snap["replica"]["namespace"], snap["replica"]["block_size"]
    hashes = []
    for prompt in prompts:
        tokens = httpx.post(f"{a.base_url}/tokenize", json={"model": "tiny", "prompt": prompt},
                            headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
        hashes.append([h.hex() for h in prompt_block_hashes(root_hash(namespace, salt), tokens, block_size)
                       [:(len(tokens) - 1) // block_size]])
    for held in hashes:
        assert len(held) >= 6
        assert set(held) <= set(snap["tier_block_hashes"]["disk"])
        assert not set(held) & (set(snap["block_hashes"]) | set(snap["tier_block_hashes"]["host"]))
    events = events_until(a, snap["seq"])
    first = hashes[0][0]
    path = [(e["type"], e["medium"]) for e in events if e.get("block_hash") == first]
    assert path[:2] == [("BlockStored", "pool"), ("BlockRemoved", "pool")], path
    assert ("BlockStored", "host") in path and ("BlockRemoved", "host") in path and path[-1] == ("BlockStored", "disk")

    router.wait_until(lambda s: s["backends"][0]["seq"] == snap["seq"], timeout=10, what="the router caught up")
    routed = [x["routed"] for x in router.state()["backends"]]
    disk_hits = a.metrics().get('kvserve:prefix_cache_tier_hits_total{tier="disk"}', 0.0)
    for prompt in prompts:
        complete(router.base_url, prompt, max_tokens=1, cache_salt=salt)
    went = [x["routed"] - r for x, r in zip(router.state()["backends"], routed)]
    assert went == [3, 0], f"disk-held prefixes routed {went}"
    loaded = sum(len(h) for h in hashes) * block_size
    deadline = time.monotonic() + 10  # the counters follow the engine's step a moment later
    while a.metrics().get('kvserve:prefix_cache_tier_hits_total{tier="disk"}', 0.0) - disk_hits < loaded:
        assert time.monotonic() < deadline, "A did not read the prefixes back from its disk tier"
        time.sleep(0.1)


def test_no_reachable_backend_is_a_503_with_an_openai_error(tmp_path):
    from server_process import free_port

    router = RouterProcess.start([f"http://127.0.0.1:{free_port()}"], tmp_path, "--routing-policy", "round_robin",
                                 "--allowed-origins", '["https://app.example"]')
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.post(f"{router.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, router.log()
                time.sleep(0.1)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "server_error" and "No backend" in response.json()["error"]["message"]
        assert httpx.get(f"{router.base_url}/health").status_code == 503
        for origin, allowed in (("https://app.example", True), ("https://other.example", False)):  # --allowed-origins
            preflight = httpx.options(f"{router.base_url}/v1/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST"})
            assert (preflight.headers.get("access-control-allow-origin") == origin) == allowed
    finally:
        router.stop()
    log = router.log_path.read_text()  # a backend never up says why, once
    assert log.count("is not in service: ConnectError") == 1, log[-3000:]


def test_the_front_ends_answer_browsers_preflights_without_the_key(cluster):
    """CORS on `kvserve router` and on serve --data-parallel-size's front end (vLLM's default: every origin)."""
    _, _, router, dp = cluster
    for front in (router, dp):
        preflight = httpx.options(f"{front.base_url}/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"


def test_a_killed_backend_fails_its_requests_quickly_is_routed_around_and_used_again_when_back(cluster, tmp_path):
    a, b, router, dp = cluster
    for server in (a, b):  # slow steps, so a stream is still running when its replica dies
        httpx.post(f"{server.base_url}/debug/faults", json={"kind": "delay", "count": 1000, "seconds": 0.05},
                   headers={"Authorization": f"Bearer {KEY}"})
    body = {"model": "tiny", "prompt": TEXT[20000:20100], "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router.base_url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        busy = next(x for x in router.state()["backends"] if x["in_flight"] == 1)
        victim, survivor = (a, b) if busy["url"] == a.base_url else (b, a)
        old_instance = busy["instance_id"]
        victim.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        rest = [line for line in lines if line.startswith("data:")]
    assert time.monotonic() - killed_at < 15
    assert rest[-1] == "data: [DONE]" and "error" in json.loads(rest[-2][5:]), rest[-3:]
    for i in range(3):  # routed around the dead replica
        complete(router.base_url, TEXT[21000 + 100 * i:21000 + 100 * i + 80], max_tokens=2)
    assert [x["up"] for x in router.state()["backends"] if x["url"] == victim.base_url] == [False]
    # The replica comes back (a new instance): used again, with nothing of the old one in the index.
    revived = ServerProcess.start([*victim.process.args[4:-4]], tmp_path, {"KVSERVE_FAULT_INJECTION": "1"},
                                  port=victim.port)
    try:
        state = router.wait_until(lambda s: all(x["up"] for x in s["backends"]), timeout=30,
                                  what="the revived replica back in service")
        entry = next(x for x in state["backends"] if x["url"] == victim.base_url)
        assert entry["instance_id"] != old_instance
        fresh = httpx.get(f"{victim.base_url}/v1/kv_events/snapshot", headers={"Authorization": f"Bearer {KEY}"}).json()
        held = next(x for x in router.state(hashes=True)["backends"] if x["url"] == victim.base_url)
        assert held["block_hashes"] == fresh["block_hashes"] == []  # nothing of the old instance kept
        routed = entry["routed"]
        for i in range(4):
            complete(router.base_url, TEXT[22000 + 100 * i:22000 + 100 * i + 80], max_tokens=2)
        assert next(x for x in router.state()["backends"] if x["url"] == victim.base_url)["routed"] > routed
    finally:
        revived.stop()


def test_the_data_parallel_front_end_stops_once_every_replica_has_exited(cluster):
    """A dead replica is routed around, but with none left the front end answered 503 for ever; it
    now exits 1, as a server whose engine died does, so that a supervisor restarts it. (Last: it
    ends the cluster's front end.)"""
    dp = cluster[3]
    replicas = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()
                and _parent(entry) == dp.process.pid and b"kvserve.cli" in _cmdline(entry)]
    assert len(replicas) == 2
    # their private key reaches them in their environment, not on their command line (which every
    # local user can read)
    assert not any(b"--api-key" in _cmdline(Path(f"/proc/{pid}")) for pid in replicas)
    os.kill(replicas[0], signal.SIGKILL)
    deadline = time.monotonic() + 30  # (a request sent before the front end knows may be its 502)
    while sum(b["up"] for b in httpx.get(f"{dp.base_url}/router/state", timeout=10).json()["backends"]) != 1:
        assert time.monotonic() < deadline, "the killed replica is still in service"
        time.sleep(0.1)
    assert complete(dp.base_url, "still served", max_tokens=2, key=None)  # routed around the first
    os.kill(replicas[1], signal.SIGKILL)
    assert dp.process.wait(timeout=30) == 1
    assert "every replica has exited" in dp.log()


def _parent(entry: Path) -> int | None:
    try:
        return int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""
