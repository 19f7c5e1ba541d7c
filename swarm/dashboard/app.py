"""The dashboard service: a background refresh loop folding events, and the aiohttp app.

Routes: ``/`` (the page, from ``static/``), ``/api/v1/state``, ``/api/v1/models/{name}``,
``/metrics``. Handlers only read ``Dashboard.state``, which the refresh loop replaces whole
after each event, so a request always sees one consistent state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from swarm.dashboard import metrics
from swarm.dashboard.events import Event, SwarmPolled
from swarm.dashboard.poller import SwarmReader
from swarm.dashboard.state import Limits, State, apply
from swarm.dashboard.views import PER_PAGE, Paging, model_view, state_view

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"


@dataclass(frozen=True)
class DashboardConfig:
    refresh_seconds: float = 5.0
    probe_seconds: float = 30.0  # how often to ping every server (reachability, RTT)
    limits: Limits = field(default_factory=Limits)


class Dashboard:
    """Owns the state. ``feed`` applies one event; ``run`` keeps polling ``reader``."""

    def __init__(self, reader: Optional[SwarmReader], config: DashboardConfig = DashboardConfig()):
        self.reader, self.config = reader, config
        self.state = State(limits=config.limits)
        self._last_probe = float("-inf")

    def feed(self, event: Event) -> None:
        self.state = apply(self.state, event)

    async def refresh(self) -> None:
        """One poll of the DHT, then (when due) a probe of every server that claims to be up."""
        event = await asyncio.to_thread(self.reader.poll)
        self.feed(event)
        if not isinstance(event, SwarmPolled) or time.monotonic() - self._last_probe < self.config.probe_seconds:
            return
        self._last_probe = time.monotonic()
        for snapshot in event.models:
            for probed in await asyncio.to_thread(self.reader.probe, snapshot.name, snapshot.servers):
                self.feed(probed)

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # the reader turns DHT faults into events; this is a bug, keep serving
                logger.exception("Dashboard refresh failed")
            await asyncio.sleep(self.config.refresh_seconds)


DASHBOARD: "web.AppKey[Dashboard]" = web.AppKey("dashboard")
METRICS = web.AppKey("metrics", object)  # the prometheus_client CollectorRegistry of the state


def create_app(dashboard: Dashboard) -> web.Application:
    app = web.Application(middlewares=[_errors_as_json])
    app[DASHBOARD] = dashboard
    app[METRICS] = metrics.make_registry(lambda: dashboard.state)
    app.router.add_get("/", _index)
    app.router.add_get("/api/v1/state", _api_state)
    app.router.add_get("/api/v1/models/{name}", _api_model)
    app.router.add_get("/metrics", _metrics)
    app.router.add_static("/static/", STATIC_DIR)
    return app


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def _api_state(request: web.Request) -> web.Response:
    dashboard: Dashboard = request.app[DASHBOARD]
    paging = _paging(request)
    return web.json_response(state_view(dashboard.state, time.time(), dashboard.config.refresh_seconds, paging))


async def _api_model(request: web.Request) -> web.Response:
    state = request.app[DASHBOARD].state
    name = request.match_info["name"]
    paging = _paging(request)
    model = state.models.get(name)
    if model is None:
        known = ", ".join(state.models) or "none yet"
        return web.json_response({"error": f"no model named {name!r} in the swarm (known: {known})"}, status=404)
    return web.json_response(model_view(model, state, time.time(), paging))


def _paging(request: web.Request) -> Optional[Paging]:
    """``?page=N[&per_page=M]``: one page of server rows per model (none given: every row)."""
    query = request.rel_url.query
    if "page" not in query and "per_page" not in query:
        return None
    try:
        return Paging(int(query.get("page", "1")), int(query.get("per_page", str(PER_PAGE))))
    except ValueError as e:
        message = str(e) if "must be" in str(e) else f"page and per_page must be whole numbers, got {dict(query)}"
        raise web.HTTPBadRequest(text=json.dumps({"error": message}), content_type="application/json") from e


async def _metrics(request: web.Request) -> web.Response:
    body = metrics.render(request.app[METRICS])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def _errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    """A bug in a handler answers a one-line JSON error, never a traceback."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as e:
        logger.exception(f"Error serving {request.path}")
        return web.json_response({"error": f"internal error: {type(e).__name__}"}, status=500)
