"""`GET /dashboard`: a page that watches the KV cache live, and the JSON state it polls.

The page and its assets (kvserve/server/static: the page, its script and style, and uPlot for
the time series, shipped in the package: no CDN, no build step) carry no data and are open
without the API key. `GET /dashboard/state` carries the data and needs the key like every other
data route. Its body (README "Dashboard") is versioned by `version`; it is built from an
`EngineState` the engine thread copies between two steps when asked (engine_loop.AsyncEngine.
fresh_state), so a client polling it costs the engine one snapshot per poll, never per step.
"""
from __future__ import annotations

import base64
import time
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from kvserve.cache.pool_snapshot import BlockState
from kvserve.engine.state_view import RequestView
from kvserve.server.engine_loop import AsyncEngine, EngineDeadError, StateSnapshot
from kvserve.server.errors import error_body

STATE_VERSION = 1
# Wait this long for a snapshot taken after the request arrived; past it a step is running
# long (a big prefill) and the latest snapshot is answered, with its age.
FRESH_WAIT_S = 0.25
FIRST_WAIT_S = 30.0  # no snapshot at all yet: wait for the first one this long

ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}
PAGE_PATH = "/dashboard"
STATE_PATH = "/dashboard/state"
# Open without the API key (auth.OPEN_PATHS): the page and its static assets, never the state.
OPEN_DASHBOARD_PATHS = frozenset({PAGE_PATH, *(f"{PAGE_PATH}/{name}".lower() for name in ASSETS)})


def _static(name: str) -> bytes:
    return resources.files("kvserve.server").joinpath("static", name).read_bytes()


def _request_json(r: RequestView, kv_dtype: str) -> dict:
    return {"id": r.request_id, "status": r.status, "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens, "cached_tokens": r.cached_tokens, "kv_tokens": r.kv_tokens,
            "num_blocks": len(r.block_ids), "shared_blocks": r.shared_blocks, "blocks": r.block_ids,
            "kv_cache_dtype": kv_dtype, "eviction": r.eviction, "evicted_tokens": r.evicted_tokens,
            "preemptions": r.preemptions}


def state_json(snap: StateSnapshot, engine: AsyncEngine, model: str) -> dict:
    """The versioned body of GET /dashboard/state (README "Dashboard")."""
    now = time.monotonic()
    state, pool = snap.engine, snap.engine.pool
    running_since = engine.step_started_at
    counts = pool.counts()
    return {
        "version": STATE_VERSION,
        "model": model,
        "step": state.step,
        "age_s": round(now - snap.taken_at, 4),
        # Taken with the snapshot, not derived from `now`: recomputed per answer, the same snapshot
        # jittered by this function's own run time, and a later answer could read as older.
        "time": round(snap.taken_at_wall, 4),
        "engine": {"steps_completed": engine.steps_completed,
                   "step_running_s": None if running_since is None else round(now - running_since, 4),
                   "snapshot_s": round(snap.cost_s, 6)},
        "block_size": state.block_size,
        "kv_cache_dtype": state.kv_cache_dtype,
        "pool": {
            "num_blocks": pool.num_blocks,
            "first_block_id": pool.first_block_id,
            "counts": {s.name.lower(): counts[s] for s in BlockState},
            "states": base64.b64encode(pool.states.tobytes()).decode(),
            "ref_counts": base64.b64encode(pool.ref_counts.astype("<u2").tobytes()).decode(),
        },
        "requests": [_request_json(r, state.kv_cache_dtype) for r in (*state.running, *state.waiting)],
        "totals": {"prompt_tokens": snap.prompt_tokens, "generation_tokens": snap.generation_tokens,
                   "preemptions": state.num_preemptions, "prefix_cache_queries": state.prefix_queries,
                   "prefix_cache_hits": state.prefix_hits},
        "kv_offload_tiers": state.tiers,
    }


def add_dashboard(app: FastAPI, engine: AsyncEngine, model: str) -> None:
    page = _static("dashboard.html")

    @app.get(PAGE_PATH, include_in_schema=False)
    async def dashboard_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    for name, media_type in ASSETS.items():
        body = _static(name)

        async def asset(body: bytes = body, media_type: str = media_type) -> Response:
            return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})

        app.add_api_route(f"{PAGE_PATH}/{name}", asset, methods=["GET"], include_in_schema=False)

    @app.get(STATE_PATH)
    async def dashboard_state() -> Response:
        """The engine's KV pool and requests between two steps (README "Dashboard")."""
        try:
            snap = await engine.fresh_state(FRESH_WAIT_S)
            if snap is None:
                snap = await engine.fresh_state(FIRST_WAIT_S)
        except EngineDeadError:
            snap = None
        if snap is None or not engine.healthy:
            return JSONResponse(error_body(503, "The engine has stopped." if not engine.healthy
                                           else "The engine is busy; no state yet."), status_code=503)
        return JSONResponse(state_json(snap, engine, model), headers={"Cache-Control": "no-store"})
