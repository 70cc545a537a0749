"""Runs in the ComfyUI web app for the browser tests beyond test_comfy_browser's own: a base directory with
the pack installed by `loraweave comfy install`, a fresh DevTools page, and queueing as the Run button does
(helpers/comfy_page: opening the app, waiting for /history)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import save_file

from .browser import Page
from .comfy_env import COMFYUI_DIR
from .comfy_models import flux_state_dict
from .comfy_pack import FLUX_FILE, write_loras
from .comfy_page import COUNT_LOADS, wait_history


def base_directory(base: Path) -> None:
    """models (the tiny Flux, the node tests' LoRA files), user settings (no first-run tour, no workflow
    restored on reload), and the pack by `loraweave comfy install --base-directory`."""
    write_loras(base / "models" / "loras")
    (base / "models" / "diffusion_models").mkdir(parents=True)
    save_file(flux_state_dict(), base / "models" / "diffusion_models" / FLUX_FILE)
    settings = base / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True)
    # no workflow restored on a page (re)load: the frontend would restore the last open tab after the app
    # exists, over the workflow the test loads (seen: the Nodes 2.0 run showing strength 0.7)
    settings.write_text(json.dumps({"Comfy.TutorialCompleted": True, "Comfy.Workflow.Persist": False}))
    install_shim(base)


def install_shim(base: Path) -> Path:
    """`loraweave comfy install --base-directory base` run as users run it; the shim's folder."""
    base.mkdir(parents=True, exist_ok=True)
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
    return base / "custom_nodes" / "loraweave_nodes"


async def prepare(page: Page, size: tuple[int, int]) -> None:
    """A fresh DevTools page: events on, the load counter installed, the window size set."""
    await page.send("Runtime.enable")
    await page.send("Page.enable")  # without it, Chromium runs no script on new documents
    await page.send("Page.addScriptToEvaluateOnNewDocument", source=COUNT_LOADS)
    await page.send("Emulation.setDeviceMetricsOverride", width=size[0], height=size[1],
                    deviceScaleFactor=1, mobile=False)  # fmt: skip


async def queue(page: Page, url: str) -> tuple[dict, dict]:
    """Queue the open graph as the Run button does; (the prompt the server got, its /history entry)."""
    await page.evaluate("window.__loraweaveQueued.length = 0; app.queuePrompt(0).then(() => true)")
    (queued,) = await page.wait_for(
        "window.__loraweaveQueued.length && window.__loraweaveQueued", 30, "queue"
    )
    assert not queued["answer"].get("node_errors"), queued["answer"]
    entry = await asyncio.to_thread(wait_history, url, queued["answer"]["prompt_id"])
    return queued["prompt"], entry
