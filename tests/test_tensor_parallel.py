"""Tensor parallelism with real processes (gloo): a TP=2 engine computes what a single process does.

Each comparison builds a TP=1 and a TP=2 engine with the same number of KV blocks (the TP=2
budget is per rank, so half), so that the scheduler makes the same decisions (chunked prefill,
preemptions) and greedy tokens must be identical; logits agree within float32 rounding of the
all-reduces' summation order.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from engine_runs import greedy_tokens
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.parallel.worker import sharded_layer_bytes
from kvserve.engine.preflight import preflight
from kvserve.model.loader import load_model
from kvserve.model.parallel import (
    TensorParallelSizeError, check_tensor_parallel_size, shard_layout, valid_tensor_parallel_sizes)
from server_process import free_port

BLOCKS = 12  # a pool too small for the batch below: it preempts


def engine(model, tp: int = 1, blocks: int = BLOCKS, **options) -> LLMEngine:
    """An engine over `model` with `blocks` KV blocks per rank, chunked prefill and float32."""
    options = {"dtype": "float32", "max_model_len": 160, "max_num_batched_tokens": 32, **options}
    per_block = preflight(EngineArgs(model=str(model), tensor_parallel_size=tp, kv_cache_memory="1GiB",
                                     **options)).bytes_per_block
    return LLMEngine(EngineArgs(model=str(model), tensor_parallel_size=tp, kv_cache_memory=(blocks + 1) * per_block,
                                **options))


def mixed_batch(vocab: int, seed: int = 0) -> dict[str, tuple[list[int], dict | None]]:
    """A 100-token prompt (prefilled in chunks) and four short ones: more KV than BLOCKS hold."""
    g = torch.Generator().manual_seed(seed)
    prompts = {"long": torch.randint(5, vocab, (100,), generator=g).tolist()}
    for i in range(4):
        prompts[f"short{i}"] = torch.randint(5, vocab, (12 + 3 * i,), generator=g).tolist()
    return {rid: (ids, None) for rid, ids in prompts.items()}


def test_valid_sizes_and_the_one_line_error():
    assert valid_tensor_parallel_sizes(9, 3, 1536) == [1, 3]  # the default model
    layouts = [shard_layout(rank, 16, 32, 8, 14336) for rank in range(16)]
    assert [layout.kv_start for layout in layouts] == [rank // 2 for rank in range(16)]  # each KV head on 2 ranks
    assert {layout.kv_replicas for layout in layouts} == {2}
    assert valid_tensor_parallel_sizes(32, 8, 14336) == [1, 2, 4, 8, 16, 32]  # 16, 32: KV heads replicated
    with pytest.raises(TensorParallelSizeError, match=r"--tensor-parallel-size 2 .* valid sizes: 1, 3$"):
        check_tensor_parallel_size(2, 9, 3, 1536)


def test_default_model_refuses_tp2_before_loading():
    with pytest.raises(ValueError, match="valid sizes: 1, 3") as info:
        preflight(EngineArgs(tensor_parallel_size=2))
    assert "\n" not in str(info.value)


def test_quantized_shards_must_hold_whole_groups(tiny_llama):
    """int4 weights shard in whole groups of 32 input columns: 4 ranks of the tiny model's 64
    o_proj columns would hold 16 each, a one-line error naming the sizes before anything loads;
    int8 (one scale per output channel) cuts anywhere."""
    with pytest.raises(ValueError, match="whole groups of 32: each rank would hold 16 input columns of o_proj") as info:
        preflight(EngineArgs(model=str(tiny_llama), tensor_parallel_size=4, quantization="int4"))
    assert "\n" not in str(info.value)
    preflight(EngineArgs(model=str(tiny_llama), tensor_parallel_size=4, quantization="int8"))
    preflight(EngineArgs(tensor_parallel_size=3, quantization="int4"))  # the default model: 192 and 512 columns


def test_a_ggufs_8_bit_layers_shard_in_whole_groups_under_int8(tiny_llama, tmp_path):
    """--quantization int8 keeps a GGUF's 8-bit layers as stored, in groups of 32 input columns:
    the same one-line refusal as int4 before anything loads; a file of 4-bit layers is
    requantized per output channel under int8 and cuts anywhere."""
    from tiny_models import write_gguf

    for linears in ("Q8_0", "Q4_0"):
        write_gguf(tiny_llama, tmp_path / f"{linears}.gguf", "llama", linears=linears)
    args = dict(tokenizer=str(tiny_llama), tensor_parallel_size=4, quantization="int8")
    with pytest.raises(ValueError, match="whole groups of 32: each rank would hold 16 input columns") as info:
        preflight(EngineArgs(model=str(tmp_path / "Q8_0.gguf"), **args))
    assert "\n" not in str(info.value)
    preflight(EngineArgs(model=str(tmp_path / "Q4_0.gguf"), **args))


def _gguf_blocks(type_id: int, rows: int, cols: int, seed: int = 0):
    """A synthetic GGUF matrix of Q8_0, Q4_1 or F32 values."""
    from kvserve.model.gguf_file import F32, Q8_0, GGUFTensor

    g = torch.Generator().manual_seed(seed)
    if type_id == F32:
        raw = torch.randn(rows, cols, generator=g).view(torch.uint8)
    else:
        blocks = rows * cols // 32
        scales = (torch.rand(blocks, 2 if type_id != Q8_0 else 1, generator=g) * 0.1).half().view(torch.uint8)
        codes = torch.randint(0, 256, (blocks, 32 if type_id == Q8_0 else 16), generator=g, dtype=torch.uint8)
        raw = torch.cat([scales, codes], dim=1)
    return GGUFTensor("t", (rows, cols), type_id, raw.reshape(-1))


def test_checkpoint_cuts_read_only_the_shard():
    """A rank reads its rows or whole-block columns of a GGUF matrix as stored (no dequantizing of
    the rest): the same values as cutting the dequantized whole; a cut inside a block is refused
    (the loader then dequantizes and cuts); the layout names each HF tensor's cut."""
    from kvserve.model.gguf_file import F32, Q4_1, Q8_0, cut_tensor, dequantize, quantized_matrix

    for type_id in (Q8_0, Q4_1, F32):
        tensor = _gguf_blocks(type_id, 6, 128)
        whole = dequantize(tensor)
        assert torch.equal(dequantize(cut_tensor(tensor, 0, 2, 4)), whole[2:4])
        assert torch.equal(dequantize(cut_tensor(tensor, 1, 32, 96)), whole[:, 32:96])
        if type_id != F32:
            assert torch.equal(quantized_matrix(cut_tensor(tensor, 1, 64, 128)).q,
                               quantized_matrix(tensor).columns(64, 128).q)
            assert cut_tensor(tensor, 1, 16, 48) is None
    layout = shard_layout(1, 3, 9, 3, 1536)  # the default model's rank 1
    assert layout.checkpoint_cut("model.layers.0.self_attn.q_proj.weight", 64) == (0, 192, 384)
    assert layout.checkpoint_cut("model.layers.0.self_attn.v_proj.weight", 64) == (0, 64, 128)
    assert layout.checkpoint_cut("model.layers.0.self_attn.o_proj.weight", 64) == (1, 192, 384)
    assert layout.checkpoint_cut("model.layers.0.mlp.down_proj.weight", 64) == (1, 512, 1024)
    assert layout.checkpoint_cut("model.layers.0.self_attn.k_proj.bias", 64) == (0, 64, 128)
    assert layout.checkpoint_cut("model.embed_tokens.weight", 64) is None


def test_safetensors_cut_load_equals_cutting_the_full_load(tiny_model_factory):
    path = tiny_model_factory("qwen2")  # q/k/v biases
    layout = shard_layout(1, 2, 4, 2, 128)
    full = load_model(path).weights
    cut = load_model(path, cut=lambda name: layout.checkpoint_cut(name, 16)).weights
    assert full.keys() == cut.keys()
    for name, tensor in full.items():
        part = layout.checkpoint_cut(name, 16)
        expected = tensor if part is None else tensor.narrow(part[0], part[1], part[2] - part[1])
        assert torch.equal(cut[name], expected), name


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tp2_quantized_weights_match_one_process(tiny_llama, mode):
    """Each rank serves its cut of the full model's quantized codes, scales and zeros.

    Batches over 8 rows multiply through dense copies dequantized from each rank's codes: greedy
    tokens identical, logits within float32 rounding. Up to 8 rows go through the int4 kernel,
    whose outputs are bfloat16: each rank's partial sum of a row-parallel layer is rounded before
    the all-reduce (one process rounds the whole sum once), and the logits themselves are bfloat16
    (the LM head is int8), so there the logits agree within a few bfloat16 steps of the largest
    (2^-5 of it: 4 steps), and the argmax agrees wherever one process's top two are further apart
    than twice that."""
    options = {"quantization": mode, "blocks": 40, "max_num_batched_tokens": 256}  # no preemption: 9 rows a step
    single, parallel = engine(tiny_llama, **options), engine(tiny_llama, 2, **options)
    try:
        g = torch.Generator().manual_seed(0)
        vocab = single.model_config.vocab_size
        batch = {f"p{i}": (torch.randint(5, vocab, (10 + i,), generator=g).tolist(), None) for i in range(9)}
        assert greedy_tokens(parallel, batch) == greedy_tokens(single, batch)
        prompt = torch.randint(5, vocab, (96,), generator=g).tolist()
        assert (single.score(prompt) - parallel.score(prompt)).abs().max().item() < 1e-4  # chunks of 256 rows
        one, two = single.score(prompt[:32], chunk_size=1), parallel.score(prompt[:32], chunk_size=1)  # the kernel
        tolerance = 2**-5 * one.abs().max().item()
        assert (one - two).abs().max().item() <= tolerance
        top = one.topk(2, dim=-1).values
        clear = top[:, 0] - top[:, 1] > 2 * tolerance
        assert clear.any() and torch.equal(one.argmax(-1)[clear], two.argmax(-1)[clear])
        stats = parallel.parallel.describe()
        full = sharded_layer_bytes(single.model)
        kind = "int4 g32" if mode == "int4" else "int8 per channel"
        # 4-bit codes are packed two groups to a byte: a rank holding an odd number of a row-parallel
        # layer's groups pads one group (16 bytes a row); int8 codes are not padded.
        pad = 0 if mode == "int8" else sum(16 * (layer.self_attn.o_proj.out_features + layer.mlp.down_proj.out_features)
                                           for layer in single.model.layers)
        for s in stats:
            assert full <= s.sharded_layer_bytes * 2 <= full + 2 * pad  # codes, scales and offsets
            assert kind in s.linears
    finally:
        parallel.close()


def test_tp2_on_a_k_quant_gguf_serves_one_process_weights(tiny_model_factory, tmp_path):
    """A Q4_K_M-shaped GGUF (q/k/gate/up Q4_K, v/o/down Q6_K): super-blocks of 256 would be split where
    a rank's share of o_proj's and down_proj's columns ends, so every rank reads the file whole and
    serves the cut of the matrices one process serves (Q4_K as int4, the Q6_K and mixed q/k/v ones as
    int8 g32). A prefill's logits equal one process's within float32 rounding (random k-quant blocks
    give near-tied logits, so greedy decoding, which one process runs through the fused lean step and
    the ranks through the modules, is not compared). The model is a Qwen3: each rank norms its own heads."""
    from tiny_models import write_gguf

    hf_dir = tiny_model_factory("qwen3", hidden_size=256, intermediate_size=512, head_dim=64)
    path = tmp_path / "k-quants.gguf"
    write_gguf(hf_dir, path, "qwen3", linears="K")
    options = {"tokenizer": str(hf_dir), "blocks": 40, "max_num_batched_tokens": 256}
    single, parallel = engine(path, **options), engine(path, 2, **options)
    try:
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(5, single.model_config.vocab_size, (96,), generator=g).tolist()
        one, two = single.score(prompt), parallel.score(prompt)
        assert (one - two).abs().max().item() < 1e-4 * one.abs().max().item()
        for stats in parallel.parallel.describe():
            assert "int4 g32" in stats.linears and "int8 g32" in stats.linears, stats.linears
    finally:
        parallel.close()


def test_offload_tiers_under_tp_are_a_one_line_error(tmp_path):
    """The tiers copy rank 0's pool only: with TP they are refused before anything loads."""
    for options in ({"kv_offloading_size": 1.0}, {"kv_offloading_disk_path": str(tmp_path)}):
        with pytest.raises(ValueError, match="do not work with --tensor-parallel-size > 1") as info:
            EngineArgs(tensor_parallel_size=3, **options).validate()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])  # qwen3 (heads normed per rank): the k-quant test
def test_tp2_matches_one_process(tiny_model_factory, arch):
    """Greedy tokens identical and teacher-forced logits within 1e-4, over a mixed batch with a
    chunked prefill and preemptions; for llama also prefix-cache hits, an H2O-evicting request
    and the per-rank memory of the pool and the sharded layers."""
    path = tiny_model_factory(arch)
    single, parallel = engine(path), engine(path, tp=2)
    try:
        batch = mixed_batch(single.model_config.vocab_size)
        expected = greedy_tokens(single, batch)
        assert greedy_tokens(parallel, batch) == expected
        assert parallel.scheduler.num_preemptions == single.scheduler.num_preemptions > 0
        prompt = batch["long"][0]
        diff = (single.score(prompt) - parallel.score(prompt)).abs().max().item()
        assert diff < 1e-4
        if arch != "llama":
            return
        hits = parallel.kv_manager.stats.hits
        assert greedy_tokens(parallel, {"again": batch["long"]}) == {"again": expected["long"]}
        assert parallel.kv_manager.stats.hits > hits
        h2o = {"policy": "h2o", "budget": 48, "sink_tokens": 4, "recent_tokens": 16}
        evicting = {"h2o": (batch["long"][0][:60], h2o)}  # 60 + 24 tokens: evicts
        assert greedy_tokens(parallel, evicting) == greedy_tokens(single, evicting)
        stats = parallel.parallel.describe()
        assert [s.rank for s in stats] == [0, 1]
        assert parallel.num_blocks == single.num_blocks
        # the checkpoint's layer matrices at the engines' float32 (the one-process engine's linears are
        # prepacked by now: cpu_linear.py)
        full_layers = sum(t.numel() * 4 for name, t in load_model(path).weights.items()
                          if ".layers." in name and "norm" not in name)
        for s in stats:
            assert s.kv_pool_bytes * 2 == single.kv_cache.nbytes
            assert s.sharded_layer_bytes * 2 == full_layers
            assert (s.q_heads, s.kv_heads) == (2, 1)
    finally:
        parallel.close()


def test_tp4_replicates_kv_heads(tiny_llama):
    """4 ranks, 2 KV heads: ranks 0-1 hold KV head 0, ranks 2-3 head 1 (vLLM's rule), each with
    its own query head; greedy tokens as in one process."""
    single, parallel = engine(tiny_llama), engine(tiny_llama, 4)
    try:
        stats = parallel.parallel.describe()
        assert [(s.q_heads, s.kv_heads) for s in stats] == [(1, 1)] * 4
        batch = mixed_batch(single.model_config.vocab_size, seed=3)
        assert greedy_tokens(parallel, batch) == greedy_tokens(single, batch)
    finally:
        parallel.close()


def test_tp2_speculative_decoding_matches_one_process(tiny_llama):
    """A decode's drafts reach the other rank as rows attended as decodes: greedy tokens as in
    one process without drafts, with drafts accepted."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    single, parallel = engine(tiny_llama, blocks=40), engine(tiny_llama, 2, blocks=40, speculative_config=ngram)
    try:
        batch = {f"loop{i}": ([5 + i, 6, 7, 8] * 4, None) for i in range(3)}
        assert greedy_tokens(parallel, batch) == greedy_tokens(single, batch)
        assert parallel.drafter.stats.num_accepted_tokens > 0
    finally:
        parallel.close()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int4"])
def test_tp2_quantized_kv_cache(tiny_llama, kv_cache_dtype):
    """fp8 (fitted key bases) and int4 (key centres): calibrated once over the full model on
    rank 0, each rank applies its heads' part; greedy tokens as in one process."""
    single, parallel = engine(tiny_llama, kv_cache_dtype=kv_cache_dtype), engine(tiny_llama, 2,
                                                                                 kv_cache_dtype=kv_cache_dtype)
    try:
        batch = mixed_batch(single.model_config.vocab_size, seed=1)
        assert greedy_tokens(parallel, batch) == greedy_tokens(single, batch)
    finally:
        parallel.close()


def test_two_nodes_on_loopback(tiny_llama, tmp_path):
    """Node 1 is a headless `kvserve serve --node-rank 1`; node 0 runs the engine."""
    port = str(free_port())
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
             "--dtype", "float32"]
    log = tmp_path / "node1.log"
    with open(log, "wb") as out:
        node1 = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", str(tiny_llama), *flags,
                                  "--node-rank", "1"], stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    node0 = None
    try:
        node0 = engine(tiny_llama, 2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=int(port))
        assert node0.parallel.processes == []  # every worker is on the other "node"
        single = engine(tiny_llama)
        batch = mixed_batch(single.model_config.vocab_size, seed=2)
        assert greedy_tokens(node0, batch) == greedy_tokens(single, batch)
        node0.close()
        assert node1.wait(timeout=30) == 0, log.read_text()
    finally:
        if node0 is not None:
            node0.close()
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_a_hung_worker_fails_the_step_within_the_timeout(tiny_llama, monkeypatch):
    """A worker that stops answering (SIGSTOP) fails the step once the data group's timeout
    passes (FatalEngineError, never a hang); every later step fails at once; close() kills it."""
    from kvserve import SamplingParams
    from kvserve.engine.errors import FatalEngineError

    monkeypatch.setenv("KVSERVE_DIST_TIMEOUT_S", "3")
    parallel = engine(tiny_llama, 2)
    (worker,) = parallel.parallel.processes
    try:
        parallel.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=50))
        parallel.step()
        os.kill(worker.pid, signal.SIGSTOP)
        with pytest.raises(FatalEngineError):
            parallel.step()
        with pytest.raises(FatalEngineError, match="broken"):
            parallel.step()
    finally:
        parallel.close()
    assert not worker.is_alive()


def test_a_worker_lost_while_idle_is_reported_at_once(tiny_llama):
    """The watchdog sees a local worker die with no step running: `on_failure` is called (a
    server stops on it: /health 503, exit 1) and the next step fails instead of hanging."""
    from kvserve import SamplingParams
    from kvserve.engine.errors import FatalEngineError

    parallel = engine(tiny_llama, 2)
    reported = threading.Event()
    parallel.parallel.on_failure = lambda message: reported.set()
    try:
        (worker,) = parallel.parallel.processes
        os.kill(worker.pid, signal.SIGKILL)
        assert reported.wait(timeout=10)
        parallel.add_request([5, 6, 7], SamplingParams(max_tokens=4))
        with pytest.raises(FatalEngineError, match="exited"):
            parallel.step()
    finally:
        parallel.close()


def test_no_heartbeat_is_sent_while_a_step_runs(monkeypatch):
    """The heartbeat keeps an idle group alive, but a worker reads the control group only between
    steps: one sent during a long forward pass (a big prefill chunk) waited for the whole step and
    failed it at the group's timeout. Heartbeats wait for the step, and resume once idle."""
    import time
    from types import SimpleNamespace

    from kvserve.engine.parallel import executor as tp

    sent: list[tuple[str, float]] = []
    monkeypatch.setattr(tp.dist, "broadcast_object_list",
                        lambda objects, src, group=None: sent.append((type(objects[0]).__name__, time.monotonic())))
    rank0 = object.__new__(tp.TensorParallelExecutor)
    rank0.__dict__.update(config=SimpleNamespace(timeout_s=0.4), failure=None, on_failure=None,
                          groups=SimpleNamespace(control=None), _lock=threading.RLock(), _last_send=time.monotonic(),
                          _closed=threading.Event(), _closing=threading.Event())
    threading.Thread(target=rank0._heartbeat, daemon=True).start()
    ids = torch.zeros(1, dtype=torch.long)
    try:
        with rank0.step(ids, ids, ids, []):
            start = time.monotonic()
            time.sleep(1.0)  # ten heartbeat intervals
            end = time.monotonic()
        deadline = time.monotonic() + 10
        while not any(kind == "Heartbeat" and t > end for kind, t in sent) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        rank0._closed.set()
    assert [kind for kind, t in sent if start <= t <= end] == []
    assert any(kind == "Heartbeat" and t > end for kind, t in sent)


def test_a_worker_whose_spawner_is_already_gone_exits_at_once():
    """A worker's imports take seconds; a server stopped meanwhile left it reading init's pid as its
    parent's and waiting for ever. It is told its spawner's pid, and exits at once if that is gone."""
    code = ("import time\nfrom kvserve.engine.parallel.worker import _exit_with_parent\n"
            "_exit_with_parent(2 ** 22 + 12345)\ntime.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert done.returncode == 1
