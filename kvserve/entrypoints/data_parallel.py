"""`kvserve serve --data-parallel-size N`: N engine replicas, each in its own process with its own
KV pool, behind one HTTP front end.

    clients ──> front end (this process: the router app, kvserve/router, on --host:--port)
                   ├──> replica 0: `kvserve serve` on 127.0.0.1:<private port>
                   └──> replica 1: ...

The replicas are ordinary `kvserve serve` children started with this command's own arguments
(minus the front end's), on private ports, with a random API key only the front end knows, so
nothing reaches them around the front end's --api-key. The front end routes as `kvserve router`
does (--routing-policy) and serves one /metrics with every replica's samples labelled
`replica="i"`. On CPU each replica gets an equal share of the cores (OMP_NUM_THREADS, unless
set); on CUDA with at least N visible devices, one device each. A replica that dies is routed
around (not restarted); once every replica has exited the front end stops with status 1, as a
server whose engine died does (a supervisor restarts it). SIGTERM stops the front end, then the
replicas, each with its grace period.
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import httpx

from kvserve.cli import UserError
from kvserve.engine.parallel.group import CORES_ENV, REPLICAS_ENV
from kvserve.server.cors import CorsOptions

logger = logging.getLogger("kvserve.server")

START_TIMEOUT_S = 600.0
# Front-end options the replicas do not take (each with a value).
_FRONT_ONLY = ("--data-parallel-size", "-dp", "--routing-policy", "--host", "--port", "--api-key",
               "--max-connections", "--timeout-header", "--timeout-body", "--max-body-bytes-in-flight",
               "--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certs", "--ssl-cert-reqs", "--root-path")


def replica_argv(serve_argv: list[str]) -> list[str]:
    """The serve arguments without the front end's own options."""
    out, skip = [], False
    for arg in serve_argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _FRONT_ONLY:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cuda_devices() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def _replica_env(index: int, count: int, devices: list[str], ranks: int = 1, key: str | None = None) -> dict[str, str]:
    """Replica `index` of `count`, each with `ranks` tensor-parallel ranks: its share of the cores
    (split again among its ranks, kvserve/engine/parallel/group.py) and its own `ranks` GPUs. `key`:
    the private API key, as $KVSERVE_API_KEY (a process's environment is readable by its user only,
    its command line by every local user)."""
    env = dict(os.environ)
    env.pop("KVSERVE_API_KEY", None)
    if key is not None:
        env["KVSERVE_API_KEY"] = key
    env.pop("MASTER_PORT", None)  # each replica's ranks meet on a port of their own
    cores = max(1, (os.cpu_count() or 1) // count)
    env.setdefault(CORES_ENV, str(cores))
    env[REPLICAS_ENV] = str(count)  # its share of the RAM for a default KV pool (sizing.default_cpu_budget)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, cores // ranks))
    if len(devices) >= count * ranks:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[index * ranks:(index + 1) * ranks])
    return env


def _die_with_parent() -> None:
    """In the replica, before exec (Linux): SIGTERM when the front end dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wait_ready(processes: list[subprocess.Popen], urls: list[str], key: str) -> None:
    """Until every replica answers /health; a replica that exits first fails the start."""
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(range(len(urls)))
    while pending:
        for i in sorted(pending):
            if processes[i].poll() is not None:
                raise UserError(f"replica {i} exited with status {processes[i].returncode} while starting "
                                "(its error is above)")
            try:
                if httpx.get(f"{urls[i]}/health", timeout=1).status_code == 200:
                    pending.discard(i)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise UserError(f"replicas {sorted(pending)} did not become healthy in {START_TIMEOUT_S:.0f} s")
        if pending:
            time.sleep(0.2)


def _stop(processes: list[subprocess.Popen], grace_s: float) -> None:
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in processes:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _stop_when_all_exited(processes: list[subprocess.Popen], server, interval_s: float = 0.5) -> None:
    """Stop the front end (status 1) once every replica has exited: nothing is left to serve."""
    from kvserve.server.lifecycle import EXIT_ENGINE_DEAD

    while not server.should_exit:
        if all(p.poll() is not None for p in processes):
            logger.error("every replica has exited (statuses %s): the front end stops",
                         ", ".join(str(p.returncode) for p in processes))
            server.stop(EXIT_ENGINE_DEAD)
            return
        time.sleep(interval_s)


def run_data_parallel(args: argparse.Namespace, serve_argv: list[str], sock, uvicorn_config_kwargs: dict,
                      body_limits: tuple[int, int], max_connections: int, cors: CorsOptions | None = None,
                      chat_template: str | None = None) -> int:
    """Start the replicas, then the front end on `sock` (already bound); returns the exit status.
    `cors` and `chat_template` (--chat-template's text) are the front end's, checked by serve."""
    import uvicorn

    from kvserve.model.loader import load_tokenizer, resolve_model_path
    from kvserve.router.app import RouterConfig, build_router_app
    from kvserve.server.lifecycle import ServingServer

    count = args.data_parallel_size
    key = secrets.token_urlsafe(24)
    ports = [_free_port() for _ in range(count)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    child = replica_argv(serve_argv)
    processes = []
    devices = _cuda_devices()
    try:
        for i, port in enumerate(ports):
            command = [sys.executable, "-m", "kvserve.cli", "--log-level", args.log_level, "serve", *child,
                       "--host", "127.0.0.1", "--port", str(port)]
            env = _replica_env(i, count, devices, args.tensor_parallel_size, key)
            processes.append(subprocess.Popen(command, env=env, preexec_fn=_die_with_parent))
        policy = args.routing_policy or "kv_aware"
        model_path = str(resolve_model_path(args.model))
        # Loaded while the replicas load their models, so that kv_aware routes from the first request.
        tokenizer = (load_tokenizer(args.tokenizer or model_path, args.trust_remote_code) if policy == "kv_aware"
                     else None)
        _wait_ready(processes, urls, key)
        logger.info("%d replicas ready on %s", count, ", ".join(urls))
        config = RouterConfig(urls, policy, api_key=args.api_key, backend_api_key=key, tokenizer=model_path,
                              max_request_body_bytes=body_limits[0], max_body_bytes_in_flight=body_limits[1],
                              max_backend_connections=max_connections, startup_wait_s=30.0,
                              cors=cors, chat_template=chat_template,
                              request_id_headers=args.enable_request_id_headers,
                              fastapi_docs=not args.disable_fastapi_docs, root_path=args.root_path)
        app = build_router_app(config, tokenizer)
        # kvserve's server (lifecycle.py): the shutdown grace period, and a return instead of
        # uvicorn's re-raised signal, so the replicas are stopped below.
        server = ServingServer(uvicorn.Config(app, **uvicorn_config_kwargs), args.shutdown_timeout,
                               on_grace_expired=lambda: None)
        threading.Thread(target=_stop_when_all_exited, args=(processes, server), name="kvserve-dp-watch",
                         daemon=True).start()
        server.run(sockets=[sock])
        return server.exit_code
    finally:
        _stop(processes, args.shutdown_timeout + 10)
