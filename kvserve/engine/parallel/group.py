"""Where the ranks meet and the two process groups they share.

The default group serves the start-up (a long timeout: the rendezvous, the Setup message and
the barrier while workers load their weights). The data group carries the all-reduces of the forward pass (NCCL on CUDA,
gloo on CPU) with a short timeout, so a rank that hangs fails the step instead of hanging it;
the control group (always gloo, as vLLM keeps its metadata on a CPU group) carries rank 0's
messages, with the same short timeout: workers wait on it between steps, so rank 0 sends a
heartbeat while it is idle (executor.py), and a worker whose rank 0 hangs gives up.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvserve.engine.args import EngineArgs

# Seconds a collective of the forward pass may wait for the other ranks (gloo's default is 30
# minutes); $KVSERVE_DIST_TIMEOUT_S overrides it.
DEFAULT_TIMEOUT_S = 60.0
# Seconds the ranks may take to join and to load their weights before the first step.
STARTUP_TIMEOUT_S = 900.0
# The cores this engine's ranks share when not the whole machine's (set per data-parallel replica).
CORES_ENV = "KVSERVE_CPU_CORES"
# The data-parallel replicas on this machine (set per replica): each takes its share of the RAM.
REPLICAS_ENV = "KVSERVE_NODE_REPLICAS"


@dataclass(frozen=True)
class DistributedConfig:
    """How the `world_size` ranks meet: node `node_rank` of `nnodes` runs ranks
    [node_rank * per_node, (node_rank + 1) * per_node)."""

    world_size: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    timeout_s: float
    # This process's rank when a launcher (torchrun) started every rank itself: nothing to spawn.
    launcher_rank: int | None = None

    @property
    def per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    @property
    def init_method(self) -> str:
        if self.launcher_rank is not None:  # torchrun's own store (its agent may already hold the port)
            return "env://"
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started it (RANK, WORLD_SIZE and LOCAL_WORLD_SIZE set), else None."""
    if all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")):
        return int(os.environ["RANK"])
    return None


def distributed_config(args: EngineArgs) -> DistributedConfig:
    """From the options (and torchrun's MASTER_ADDR / MASTER_PORT where the options leave them).
    Under torchrun every rank is a process it started: WORLD_SIZE must be --tensor-parallel-size."""
    rank = torchrun_rank()
    if rank is not None:
        world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
        if world != args.tensor_parallel_size:
            raise ValueError(f"under torchrun, --tensor-parallel-size must equal $WORLD_SIZE ({world}), "
                             f"got {args.tensor_parallel_size}")
        timeout = float(os.environ.get("KVSERVE_DIST_TIMEOUT_S") or DEFAULT_TIMEOUT_S)
        return DistributedConfig(world, world // per_node, rank // per_node, os.environ.get("MASTER_ADDR", ""),
                                 int(os.environ.get("MASTER_PORT") or 0), timeout, launcher_rank=rank)
    addr = args.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = args.master_port or (int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None)
    if port is None:
        if args.nnodes > 1:
            raise ValueError("--nnodes > 1 needs --master-port (or $MASTER_PORT), the same on every node")
        port = free_port(addr)
    timeout = float(os.environ.get("KVSERVE_DIST_TIMEOUT_S") or DEFAULT_TIMEOUT_S)
    return DistributedConfig(args.tensor_parallel_size, args.nnodes, args.node_rank, addr, port, timeout)


def processes_on_node(args: EngineArgs) -> int:
    """The engine processes on this machine with a KV pool each: this engine's ranks here (torchrun's
    LOCAL_WORLD_SIZE, else --tensor-parallel-size over --nnodes) times the data-parallel replicas."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 0) if torchrun_rank() is not None else 0
    ranks = ranks or max(1, args.tensor_parallel_size // max(1, args.nnodes))
    return ranks * max(1, int(os.environ.get(REPLICAS_ENV) or 1))


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def set_rank_threads(config: DistributedConfig) -> int:
    """Each rank of this node takes an equal share of its cores (at least one): N ranks each
    running torch's default thread count would oversubscribe the machine N times. The cores are
    the machine's, or $KVSERVE_CPU_CORES where `serve --data-parallel-size` gave this replica its share."""
    cores = int(os.environ.get(CORES_ENV) or os.cpu_count() or 1)
    threads = max(1, cores // config.per_node)
    torch.set_num_threads(threads)
    return threads


def rank_device(device: torch.device, rank: int, config: DistributedConfig) -> torch.device:
    """This rank's device: CUDA ranks take one GPU each (by local rank); CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank - config.local_ranks.start)


@dataclass
class RankGroups:
    """This rank's place and its two groups (module docstring)."""

    rank: int
    world_size: int
    data: dist.ProcessGroup
    control: dist.ProcessGroup
    device: torch.device

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it (the row-parallel layers' hook)."""
        dist.all_reduce(tensor, group=self.data)
        return tensor

    def sum_observed(self, tensors: list[torch.Tensor]) -> None:
        """Sum the attention rows eviction policies observe over the ranks (each saw its own
        query heads), in place, in one all-reduce; every rank calls it after the forward pass,
        so the one keep-set rank 0 decides sees every head, as in a single process."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.all_reduce(flat)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


def join(rank: int, config: DistributedConfig, device: torch.device) -> RankGroups:
    """Join the default group (the rendezvous) and create the data and control groups; every
    rank calls it, in the same order."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=config.init_method, rank=rank, world_size=config.world_size,
                            timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    data = dist.new_group(backend=backend, timeout=timedelta(seconds=config.timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.timeout_s))
    return RankGroups(rank, config.world_size, data, control, device)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
