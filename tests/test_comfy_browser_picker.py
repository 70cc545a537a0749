"""The LoRA picker's marks in a real browser: ComfyUI's main.py --cpu (v0.19.3 with comfyui-frontend-package
1.42.11, or the newest tree with 1.49.6) and Debian's headless Chromium, under the classic canvas and under
Nodes 2.0. The loras folder holds the node tests' files and the real SD2 file; the page builds Load Diffusion
Model (the tiny Flux) -> LoraWeave Loader (model only) and -> Multi Loader, and runs it. The run names the
model's architecture, the web script asks the server which files fit it, and the SD2 file is then shown as "⚠
<file> (SD2)" in both file pickers, its value still the plain file name. A Multi Loader row's new file clears
the node's report. The screenshots' paths are printed."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from conftest import REALDATA
from helpers.browser import WINDOW, Page, start_chromium
from helpers.comfy_env import COMFYUI_DIR
from helpers.comfy_page import evidence, open_app
from helpers.comfy_page_runs import base_directory, prepare, queue
from helpers.comfy_server import start_server, stop

SD2_FILE = "JustinJiangNext__lora-2.0__pytorch_lora_weights.safetensors"
MARKED = f"\u26a0 {SD2_FILE} (SD2)"

BUILD = """(() => {
  const g = app.graph; g.clear();
  const unet = LiteGraph.createNode('UNETLoader'); unet.pos = [20, 60]; g.add(unet);
  unet.widgets[0].value = 'tiny_flux.safetensors';
  const loader = LiteGraph.createNode('LoraWeaveLoaderModelOnly'); loader.pos = [380, 60]; g.add(loader);
  unet.connect(0, loader, 0);
  loader.widgets.find(w => w.name === 'lora_name').value = 'flux.safetensors';
  const multi = LiteGraph.createNode('LoraWeaveMultiLoader'); multi.pos = [380, 420]; g.add(multi);
  unet.connect(0, multi, 0);
  multi.widgets.find(w => w.name === 'loras.lora_1').value = 'flux.safetensors';
  const one = LiteGraph.createNode('PreviewAny'); one.pos = [900, 60]; g.add(one); loader.connect(1, one, 0);
  const two = LiteGraph.createNode('PreviewAny'); two.pos = [900, 420]; g.add(two); multi.connect(2, two, 0);
  g.setDirtyCanvas(true, true);
  return {loader: loader.id, multi: multi.id};
})()"""
# What each picker shows for the SD2 file and for the file of the model's architecture, once marks came
LABELS = """(() => {
  const label = (id, name, value) => {
    const w = app.graph.getNodeById(id).widgets.find(w => w.name === name);
    return [w.options.getOptionLabel(value), w.options.optionLabel(value)];
  };
  return {loader: label(IDS.loader, 'lora_name', SD2), multi: label(IDS.multi, 'loras.lora_1', SD2),
          own: label(IDS.loader, 'lora_name', 'flux.safetensors')};
})()"""
MARKS_CAME = "!!app.graph.getNodeById(IDS.loader).loraweaveFiles?.[SD2]"
# Pick the SD2 file on the loader as the canvas does, and a new file on the Multi Loader's row 1
PICK = """(async () => {
  const pick = (id, name, value) => {
    const node = app.graph.getNodeById(id);
    node.widgets.find(w => w.name === name).setValue(value, {node, canvas: app.canvas});
  };
  const report = (id) => app.graph.getNodeById(id).widgets.find(w => w.name === 'loraweave_report')?.value;
  const before = report(IDS.multi);
  pick(IDS.loader, 'lora_name', SD2);
  pick(IDS.multi, 'loras.lora_1', 'partial.safetensors');
  app.graph.setDirtyCanvas(true, true);
  const prompt = (await app.graphToPrompt()).output;
  return {before, after: report(IDS.multi), sent: prompt[IDS.loader].inputs.lora_name,
          value: app.graph.getNodeById(IDS.loader).widgets.find(w => w.name === 'lora_name').value};
})()"""
SHOWN = "document.querySelector(`[data-node-id=\"${IDS.loader}\"]`)?.innerText ?? ''"


def _js(script: str, ids: dict) -> str:
    return script.replace("IDS", json.dumps(ids)).replace("SD2", json.dumps(SD2_FILE))


async def _renderer(page: Page, url: str, shot, vue: bool) -> dict:
    ids = await page.evaluate(BUILD)
    _, entry = await queue(page, url)
    await page.wait_for(_js(MARKS_CAME, ids), 20, "the picker's marks")
    labels = await page.evaluate(_js(LABELS, ids))
    picked = await page.evaluate(_js(PICK, ids))
    shown = ""
    if vue:
        shown = await page.wait_for(
            f"(() => {{ const t = {_js(SHOWN, ids)}; return t.includes({json.dumps(MARKED)}) && t; }})()",
            20,
            "the marked file on the Nodes 2.0 loader",
        )
    await asyncio.sleep(1.0)
    await page.screenshot(shot)
    return {"entry": entry, "labels": labels, "picked": picked, "shown": shown}


async def _drive(ws_url: str, url: str, shots: dict) -> dict:
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as socket:
        page = Page(socket)
        await prepare(page, WINDOW)
        try:
            await open_app(page, url)
            classic = await _renderer(page, url, shots["classic"], vue=False)
            await page.evaluate(
                "app.extensionManager.setting.set('Comfy.VueNodes.Enabled', true).then(() => 1)"
            )
            await open_app(page, url)
            nodes2 = await _renderer(page, url, shots["nodes2"], vue=True)
            return {"classic": classic, "nodes2": nodes2}
        except Exception:
            await evidence(page, shots["classic"].with_name("failure.png"))
            raise


def test_picker_marks_other_architectures_in_a_real_browser(tmp_path):
    base = tmp_path / "comfy_base"
    base_directory(base)
    (base / "models" / "loras" / SD2_FILE).symlink_to(REALDATA / "lora" / SD2_FILE)
    server, url = start_server(COMFYUI_DIR, base, tmp_path / "server.log")
    chromium = None
    shots = {name: tmp_path / f"picker_{name}.png" for name in ("classic", "nodes2")}
    try:
        chromium, ws_url = start_chromium(tmp_path / "profile")
        seen = asyncio.run(_drive(ws_url, url, shots))
        print(f"screenshots: {shots['classic']} {shots['nodes2']}")
    finally:
        for process in (chromium, server):
            if process is not None:
                stop(process)
    for renderer, got in seen.items():
        assert got["entry"]["status"]["status_str"] == "success", (renderer, got["entry"]["status"])
        labels = got["labels"]
        # both pickers, both renderers' label hooks: the SD2 file marked, the model's own file as it is
        assert labels["loader"] == [MARKED, MARKED] and labels["multi"] == [MARKED, MARKED], labels
        assert labels["own"] == ["flux.safetensors", "flux.safetensors"], labels
        picked = got["picked"]
        assert picked["value"] == SD2_FILE and picked["sent"] == SD2_FILE, picked  # the value stays plain
        # a Multi Loader row's new file clears the report of the old one
        assert picked["before"] and picked["after"] == "", picked
    assert MARKED in seen["nodes2"]["shown"]
    assert all(shot.stat().st_size > 10_000 for shot in shots.values())
