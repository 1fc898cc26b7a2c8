"""A worker rank: its shard of the model and of the KV pool, and a loop over rank 0's messages.

A worker holds no scheduler, block manager or sampler: each StepPlan carries everything its
attention backend needs to build the same metadata rank 0 built, and the forward pass stops at
the final hidden states (the LM head runs on rank 0). Any error ends the process with a non-zero
code; rank 0 then sees its collectives fail (a closed connection) and stops the engine.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from kvserve.cache.eviction.moves import move_tokens
from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVCache
from kvserve.engine.args import EngineArgs
from kvserve.engine.parallel.group import (
    DistributedConfig, RankGroups, distributed_config, join, leave, rank_device, set_rank_threads)
from kvserve.engine.parallel.messages import Describe, Heartbeat, MoveTokens, RankStats, Setup, Shutdown, StepPlan
from kvserve.engine.platforms import platform_for
from kvserve.engine.preflight import select_device
from kvserve.model.attention import AttentionBackend, make_attention_backend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import load_model, quantized_sources, read_whole_under_tp
from kvserve.model.parallel import ShardLayout, shard_heads, shard_layout, shard_model
from kvserve.model.shape import read_model_shape
from kvserve.model.quant_linear import (
    QuantizationReport, install_quantized, quantization_targets, quantized_bytes, resident_weight_bytes)
from kvserve.model.quantized import QuantizedMatrix
from kvserve.process_heap import settle_heap
from kvserve.transfers import host_to_device

logger = logging.getLogger("kvserve")


def worker_main(rank: int, config: DistributedConfig, args: EngineArgs, log_level: int = logging.INFO,
                parent_pid: int | None = None) -> None:
    """The worker process's entry point (launch.spawn_workers). `parent_pid`: the spawning
    process, whose end ends this one (None: not watched).

    SIGINT and SIGTERM are ignored: a Ctrl-C or a service manager's stop reaches the whole process
    group, and the engine (rank 0) stops its workers itself once its requests in flight are done
    (a Shutdown message, then a kill for one that lingers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(message)s")
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    try:
        run_worker(rank, config, args)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)


def run_worker(rank: int, config: DistributedConfig, args: EngineArgs) -> None:
    threads = set_rank_threads(config)
    device = rank_device(select_device(args.device), rank, config)
    groups = join(rank, config, device)
    setup: Setup = receive(groups, start_up=True)
    start = time.monotonic()
    layout = layout_of(rank, config.world_size, args)
    model, reports = build_shard(args, layout, setup, device, groups.all_reduce)
    weights = resident_weight_bytes(model)
    sharded = sharded_layer_bytes(model)
    model.prepack()
    release_freed_memory()
    model.set_key_centers(shard_heads(setup.key_centers, layout))
    model.set_key_bases(shard_heads(setup.key_bases, layout))
    kv_format = make_kv_format(args.kv_cache_dtype, setup.dtype)
    backend = make_attention_backend(args.attention_backend, kv_format, setup.kv_spec, setup.dtype, model.rope,
                                     device)
    # rank 0's preparation (CUDA's fused ops): every rank computes its replicated rows the same way
    platform_for(device).prepare_model(model, backend, tensor_parallel=True)
    kv_cache = KVCache(setup.kv_spec, kv_format, setup.num_blocks, device)
    linears = reports[0].describe()
    logger.info("rank %d ready in %.1f s (%d threads): query heads [%d, %d), KV heads [%d, %d), weights %s "
                "(linears %s), KV pool %s", rank, time.monotonic() - start, threads, layout.q_start,
                layout.q_start + layout.q_heads, layout.kv_start, layout.kv_start + layout.kv_heads,
                mib(weights), linears, mib(kv_cache.nbytes))
    stats = RankStats(rank, weights, sharded, kv_cache.nbytes, layout.q_heads, layout.kv_heads, linears)
    settle_heap()  # a collection's stall here would stall every rank
    dist.barrier()  # ready (on the start-up group): rank 0 starts stepping
    serve(groups, model, kv_cache, backend, stats)
    leave()


def serve(groups: RankGroups, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend,
          stats: RankStats) -> None:
    """Carry out rank 0's messages until a Shutdown."""
    while True:
        message = receive(groups)
        if isinstance(message, StepPlan):
            run_step(groups, model, kv_cache, backend, message)
        elif isinstance(message, MoveTokens):
            move_tokens(kv_cache, message.src_slots, message.dst_slots)
        elif isinstance(message, Describe):
            dist.gather_object(stats, None, dst=0, group=groups.control)
        elif isinstance(message, Shutdown):
            return
        elif not isinstance(message, Heartbeat):
            raise RuntimeError(f"unexpected message {type(message).__name__}")


@torch.inference_mode()
def run_step(groups: RankGroups, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend,
             plan: StepPlan) -> None:
    device = backend.device

    def tensor(array) -> torch.Tensor:
        return host_to_device(array, device)

    meta = backend.build(plan.sequences, tensor(plan.slot_mapping))
    model.final_hidden(tensor(plan.input_ids), tensor(plan.positions), kv_cache, meta, tensor([]))
    groups.sum_observed([rows for _, rows in meta.observed_attention])


def receive(groups: RankGroups, start_up: bool = False):
    """The next message from rank 0 (on the start-up group while rank 0 still loads)."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=None if start_up else groups.control)
    return box[0]


def layout_of(rank: int, size: int, args: EngineArgs) -> ShardLayout:
    """The rank's shard of `args.model`, from its config (no weights read)."""
    shape = read_model_shape(args.model)
    return shard_layout(rank, size, shape.num_heads, shape.num_kv_heads, shape.intermediate_size)


def build_shard(args: EngineArgs, layout: ShardLayout, setup: Setup, device: torch.device,
                reduce: Callable[[torch.Tensor], torch.Tensor]) -> tuple[LlamaForCausalLM, list[QuantizationReport]]:
    """The rank's part of the model, with its cut of the quantized weights (the LM head, which
    runs on rank 0 only, left plain). The loader reads only the rank's slices of the sharded
    tensors, except under --quantization int8, whose per-channel scales span whole rows, and for a
    GGUF whose blocks a rank's share of a row may split (the k-quants' super-blocks of 256;
    gguf_file.cuts_by_blocks): then the full checkpoint is read, quantized and cut, as rank 0
    plans it."""
    mode, dtype = args.quantization, setup.dtype
    reports: list[QuantizationReport] = []
    whole = mode == "int8" or mode != "none" and read_whole_under_tp(args.model)
    if whole:
        loaded = load_model(args.model, tokenizer=args.tokenizer, trust_remote_code=args.trust_remote_code,
                            load_format=args.load_format)
        shards: dict[str, QuantizedMatrix] = {}

        def shard(model: LlamaForCausalLM) -> None:  # the full model's matrices, cut like its plain layers
            full = quantization_targets(model, mode, quantized_sources(loaded, with_head=False), dtype,
                                        skip=("lm_head",))
            shards.update(shard_model(model, layout, reduce, full))

        def install(model: LlamaForCausalLM) -> None:
            reports.append(install_quantized(model, shards, mode, dtype, device))
    else:
        head_dim = read_model_shape(args.model).head_dim
        loaded = load_model(args.model, cut=lambda name: layout.checkpoint_cut(name, head_dim),
                            tokenizer=args.tokenizer, trust_remote_code=args.trust_remote_code,
                            load_format=args.load_format)

        def shard(model: LlamaForCausalLM) -> None:  # the empty model, before its cut weights load
            shard_model(model, layout, reduce)

        def install(model: LlamaForCausalLM) -> None:  # from the cut sources: the cut of the full ones
            sources = {} if mode == "none" else quantized_sources(loaded, with_head=False)
            targets = quantization_targets(model, mode, sources, dtype, skip=("lm_head",))
            reports.append(install_quantized(model, targets, mode, dtype, device))

    model = LlamaForCausalLM.from_hf_weights(loaded.config, loaded.weights, setup.max_positions, dtype, device,
                                             shard=shard, prepack=False, replace_linears=install,
                                             weights_cut=not whole)
    return model, reports


def release_freed_memory() -> None:
    """Hand the heap pages freed after sharding back to the OS (glibc's malloc_trim): a worker
    reads the full checkpoint to cut its shard, and without this the freed pages of those tensors
    stay in the process's resident memory. Does nothing where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def sharded_layer_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the layers tensor parallelism splits (q/k/v, o, gate/up and down projections), in
    the form they are served (quantized ones: their codes, scales and zeros)."""
    return sum(quantized_bytes(linear) for layer in model.layers
               for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                              layer.mlp.down_proj))


def _exit_with_parent(parent: int) -> None:
    """A thread that ends this process when `parent`, the process that spawned it, is gone (kill
    -9 leaves no chance to stop the workers in order); at once if it went while this one started."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="kvserve-parent-watch", daemon=True).start()


def run_node(args: EngineArgs) -> int:
    """A node other than 0 (--node-rank > 0): its ranks as workers only, no engine and no server.
    The first runs in this process, the others are spawned; returns the exit status."""
    from kvserve.engine.parallel.launch import spawn_workers, stop_workers

    config = distributed_config(args)
    if config.launcher_rank is not None:  # torchrun started this rank (and every other)
        run_worker(config.launcher_rank, config, args)
        return 0
    if config.node_rank == 0:
        raise ValueError("node 0 runs the engine; run_node is for --node-rank > 0")
    ranks = list(config.local_ranks)
    others = spawn_workers(args, config, ranks[1:])
    logger.info("node %d of %d: ranks %d-%d of %d, meeting at %s", config.node_rank, config.nnodes, ranks[0],
                ranks[-1], config.world_size, config.init_method)
    status = 0
    try:
        run_worker(ranks[0], config, args)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", ranks[0])
        status = 1
    stop_workers(others, timeout=30.0)
    if any(p.exitcode for p in others):
        status = 1
    return status


def mib(num_bytes: int) -> str:
    """A size for the start-up log."""
    return f"{num_bytes / 2**20:,.1f} MiB"
