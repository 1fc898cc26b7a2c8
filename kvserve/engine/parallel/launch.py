"""Starting this node's worker processes and watching them.

Workers are started with multiprocessing's spawn method (a fresh interpreter: no forked torch
thread pools, CUDA-safe). They ignore Ctrl-C and SIGTERM (a terminal or a service manager sends
them to every process of the group; rank 0 stops them in order, once its requests in flight are
done) and exit when their parent does.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from kvserve.engine.args import EngineArgs
from kvserve.engine.parallel.group import DistributedConfig

logger = logging.getLogger("kvserve")


def spawn_workers(args: EngineArgs, config: DistributedConfig, ranks: list[int]) -> list[BaseProcess]:
    from kvserve.engine.parallel.worker import worker_main

    context = multiprocessing.get_context("spawn")
    processes = []
    for rank in ranks:
        # The spawner's pid goes along: the child's imports take seconds, and a parent gone by then
        # would leave it reading init's pid as its parent's (worker._exit_with_parent).
        process = context.Process(target=worker_main, args=(rank, config, args, logger.getEffectiveLevel()),
                                  kwargs={"parent_pid": os.getpid()}, name=f"kvserve-tp-rank{rank}", daemon=True)
        process.start()
        processes.append(process)
    return processes


def stop_workers(processes: list[BaseProcess], timeout: float = 10.0) -> None:
    """Wait for the workers to exit (after a Shutdown message), then kill the ones that do not."""
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)


class Watchdog:
    """A thread that calls `on_death(message)` once when one of `processes` exits on its own."""

    def __init__(self, processes: list[BaseProcess], on_death: Callable[[str], None], interval_s: float = 0.2):
        self.processes = processes
        self.on_death = on_death
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-tp-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for process in self.processes:
                if not process.is_alive() and not self._stop.is_set():
                    self.on_death(f"tensor-parallel worker {process.name} exited with code {process.exitcode}")
                    return
