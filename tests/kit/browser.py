"""A real headless Chromium for page tests, driven over the DevTools protocol (no Selenium, no
browser download): Debian's ``chromium``, installed by ``.ci/install-chromium.sh`` when missing.

``Chromium`` is a context manager around the browser process; ``await Page.open(browser)``
attaches to its first tab over a websocket and records every console error and uncaught
exception the page produces (``page.errors``), from before the first navigation on.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import aiohttp

REPO = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO / ".ci" / "install-chromium.sh"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--mute-audio",
    "--hide-scrollbars",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--window-size=1280,900",
]


def find_or_install_chromium() -> tuple[Optional[str], str]:
    """The chromium binary, installing Debian's package first if needed; else (None, why not)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found, ""
    try:
        done = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{INSTALL_SCRIPT.name} did not finish: {e}"
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found, ""
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return None, f"{INSTALL_SCRIPT.name} exited with {done.returncode}: {' | '.join(tail)}"


class Chromium:
    def __init__(self, binary: str, log_path: Optional[Path] = None):
        self.binary, self.log_path = binary, log_path
        self.process: Optional[subprocess.Popen] = None
        self.port = 0

    def __enter__(self) -> "Chromium":
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-profile-", ignore_cleanup_errors=True)
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        args = [self.binary, *FLAGS, f"--user-data-dir={self._profile.name}", "about:blank"]
        self.process = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        self.port = self._wait_for_port(Path(self._profile.name) / "DevToolsActivePort")
        return self

    def _wait_for_port(self, path: Path, timeout: float = 60.0) -> int:
        """Chromium writes the port it chose into the profile once DevTools listens."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with code {self.process.returncode} at start-up")
            lines = path.read_text().splitlines() if path.exists() else []
            if lines and lines[0].strip().isdigit():
                return int(lines[0])
            time.sleep(0.1)
        raise TimeoutError("chromium did not open its DevTools port")

    def __exit__(self, *exc) -> None:
        """Stop the browser and its helper processes (its own process group), then its profile."""
        if self.process is not None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self._signal_group(signal.SIGKILL)  # renderers that outlived the browser
            self.process.wait()
        self._profile.cleanup()

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)


class Page:
    """One tab. ``call`` sends a DevTools command and returns its result."""

    def __init__(self, session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse):
        self.session, self.ws = session, ws
        self.errors: list[str] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._load = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, browser: Chromium) -> "Page":
        session = aiohttp.ClientSession()
        async with session.get(f"http://127.0.0.1:{browser.port}/json/list") as response:
            targets = await response.json(content_type=None)
        target = next(t for t in targets if t["type"] == "page")
        ws = await session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        page = cls(session, ws)
        for domain in ("Runtime", "Log", "Page"):
            await page.call(f"{domain}.enable")
        return page

    async def call(self, method: str, **params: Any) -> dict:
        message_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[message_id] = future
        await self.ws.send_str(json.dumps({"id": message_id, "method": method, "params": params}))
        return await asyncio.wait_for(future, 60)

    async def navigate(self, url: str) -> None:
        self._load.clear()
        await self.call("Page.navigate", url=url)
        await asyncio.wait_for(self._load.wait(), 60)

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression!r} raised in the page: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll a JS expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(0.25)
        raise TimeoutError(f"the page never satisfied {expression!r}")

    async def screenshot(self, path: Path, full_page: bool = True) -> None:
        result = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=full_page)
        path.write_bytes(base64.b64decode(result["data"]))

    async def close(self) -> None:
        self._reader.cancel()
        await self.ws.close()
        await self.session.close()

    async def _read(self) -> None:
        async for message in self.ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    if "error" in data:
                        future.set_exception(RuntimeError(f"DevTools error: {data['error']}"))
                    else:
                        future.set_result(data.get("result", {}))
            else:
                self._on_event(data.get("method", ""), data.get("params", {}))

    def _on_event(self, method: str, params: dict) -> None:
        if method == "Page.loadEventFired":
            self._load.set()
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append(f"uncaught: {details.get('exception', {}).get('description') or details.get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.errors.append(f"console.{params['type']}: {args}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())
