"""The ComfyUI web app in a browser page (helpers/browser.Page), for the browser test: (re)open the app (the
frontend the tree pins) and wait until its own startup workflow has loaded and its websocket is open, keep
what the queue button sends, wait for a run's /history entry, and save the evidence of a failure."""

from __future__ import annotations

import asyncio
import time

from .browser import Page
from .comfy_server import get_json


def wait_history(url: str, prompt_id: str, timeout: float = 60.0) -> dict:
    """The /history entry of `prompt_id` once its run finished (completed, or failed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = get_json(f"{url}/history/{prompt_id}").get(prompt_id)
        status = (entry or {}).get("status", {})
        if status.get("completed") or status.get("status_str") == "error":
            return entry
        time.sleep(0.5)
    raise TimeoutError(f"the queued run {prompt_id} did not complete within {timeout} s")


# Run in every new document before the page's scripts: when the frontend publishes its app (`window.app =
# app`, right after app.setup and before it loads its startup workflow), wrap app.loadGraphData to count the
# loads started and settled. With Comfy.Workflow.Persist off, the startup makes exactly one load (the default
# workflow); a graph the test loads before that one settled would be replaced by it.
COUNT_LOADS = """(() => {
  let app;
  window.__loraweaveLoads = {started: 0, settled: 0};
  Object.defineProperty(window, 'app', {configurable: true, get: () => app, set: (value) => {
    app = value;
    const load = value.loadGraphData.bind(value);
    value.loadGraphData = async (...args) => {
      window.__loraweaveLoads.started++;
      try { return await load(...args); } finally { window.__loraweaveLoads.settled++; }
    };
  }});
})()"""
STARTUP_LOADED = (
    "!!(window.app && app.graph && window.LiteGraph) && __loraweaveLoads.settled >= 1"
    " && __loraweaveLoads.started === __loraweaveLoads.settled"
)


async def open_app(page: Page, url: str) -> None:
    # a mark on the old document: until it is gone, an evaluate may still reach the page being left
    await page.evaluate("window.__loraweaveOldPage = true")
    await page.send("Page.navigate", url=url)
    await page.wait_for(f"!window.__loraweaveOldPage && {STARTUP_LOADED}", 60, "the app's startup workflow")
    # the page runs the frontend the server's tree pins (helpers/comfy_server.frontend_root), not another
    required = get_json(f"{url}/system_stats")["system"]["required_frontend_version"]
    running = await page.wait_for("window.__COMFYUI_FRONTEND_VERSION__", 20, "the frontend's version")
    assert running == required, f"the page runs frontend {running}, the tree pins {required}"
    # queued before the app's websocket is open, the run's messages would go to no client
    await page.wait_for(
        "!!(app.api?.clientId && app.api.socket?.readyState === 1)", 30, "the app's websocket"
    )
    # the queue button's path, with the server's answer (prompt_id, node_errors) kept for the test
    await page.evaluate(
        "(() => { const send = app.api.queuePrompt.bind(app.api); window.__loraweaveQueued = []; "
        "app.api.queuePrompt = async (...args) => { const answer = await send(...args); "
        "window.__loraweaveQueued.push({answer, prompt: args[1].output}); return answer; }; return true; })()"
    )


async def evidence(page: Page, path) -> None:
    """On a failure: a screenshot and the page's console beside the screenshots, so the cause can be read."""
    try:
        await asyncio.wait_for(page.screenshot(path), 20)
    except Exception as exc:  # noqa: BLE001  (the page may be gone: the console still helps)
        page.console.append(f"no failure screenshot: {exc!r}")
    path.with_suffix(".console.txt").write_text("\n".join(page.console))
