"""The ComfyUI web app in headless Chromium, for the browser tests: a base directory with the pack installed
by `loraweave comfy install`, opening the app once its own startup workflow has loaded, queueing as the Run
button does, and waiting for the run's /history entry. (test_comfy_browser.py holds its own copies of these
steps.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import save_file

from .browser import Page
from .comfy_env import COMFYUI_DIR
from .comfy_models import flux_state_dict
from .comfy_pack import FLUX_FILE, write_loras
from .comfy_server import get_json

# Run in every new document before the page's scripts: count the app's loadGraphData calls started and
# settled; with Comfy.Workflow.Persist off the startup makes exactly one (the default workflow), and a graph a
# test loads before it settled would be replaced by it.
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


def base_directory(base: Path) -> None:
    """models (the tiny Flux, the node tests' LoRA files), user settings (no first-run tour, no workflow
    restored on reload), and the pack by `loraweave comfy install --base-directory`."""
    write_loras(base / "models" / "loras")
    (base / "models" / "diffusion_models").mkdir(parents=True)
    save_file(flux_state_dict(), base / "models" / "diffusion_models" / FLUX_FILE)
    settings = base / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps({"Comfy.TutorialCompleted": True, "Comfy.Workflow.Persist": False}))
    cli = [
        sys.executable,
        "-m",
        "loraweave",
        "comfy",
        "install",
        str(COMFYUI_DIR),
        "--base-directory",
        str(base),
    ]
    subprocess.run(cli, check=True, capture_output=True)


async def prepare(page: Page, size: tuple[int, int]) -> None:
    """A fresh DevTools page: events on, the load counter installed, the window size set."""
    await page.send("Runtime.enable")
    await page.send("Page.enable")  # without it, Chromium runs no script on new documents
    await page.send("Page.addScriptToEvaluateOnNewDocument", source=COUNT_LOADS)
    await page.send("Emulation.setDeviceMetricsOverride", width=size[0], height=size[1],
                    deviceScaleFactor=1, mobile=False)  # fmt: skip


async def open_app(page: Page, url: str) -> None:
    """Navigate to the app and wait for its startup workflow and websocket; queued prompts are kept in
    window.__loraweaveQueued with the server's answer."""
    await page.evaluate("window.__loraweaveOldPage = true")  # gone once the new document runs
    await page.send("Page.navigate", url=url)
    await page.wait_for(f"!window.__loraweaveOldPage && {STARTUP_LOADED}", 60, "the app's startup workflow")
    await page.wait_for("!!(app.api?.clientId && app.api.socket?.readyState === 1)", 30, "the websocket")
    await page.evaluate(
        "(() => { const send = app.api.queuePrompt.bind(app.api); window.__loraweaveQueued = []; "
        "app.api.queuePrompt = async (...args) => { const answer = await send(...args); "
        "window.__loraweaveQueued.push({answer, prompt: args[1].output}); return answer; }; return true; })()"
    )


async def queue(page: Page, url: str) -> tuple[dict, dict]:
    """Queue the open graph as the Run button does; (the prompt the server got, its /history entry)."""
    await page.evaluate("window.__loraweaveQueued.length = 0; app.queuePrompt(0).then(() => true)")
    (queued,) = await page.wait_for(
        "window.__loraweaveQueued.length && window.__loraweaveQueued", 30, "queue"
    )
    assert not queued["answer"].get("node_errors"), queued["answer"]
    entry = await asyncio.to_thread(wait_history, url, queued["answer"]["prompt_id"])
    return queued["prompt"], entry


def wait_history(url: str, prompt_id: str, timeout: float = 60.0) -> dict:
    """The /history entry of `prompt_id` once its run finished."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = get_json(f"{url}/history/{prompt_id}").get(prompt_id)
        if entry and entry.get("status", {}).get("completed"):
            return entry
        time.sleep(0.5)
    raise TimeoutError(f"the queued run {prompt_id} did not complete within {timeout} s")
