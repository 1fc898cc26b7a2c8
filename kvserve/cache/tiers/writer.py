"""A background thread that runs the slow half of offloading (disk writes) so the engine step never
waits for I/O. Its queue is bounded: when the disk falls behind, new work is dropped and counted
(a dropped block is only a future cache miss), never allowed to block the step."""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger("kvserve")


class BackgroundWriter:
    def __init__(self, max_queue: int, name: str = "kvserve-kv-writer"):
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_queue)
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue `job`; False (and counted) if the queue is full."""
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            self.num_dropped += 1
            return False

    def drain(self) -> None:
        """Wait until every queued job has run."""
        self._queue.join()

    def close(self) -> None:
        self.drain()
        self._queue.put(None)
        self._thread.join()

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                job()
            except Exception:  # a failed write must not kill the writer
                logger.exception("KV tier writer: a job failed")
            finally:
                self._queue.task_done()
