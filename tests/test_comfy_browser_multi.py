"""LoraWeave Multi Loader in a real browser: ComfyUI's main.py --cpu (v0.19.3 with comfyui-frontend-package
1.42.11, or the newest tree with 1.49.6) and Debian's headless Chromium, under the classic canvas and under
Nodes 2.0 (row 1 at another strength there, so the server runs the node again). The page builds Load Diffusion
Model -> Multi Loader -> Preview as Text, sets row 1, grows the node to 3 rows (row 1 keeps its settings: the
frontend rebuilds a dynamic combo's widgets with their defaults, web/multi_loader.js gives them back), turns
row 2 off and runs it; then the workflow is saved and loaded back: the same widgets, the same prompt. The
screenshots' paths are printed."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from helpers.browser import WINDOW, Page, start_chromium
from helpers.comfy_env import COMFYUI_DIR
from helpers.comfy_page import evidence, open_app
from helpers.comfy_page_runs import base_directory, prepare, queue
from helpers.comfy_server import start_server, stop

# Builds the graph; returns the Multi Loader's id and its widgets as [name, value] once grown to 3 rows
BUILD = """(() => {
  const g = app.graph; g.clear();
  const unet = LiteGraph.createNode('UNETLoader'); unet.pos = [20, 60]; g.add(unet);
  unet.widgets[0].value = 'tiny_flux.safetensors';
  const node = LiteGraph.createNode('LoraWeaveMultiLoader'); node.pos = [380, 60]; g.add(node);
  unet.connect(0, node, 0);
  const preview = LiteGraph.createNode('PreviewAny'); preview.pos = [900, 60]; g.add(preview);
  node.connect(2, preview, 0);
  const set = (name, value) => { node.widgets.find(w => w.name === name).value = value; };
  set('loras.lora_1', 'flux.safetensors'); set('loras.strength_model_1', STRENGTH);
  set('loras', '3');
  set('loras.lora_2', 'partial.safetensors'); set('loras.on_2', false);
  g.setDirtyCanvas(true, true);
  return {id: node.id, widgets: node.widgets.map(w => [w.name, w.value])};
})()"""
WIDGETS = "app.graph.getNodeById({id}).widgets.map(w => [w.name, w.value])"


STRENGTHS = {"classic": 0.7, "nodes2": 0.5}


async def _renderer(page: Page, url: str, shot, strength: float) -> dict:
    built = await page.evaluate(BUILD.replace("STRENGTH", repr(strength)))
    prompt, entry = await queue(page, url)
    saved = await page.evaluate("JSON.stringify(app.graph.serialize())")
    await page.evaluate(f"app.loadGraphData({saved}).then(() => true)")
    reloaded = await page.wait_for(WIDGETS.format(id=built["id"]), 20, "the reloaded Multi Loader")
    prompt_again, _ = await queue(page, url)
    await asyncio.sleep(1.0)
    await page.screenshot(shot)
    node = str(built["id"])
    return {"built": built["widgets"], "prompt": prompt[node], "entry": entry, "node": node,
            "reloaded": reloaded, "prompt_again": prompt_again[node]}  # fmt: skip


async def _drive(ws_url: str, url: str, shots: dict) -> dict:
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as socket:
        page = Page(socket)
        await prepare(page, WINDOW)
        try:
            await open_app(page, url)
            classic = await _renderer(page, url, shots["classic"], STRENGTHS["classic"])
            await page.evaluate(
                "app.extensionManager.setting.set('Comfy.VueNodes.Enabled', true).then(() => 1)"
            )
            await open_app(page, url)
            nodes2 = await _renderer(page, url, shots["nodes2"], STRENGTHS["nodes2"])
            return {"classic": classic, "nodes2": nodes2}
        except Exception:
            await evidence(page, shots["classic"].with_name("failure.png"))
            raise


def test_multi_loader_rows_in_a_real_browser(tmp_path):
    base = tmp_path / "comfy_base"
    base_directory(base)
    server, url = start_server(COMFYUI_DIR, base, tmp_path / "server.log")
    chromium = None
    shots = {name: tmp_path / f"multi_loader_{name}.png" for name in ("classic", "nodes2")}
    try:
        chromium, ws_url = start_chromium(tmp_path / "profile")
        seen = asyncio.run(_drive(ws_url, url, shots))
        print(f"screenshots: {shots['classic']} {shots['nodes2']}")
    finally:
        for process in (chromium, server):
            if process is not None:
                stop(process)
    for renderer, got in seen.items():
        widgets = dict(got["built"])
        # grown from 1 to 3 rows, row 1 keeps what was set before
        kept = (widgets["loras.lora_1"], widgets["loras.strength_model_1"])
        assert kept == ("flux.safetensors", STRENGTHS[renderer]), (
            renderer,
            got["built"],
        )
        assert [name for name, _ in got["built"]][:2] == ["loras", "loras.on_1"]
        sent = got["prompt"]["inputs"]
        assert sent["loras"] == "3" and sent["loras.on_2"] is False and sent["loras.lora_3"] == "None", sent
        assert got["entry"]["status"]["status_str"] == "success", (renderer, got["entry"]["status"])
        report = got["entry"]["outputs"][got["node"]]["text"][0]
        assert report.splitlines()[:3] == [
            f"row 1: flux.safetensors (model {STRENGTHS[renderer]:g}, clip 1)",
            "row 2: partial.safetensors (model 1, clip 1): off",
            "row 3: no file",
        ], (renderer, report)
        assert "keys_applied=6/6" in report, report
        # saved and loaded back: the same rows, the same prompt
        assert got["reloaded"] == got["built"], (renderer, got["reloaded"])
        assert got["prompt_again"]["inputs"] == sent, renderer
    assert all(shot.stat().st_size > 10_000 for shot in shots.values())
    assert json.dumps(seen)  # what the page handed back is plain data
