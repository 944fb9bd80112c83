"""The dashboard's HTTP server (aiohttp, on a thread and event loop of its own): the page, its JSON and /metrics.

    GET /            the page (coordinator/http/dashboard/index.html), which polls /api/state every second
    GET /api/state   the run, its rounds, its peers and the charts as SVG (coordinator.http.snapshot)
    GET /metrics     Prometheus text format (coordinator.http.metrics)

What it serves is read from the store (a read-only connection of its own), at most once per
``SNAPSHOT_TTL_S`` however many pages and scrapers ask, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from aiohttp import web

from coordinator.http.charts import run_charts
from coordinator.http.metrics import metrics_text

logger = logging.getLogger(__name__)

PAGE = Path(__file__).parent / "dashboard" / "index.html"
DASHBOARD_URL_FILE = "dashboard-url"
SNAPSHOT_TTL_S = 0.5
START_TIMEOUT_S = 10.0


class DashboardServer:
    """Serves ``snapshot()`` (a JSON-ready dict, see coordinator.http.snapshot) as the page, its data and /metrics."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._snapshot = snapshot
        self._host = host
        self._port = port
        self._cache: Optional[tuple[float, dict[str, Any]]] = None  # (monotonic time, state); loop thread only
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._runner: Optional[web.AppRunner] = None
        self._thread: Optional[threading.Thread] = None
        self.url: Optional[str] = None

    def start(self) -> str:
        """Listen (port 0: any free one) and return the page's URL."""
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._listen())
            except BaseException as e:  # reported to start() below
                failure.append(e)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())  # type: ignore[union-attr]
            loop.close()

        self._thread = threading.Thread(target=run, name="dashboard-http", daemon=True)
        self._thread.start()
        if not started.wait(START_TIMEOUT_S):
            raise OSError("the dashboard's HTTP server did not start; see the log.")
        if failure:
            raise OSError(
                f"cannot serve the dashboard on {self._host}:{self._port} ({failure[0]}); choose another --http-port."
            )
        return self.url  # type: ignore[return-value]

    async def _listen(self) -> None:
        app = web.Application()
        app.router.add_get("/", self._page)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}/"

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._loop = self._thread = None

    async def _current(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._cache is None or now - self._cache[0] >= SNAPSHOT_TTL_S:
            state = await asyncio.get_running_loop().run_in_executor(None, self._snapshot_with_charts)
            self._cache = (time.monotonic(), state)
        return self._cache[1]

    def _snapshot_with_charts(self) -> dict[str, Any]:
        state = self._snapshot()
        state["charts"] = run_charts(state["rounds"])
        return state

    async def _page(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=PAGE.read_bytes(), content_type="text/html", charset="utf-8", headers={"Cache-Control": "no-store"}
        )

    async def _state(self, _request: web.Request) -> web.Response:
        try:
            state = await self._current()
        except Exception as e:
            logger.exception("the dashboard could not read the run")
            return web.json_response({"error": f"cannot read the run ({type(e).__name__}); see the log."}, status=503)
        return web.Response(
            text=json.dumps(state, allow_nan=False),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    async def _metrics(self, _request: web.Request) -> web.Response:
        try:
            state = await self._current()
        except Exception as e:
            logger.exception("the dashboard could not read the run")
            return web.Response(text=f"# cannot read the run ({type(e).__name__})\n", status=503)
        return web.Response(body=metrics_text(state), headers={"Content-Type": METRICS_CONTENT_TYPE})


METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def write_dashboard_url(state_dir: Path, url: str) -> None:
    (state_dir / DASHBOARD_URL_FILE).write_text(f"{url}\n")
