"""`kvserve serve MODEL --port 0` for many models at once, for tests/test_reliability_model_files.py:
`python tests/serve_cases.py LIMIT_BYTES MODEL...` imports kvserve (and torch) once, then runs each
model in a child process forked from that state (two at a time), with the address space limited to
LIMIT_BYTES and its stderr to a file of its own, and prints {model: [exit status, stderr]} as JSON.
One interpreter start instead of one per model; each case still gets a process of its own. A child
that runs past TIMEOUT_S (a server that started after all) is killed and reported as status -9."""
from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import time
import traceback

import kvserve.entrypoints.serve  # noqa: F401  (what `serve` imports, loaded before the forks)
from kvserve.cli import main

TIMEOUT_S = 300


def child(model: str, limit: int, stderr_path: str) -> None:
    """In the forked child: run the command, leave with its status."""
    status = 1
    try:
        with open(stderr_path, "wb") as err, open(os.devnull, "wb") as out:
            os.dup2(err.fileno(), 2)
            os.dup2(out.fileno(), 1)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        status = main(["serve", model, "--port", "0"])
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status if isinstance(status, int) else 1)


def run(models: list[str], limit: int, parallel: int = 2) -> dict[str, list]:
    results: dict[str, list] = {}
    running: dict[int, tuple[str, str, float]] = {}  # pid -> (model, stderr file, deadline)
    pending = list(models)
    with tempfile.TemporaryDirectory() as scratch:
        while pending or running:
            while pending and len(running) < parallel:
                model = pending.pop(0)
                stderr_path = os.path.join(scratch, f"{len(results) + len(running)}-{os.getpid()}.err")
                pid = os.fork()
                if pid == 0:
                    child(model, limit, stderr_path)
                running[pid] = (model, stderr_path, time.monotonic() + TIMEOUT_S)
            for pid, (model, stderr_path, deadline) in list(running.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if not done and time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    done, status = os.waitpid(pid, 0)
                if done:
                    del running[pid]
                    with open(stderr_path, errors="replace") as err:
                        results[model] = [os.waitstatus_to_exitcode(status), err.read()]
            time.sleep(0.05)
    return results


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[2:], int(sys.argv[1]))))
