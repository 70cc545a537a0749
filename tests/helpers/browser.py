"""Debian's headless Chromium driven over the DevTools protocol (a websocket from aiohttp, which ComfyUI
already needs): no browser download, no playwright."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp

from .comfy_server import get_json, stop

CHROMIUM = "/usr/bin/chromium"
WINDOW = (1600, 1000)


def start_chromium(profile: Path, timeout: float = 30.0) -> tuple[subprocess.Popen, str]:
    """(process, websocket URL of its first page); the DevTools port is the one Chromium picks and writes
    down."""
    assert shutil.which(CHROMIUM), f"missing {CHROMIUM} (Debian package chromium)"
    args = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={profile}",
            f"--window-size={WINDOW[0]},{WINDOW[1]}", "about:blank"]  # fmt: skip
    process = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_file.is_file() and port_file.read_text().strip():
            port = port_file.read_text().split()[0]
            pages = [t for t in get_json(f"http://127.0.0.1:{port}/json/list") if t["type"] == "page"]
            if pages:
                return process, pages[0]["webSocketDebuggerUrl"]
        time.sleep(0.2)
    stop(process)
    raise TimeoutError(f"Chromium did not open its DevTools port within {timeout} s")


class Page:
    """One page's DevTools session: `send` a command, `evaluate` JavaScript (promises awaited)."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self.socket = socket
        self.ids = itertools.count(1)
        self.console: list[str] = []

    async def send(self, method: str, **params) -> dict:
        call_id = next(self.ids)
        await self.socket.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads((await self.socket.receive()).data)
            if message.get("method") == "Runtime.consoleAPICalled":
                self.console.append(" ".join(str(a.get("value", "")) for a in message["params"]["args"]))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    async def evaluate(self, expression: str):
        result = await self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {json.dumps(result['exceptionDetails'])[:2000]}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 30.0, what: str = ""):
        """The first truthy value of `expression`, polled."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(0.25)
        raise TimeoutError(f"waited {timeout} s for {what or expression}")

    async def screenshot(self, path: Path) -> Path:
        shot = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))
        return path
