"""Rank 0's side of tensor parallelism: the workers it started, and what it sends them.

The engine process is rank 0: it spawns this node's other ranks (launch.py), joins the groups
(group.py), sends the Setup once its pool is sized and calibrated, waits for every worker to
load, then sends one StepPlan per forward pass (ModelRunner.run) and one MoveTokens per
compaction. Sends are serialised by a lock, held from a step's plan to the end of its forward
pass: a heartbeat thread sends while the engine is idle, never during a step (a worker reads the
control group only between steps, so a heartbeat sent mid-step would wait for the whole step and
fail a long one, a big prefill chunk, at the timeout).

Failure: a worker that exits (the watchdog sees local ones at once), or a collective that fails
(a closed connection, or the data group's timeout when a rank hangs) makes every later call
raise FatalEngineError; `on_failure` is called once, so that a server can stop while idle.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from kvserve.engine.args import EngineArgs
from kvserve.engine.errors import FatalEngineError
from kvserve.engine.parallel.group import (
    DistributedConfig, RankGroups, distributed_config, join, leave, rank_device, set_rank_threads)
from kvserve.engine.parallel.launch import Watchdog, spawn_workers, stop_workers
from kvserve.engine.parallel.messages import Describe, Heartbeat, MoveTokens, RankStats, Setup, Shutdown, StepPlan
from kvserve.model.attention import StepSequence

logger = logging.getLogger("kvserve")


class TensorParallelExecutor:
    def __init__(self, args: EngineArgs, device: torch.device):
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already open in this process: close() it first")
        self.config: DistributedConfig = distributed_config(args)
        if self.config.node_rank != 0 or self.config.launcher_rank not in (None, 0):
            raise ValueError("--node-rank > 0 (or a torchrun rank > 0) runs workers only (kvserve serve starts "
                             "them); the engine is on node 0, rank 0")
        self.threads = set_rank_threads(self.config)
        self.device = rank_device(device, 0, self.config)
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self.groups: RankGroups | None = None
        self._lock = threading.RLock()
        self.local_stats: RankStats | None = None  # rank 0's own, set at start-up
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._closing = threading.Event()
        # Under torchrun the launcher started every rank already.
        local = [] if self.config.launcher_rank is not None else [r for r in self.config.local_ranks if r != 0]
        self.processes = spawn_workers(args, self.config, local)
        # Kill the workers and leave the group if this object is dropped or the interpreter exits
        # without close().
        self._finalizer = weakref.finalize(self, _abandon, list(self.processes))
        self.watchdog = Watchdog(self.processes, self._fail)
        logger.info("Tensor parallel: %d ranks on %d node(s) at %s (%s); %d local worker(s) started, %d threads "
                    "each", self.config.world_size, self.config.nnodes, self.config.init_method,
                    "nccl" if self.device.type == "cuda" else "gloo", len(self.processes), self.threads)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    # ------------------------------------------------------------------ start-up
    def join(self) -> RankGroups:
        """The rendezvous, run in a thread so that a worker dying before it joins fails start-up
        at once instead of after the rendezvous timeout."""
        result: list = []

        def run() -> None:
            try:
                result.append(join(0, self.config, self.device))
            except BaseException as exc:  # reported below
                result.append(exc)

        thread = threading.Thread(target=run, name="kvserve-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if self.failure is not None:
                self.close()
                raise FatalEngineError(f"tensor parallel start-up failed: {self.failure}")
        if isinstance(result[0], BaseException):
            self.close()
            raise FatalEngineError(f"tensor parallel start-up failed: {result[0]}") from result[0]
        self.groups = result[0]
        return self.groups

    def start(self, setup: Setup) -> None:
        """Send the Setup, wait for every worker to build its shard, start the heartbeat."""
        try:
            dist.broadcast_object_list([setup], src=0)
            dist.barrier()
        except RuntimeError as exc:
            raise self.lost(exc) from exc
        self._last_send = time.monotonic()
        threading.Thread(target=self._heartbeat, name="kvserve-tp-heartbeat", daemon=True).start()

    # ------------------------------------------------------------------ steps
    @contextmanager
    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
             sequences: list[StepSequence]) -> Iterator[None]:
        """Send the step's plan; the forward pass runs in the `with` block, no heartbeat meanwhile."""
        with self._lock:
            self.send(StepPlan(input_ids.cpu().numpy(), positions.cpu().numpy(), slot_mapping.cpu().numpy(),
                               sequences))
            try:
                yield
            finally:
                self._last_send = time.monotonic()

    def send_moves(self, src_slots: list[int], dst_slots: list[int]) -> None:
        self.send(MoveTokens(list(src_slots), list(dst_slots)))

    def send(self, message: object) -> None:
        with self._lock:
            self.check()
            try:
                dist.broadcast_object_list([message], src=0, group=self.groups.control)
            except RuntimeError as exc:
                raise self.lost(exc) from exc
            self._last_send = time.monotonic()

    def describe(self) -> list[RankStats]:
        """Every rank's RankStats, rank 0's first (the kvserve log prints them at start-up)."""
        with self._lock:
            self.send(Describe())
            gathered: list = [None] * self.world_size
            try:
                dist.gather_object(self.local_stats, gathered, dst=0, group=self.groups.control)
            except RuntimeError as exc:
                raise self.lost(exc) from exc
        return gathered

    def check(self) -> None:
        if self.failure is not None:
            raise FatalEngineError(f"the tensor-parallel group is broken: {self.failure}")

    def lost(self, exc: BaseException) -> FatalEngineError:
        """Record a failed collective; the error to raise."""
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self._fail(message)
        return FatalEngineError(f"the tensor-parallel group is broken: {self.failure or message}")

    def _fail(self, message: str) -> None:
        if self.failure is not None or self._closing.is_set():
            return
        self.failure = message
        logger.error("tensor parallel: %s", message)
        if self.on_failure is not None:
            self.on_failure(message)

    def _heartbeat(self) -> None:
        interval = self.config.timeout_s / 4
        while not self._closed.wait(interval / 2):
            with self._lock:  # (waits for a step in progress, then finds it just sent)
                if self.failure is None and not self._closed.is_set() and \
                        time.monotonic() - self._last_send > interval:
                    try:
                        self.send(Heartbeat())
                    except FatalEngineError:
                        return

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop the workers (a Shutdown message, then a kill for any that linger) and leave the group."""
        if self._closed.is_set() or self._closing.is_set():
            return
        self._closing.set()  # from here on a worker exiting is expected, not a failure
        if self.groups is not None and self.failure is None:
            try:
                self.send(Shutdown())
            except FatalEngineError:
                pass
        self._closed.set()
        self.watchdog.stop()
        # Workers that never joined (start-up failed) cannot be told to stop: kill them at once.
        stop_workers(self.processes, timeout=10.0 if self.failure is None and self.groups is not None else 0.0)
        self._finalizer.detach()
        if self.groups is not None:
            try:
                leave()
            except Exception:  # a broken group may fail to tear down; the process is leaving it anyway
                logger.debug("destroying the process group failed", exc_info=True)


def _abandon(processes: list) -> None:
    """An executor dropped without close(): kill its workers and leave the group."""
    stop_workers(processes, timeout=0.0)
    try:
        leave()
    except Exception:  # at interpreter exit the group may already be gone
        pass
