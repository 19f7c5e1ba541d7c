"""The dashboard with 1,000 servers: folding a poll, the JSON it serves, and the page in Chromium.

    python -m benchmarks.dashboard_scale --servers 1000 --screenshot docs/dashboard-1000.png

The records are ``tests/kit/synthetic_swarm.py``'s (validated as a reader does; the hostile tenth
is dropped), fed to the real ``Dashboard`` as the ``SwarmPolled`` event its poller would make (the
poll's DHT read itself is measured by ``benchmarks/dht_scale.py``). Figures: time and peak
allocation (tracemalloc) of folding one poll into the state, size and time of ``/api/v1/state``,
and, in real headless Chromium (``tests/kit/browser.py``; ``make browser`` installs it) at 1280 px,
the milliseconds from navigation start until the first page of server rows (100 rows; the API
sends one page, ``?page=1&per_page=100``) is in the page (``performance.now()``, measured in the
page) and from a click on "next" until the second page is shown, with a screenshot of the first
screen. ``state_json_kib`` is the whole state (the API without ``page``), ``state_page_json_kib``
what the page fetches every refresh.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import tracemalloc
from pathlib import Path
from typing import Optional

from aiohttp import web

from swarm.dashboard.app import Dashboard, create_app
from swarm.dashboard.events import ModelSnapshot, SwarmPolled
from swarm.dashboard.views import PER_PAGE, Paging, state_view
from tests.kit.synthetic_swarm import MODEL, make_swarm

ROWS = "document.querySelectorAll('table.servers tbody tr[data-peer]').length"


def fold_figures(servers: int, blocks: int, seed: int) -> tuple[Dashboard, dict]:
    records = tuple(make_swarm(servers, blocks, seed=seed).parsed())
    dashboard = Dashboard(None)
    result: dict = {"servers": servers, "blocks": blocks, "records_valid": len(records)}
    for poll in range(2):  # the second poll also updates history and uptime of known servers
        event = SwarmPolled(time.time(), (ModelSnapshot(MODEL, blocks, records),))
        tracemalloc.start()
        began = time.perf_counter()
        dashboard.feed(event)
        took = time.perf_counter() - began
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        result[f"fold_ms_poll{poll + 1}"] = round(took * 1000, 1)
        result[f"fold_peak_mib_poll{poll + 1}"] = round(peak / 2**20, 2)
    began = time.perf_counter()
    body = json.dumps(state_view(dashboard.state, time.time(), 5.0))
    result["state_json_ms"] = round((time.perf_counter() - began) * 1000, 1)
    result["state_json_kib"] = round(len(body) / 1024, 1)
    began = time.perf_counter()  # what the page asks for: one page of server rows
    body = json.dumps(state_view(dashboard.state, time.time(), 5.0, Paging(1, PER_PAGE)))
    result["state_page_json_ms"] = round((time.perf_counter() - began) * 1000, 1)
    result["state_page_json_kib"] = round(len(body) / 1024, 1)
    return dashboard, result


async def page_figures(dashboard: Dashboard, rows: int, screenshot: Optional[Path]) -> dict:
    from tests.kit.browser import Chromium, Page, find_or_install_chromium

    binary, why = find_or_install_chromium()
    if binary is None:
        return {"page": f"no chromium: {why}"}
    runner = web.AppRunner(create_app(dashboard))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        with Chromium(binary) as browser:
            page = await Page.open(browser)
            try:
                await page.call(
                    "Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1, mobile=False
                )
                await page.navigate(f"http://127.0.0.1:{port}/")
                shown_ms = await page.evaluate(
                    "new Promise((done) => { const f = () => " + ROWS + f" >= {rows} ? done(performance.now()) "
                    ": setTimeout(f, 5); f(); })"
                )
                facts = await page.evaluate(
                    "({rows: " + ROWS + ", overflow: document.documentElement.scrollWidth - window.innerWidth, "
                    "height: document.documentElement.scrollHeight})"
                )
                if screenshot is not None:
                    await asyncio.sleep(0.5)
                    await page.screenshot(screenshot, full_page=False)
                # the next page: click, until its first row (another server) is in the table
                next_ms = await page.evaluate(
                    "new Promise((done) => { const b = document.querySelector('.pager button[data-page=\"2\"]');"
                    " if (!b) { done(null); return; } const first = document.querySelector('table.servers "
                    "tbody tr').dataset.peer;"
                    " const t0 = performance.now(); b.click(); const f = () => { const r = document.querySelector("
                    "'table.servers tbody tr'); r && r.dataset.peer !== first ? done(performance.now() - "
                    "t0) : setTimeout(f, 5); }; f(); })"
                )
                errors = list(page.errors)
            finally:
                await page.close()
    finally:
        await runner.cleanup()
    out = {
        "page_rows_ms": round(shown_ms, 1),
        "page_rows": facts["rows"],
        "page_overflow_px": facts["overflow"],
        "page_height_px": facts["height"],
        "page_next_ms": None if next_ms is None else round(next_ms, 1),
        "page_errors": errors,
    }
    if screenshot is not None:
        out["screenshot_kib"] = round(screenshot.stat().st_size / 1024, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=61)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--screenshot", type=Path, help="PNG of the first screen at 1280 px")
    parser.add_argument("--no-page", action="store_true", help="skip Chromium")
    args = parser.parse_args()
    dashboard, result = fold_figures(args.servers, args.blocks, args.seed)
    if not args.no_page:
        rows = min(PER_PAGE, len(dashboard.state.models[MODEL].servers))  # the page shows one page of rows
        result.update(asyncio.run(page_figures(dashboard, rows, args.screenshot)))
    result["load_average"] = round(os.getloadavg()[0], 1)
    from benchmarks.wan import _commit

    result["commit"] = _commit()
    for key, value in result.items():
        print(f"  {key}: {value}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
