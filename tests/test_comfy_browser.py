"""The node pack in a real browser: ComfyUI's main.py --cpu (source in place, v0.19.3 with
comfyui-frontend-package 1.42.11, or the newest tree with 1.49.6: the frontend each pins) serving a temporary
base directory into which `loraweave comfy install` wrote the pack, beside a clone of this repository in
custom_nodes (both installed: the pack says so once and its script registers once), and Debian's headless
Chromium over the DevTools protocol. The page loads a workflow using our loader on a tiny Flux checkpoint and
our inspector, queues it, and the test waits for /history to say it completed; then our nodes must be in
/object_info, in the frontend's node registry and in the node library panel, and the report on the loader
node: all of it (no scroll bar), in the node's own width, labelled as an output. The page is reloaded and the
same workflow queued again (ComfyUI reuses the cached loader): the report must be back on the node; a new
lora_name clears it until the next run shows the new file's; bypassing the node clears it. Under Nodes 2.0 the
report shows the same way, and the properties panel does not list it under its internal name; then a
workflow with a positive-only LoRA (LoraWeave Conditioning LoRA + Runtime, helpers/comfy_page_cond) loads,
queues and completes, the server log saying the LoRA ran. The screenshot
paths are printed; on a failure the page's screenshot and console are saved beside them (failure.png,
failure.console.txt). Every page (re)load waits until the app's own startup workflow has loaded (COUNT_LOADS)
before the test loads its own, and no process of the server or the browser may outlive the test."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
from helpers.browser import WINDOW, Page, start_chromium
from helpers.comfy_env import COMFYUI_DIR, REPO_ROOT
from helpers.comfy_pack import FLUX_FILE, NODE_IDS
from helpers.comfy_page import COUNT_LOADS, evidence, open_app, wait_history
from helpers.comfy_page_cond import COND_LORA, SAMPLER, SAVE, STRENGTH, cond_workflow, write_cond_source
from helpers.comfy_page_runs import base_directory
from helpers.comfy_server import get_json, processes_naming, start_server, stop

LOADER, INSPECT = 2, 4  # node ids in the workflow
LOADER_WIDTH = 330  # narrower than the report's lines: the node must keep it
CLONE = "ComfyUI-LoraWeave"  # this repository as a clone in custom_nodes, beside the installed shim
REPORT_LABEL = "report (output)"
REPORT_CAP = 480  # px: loraweave.js MAX_HEIGHT, the tallest report box before it scrolls


def _node(node_id: int, kind: str, pos, size, inputs, outputs, widgets) -> dict:
    return {"id": node_id, "type": kind, "pos": pos, "size": size, "flags": {}, "order": node_id, "mode": 0,
            "inputs": inputs, "outputs": outputs, "properties": {}, "widgets_values": widgets}  # fmt: skip


def _slot(name: str, kind: str, link=None, links=None) -> dict:
    return {"name": name, "type": kind, **({"links": links} if links is not None else {"link": link})}


def workflow(strength: float = 0.7) -> dict:
    """UI-format workflow: Load Diffusion Model -> LoraWeave Loader -> Preview as Text, and
    LoraWeave Inspect -> Preview Image (its heatmap)."""
    nodes = [
        _node(1, "UNETLoader", [20, 60], [320, 90], [], [_slot("MODEL", "MODEL", links=[1])],
              [FLUX_FILE, "default"]),
        _node(LOADER, "LoraWeaveLoader", [370, 60], [LOADER_WIDTH, 230],
              [_slot("model", "MODEL", 1), _slot("clip", "CLIP")],
              [_slot("MODEL", "MODEL", links=[]), _slot("CLIP", "CLIP", links=[]),
               _slot("report", "STRING", links=[2])],
              ["flux.safetensors", strength, 1.0, "merge", False]),
        _node(3, "PreviewAny", [730, 60], [330, 200], [_slot("source", "*", 2)], [], []),
        # below the loader's report under Nodes 2.0 (trigger_words, allow_other_arch, the 3 modality rows)
        _node(INSPECT, "LoraWeaveInspect", [20, 720], [520, 330], [],
              [_slot("report", "STRING", links=[]), _slot("trigger_words", "STRING", links=[]),
               _slot("heatmap", "IMAGE", links=[3])], ["flux.safetensors"]),
        _node(5, "PreviewImage", [570, 720], [330, 420], [_slot("images", "IMAGE", 3)], [], []),
    ]  # fmt: skip
    links = [[1, 1, 0, LOADER, 0, "MODEL"], [2, LOADER, 2, 3, 0, "STRING"], [3, INSPECT, 2, 5, 0, "IMAGE"]]
    view = {"ds": {"scale": 0.9, "offset": [440, 90]}}  # the canvas right of the node library panel
    return {"last_node_id": 5, "last_link_id": 3, "nodes": nodes, "links": links, "groups": [], "config": {},
            "extra": view, "version": 0.4}  # fmt: skip


def _base_directory(base) -> None:
    """comfy_page_runs.base_directory, and a clone of this repository beside the installed shim."""
    base_directory(base)
    write_cond_source(base)
    assert (base / "custom_nodes" / "loraweave_nodes" / "__init__.py").is_file()
    (base / "custom_nodes" / CLONE).symlink_to(REPO_ROOT, target_is_directory=True)


LOADER_WIDGETS = f"app.graph.getNodeById({LOADER})?.widgets?.map(w => w.value)"
# The loader's report as the page shows it: the widget's value and label, the node's size, and the textarea
# that draws it (Nodes 2.0 draws its own; the classic canvas the widget's element) with its label there.
REPORT = """(() => {
  const node = app.graph.getNodeById(LOADER);
  const widget = node?.widgets?.find(w => w.name === 'loraweave_report');
  if (!widget) return null;
  const vue = !!LiteGraph.vueNodesMode;
  const boxes = vue ? [...document.querySelectorAll('[data-node-id="LOADER"] textarea')] : [widget.inputEl];
  const box = boxes[boxes.length - 1];
  const label = vue ? document.querySelector(`label[for="${box?.id}"]`)?.textContent.trim() : widget.label;
  const below = app.graph.getNodeById(INSPECT).pos[1] - LiteGraph.NODE_TITLE_HEIGHT;
  return {value: widget.value, label, placeholder: box?.placeholder, width: node.size[0], mode: node.mode,
          bottom: node.pos[1] + node.size[1], below,
          box: box && {client: box.clientHeight, scroll: box.scrollHeight, shown: box.value}};
})()""".replace("LOADER", str(LOADER)).replace("INSPECT", str(INSPECT))


async def _run(page: Page, url: str, graph: dict) -> tuple[dict, dict]:
    """Load the workflow, queue it as the queue button does, and return (the prompt the server got, its
    /history entry) once the run finished."""
    await page.evaluate(f"app.loadGraphData({json.dumps(graph)}).then(() => true)")
    wanted = graph["nodes"][1]["widgets_values"]
    widgets = await page.wait_for(LOADER_WIDGETS, 20, "the loader node")
    assert widgets[: len(wanted)] == wanted, f"the loaded loader shows {widgets}, not {wanted}"
    return await _queue(page, url)


async def _queue(page: Page, url: str) -> tuple[dict, dict]:
    """Queue the graph on the page as the queue button does: (the prompt the server got, its /history
    entry)."""
    done = await page.evaluate("window.__loraweaveQueued.length")
    await page.evaluate("app.queuePrompt(0).then(() => true)")
    queued = await page.wait_for(
        f"window.__loraweaveQueued.length > {done} && window.__loraweaveQueued[{done}]", 30, "the queue"
    )
    assert not queued["answer"].get("node_errors"), queued["answer"]
    entry = await asyncio.to_thread(wait_history, url, queued["answer"]["prompt_id"])
    return queued["prompt"], entry


async def _report(page: Page, starts: str) -> dict:
    """The loader's report (REPORT) once its value starts with `starts` and the box had time to fit it."""
    await page.wait_for(
        f"(() => {{ const r = {REPORT}; return r && r.value.startsWith({json.dumps(starts)}); }})()",
        20,
        f"a report starting {starts!r} on the loader node",
    )
    await asyncio.sleep(1.0)  # the box is fitted on the next frames
    return await page.evaluate(REPORT)


async def _drive(ws_url: str, url: str, shot) -> dict:
    """Load, queue, wait; then read back what the page shows. Returns what the asserts need."""
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as socket:
        page = Page(socket)
        await page.send("Runtime.enable")
        await page.send("Page.enable")  # without it, Chromium runs no script on new documents
        await page.send("Page.addScriptToEvaluateOnNewDocument", source=COUNT_LOADS)
        await page.send("Emulation.setDeviceMetricsOverride", width=WINDOW[0], height=WINDOW[1],
                        deviceScaleFactor=1, mobile=False)  # fmt: skip
        try:
            seen = await _steps(page, url, shot)
        except Exception:
            await evidence(page, shot.with_name("failure.png"))
            raise
        return seen | {"console": list(page.console)}


# Set a widget of the loader as the canvas does when the user picks a value.
SET_WIDGET = f"""((name, value) => {{
  const node = app.graph.getNodeById({LOADER});
  node.widgets.find(w => w.name === name).setValue(value, {{node, canvas: app.canvas}});
  return true;
}})"""
BYPASS = f"""(async () => {{
  app.canvas.deselectAll();
  app.canvas.selectNode(app.graph.getNodeById({LOADER}));
  await app.extensionManager.command.execute('Comfy.Canvas.ToggleSelectedNodes.Bypass');
  return true;
}})()"""


async def _classic(page: Page, url: str, shot) -> dict:
    """The classic canvas: run, reload and run again (the loader is cached), a new lora_name, a bypass."""
    await open_app(page, url)
    registered = await page.evaluate(
        "Object.keys(LiteGraph.registered_node_types).filter(k => k.startsWith('LoraWeave'))"
    )
    run = await _run(page, url, workflow())
    shown = await _report(page, "flux.safetensors: ")
    inspect = await page.evaluate(
        f"(() => {{ const w = app.graph.getNodeById({INSPECT}).widgets.find(w => w.name === "
        "'loraweave_report'); return {value: w.value, client: w.inputEl.clientHeight, "
        "scroll: w.inputEl.scrollHeight}; })()"
    )
    await page.evaluate(
        "[...document.querySelectorAll('button')].find(b => b.textContent.trim() === 'Nodes')?.click() ?? "
        "true"
    )
    await page.evaluate(
        "(() => { const box = document.querySelector('.node-lib-search-box input, "
        "input[placeholder*=\"Search\"]'); if (box) { box.value = 'LoraWeave'; box.dispatchEvent(new "
        "Event('input', {bubbles: true})); } return true; })()"
    )
    library = await page.wait_for(
        "(() => { const t = document.body.innerText; return t.includes('LoraWeave Apply Stack') && t; })()",
        20,
        "our nodes in the node library panel",
    )
    await asyncio.sleep(1.0)  # the heatmap preview and the panel finish drawing
    await page.screenshot(shot)
    # a reloaded page, the same workflow: ComfyUI reuses the cached loader and must re-send its report
    await open_app(page, url)
    rerun = await _run(page, url, workflow())
    reloaded = await _report(page, "flux.safetensors: ")
    await page.evaluate(f"{SET_WIDGET}('lora_name', 'partial.safetensors')")
    cleared = await page.evaluate(REPORT)
    changed_run = await _queue(page, url)
    changed = await _report(page, "WARNING: partial.safetensors")
    await page.screenshot(shot.with_name("comfy_browser_changed.png"))
    await page.evaluate(BYPASS)
    bypassed = await page.wait_for(f"(() => {{ const r = {REPORT}; return r.mode === 4 && r; }})()", 10)
    await page.evaluate(BYPASS)  # on again: the next run (the loader cached) shows the report again
    await _queue(page, url)
    await _report(page, "WARNING: partial.safetensors")
    # strict on that partial file: the run fails at the loader, and the report of the last good run goes
    await page.evaluate(f"{SET_WIDGET}('strict', true)")
    _, failed_run = await _queue(page, url)
    failed = await page.wait_for(
        f"(() => {{ const r = {REPORT}; return r.value === '' && r; }})()", 10, "no report after the failure"
    )
    return {"registered": registered, "run": run, "shown": shown, "inspect": inspect, "library": library,
            "rerun": rerun, "reloaded": reloaded, "cleared": cleared, "changed_run": changed_run,
            "changed": changed, "failed_run": failed_run, "failed": failed,
            "bypassed": bypassed}  # fmt: skip


async def _cond_lora(page: Page, url: str, shot) -> dict:
    """The positive-only conditioning LoRA workflow (helpers/comfy_page_cond) on the open page: it loads,
    queues and completes."""
    graph = cond_workflow()
    await page.evaluate(f"app.loadGraphData({json.dumps(graph)}).then(() => true)")
    loaded = await page.wait_for(
        f"app.graph.getNodeById({COND_LORA})?.widgets?.map(w => w.value)", 20, "the conditioning LoRA node"
    )
    cond_run = await _queue(page, url)
    await asyncio.sleep(1.0)  # the canvas finishes drawing the run's end
    await page.screenshot(shot.with_name("comfy_browser_cond.png"))
    return {"cond_loaded": loaded, "cond_run": cond_run}


async def _steps(page: Page, url: str, shot) -> dict:
    """The test's page steps (see _drive)."""
    seen = await _classic(page, url, shot)
    # Nodes 2.0 (the Vue renderer): the same nodes, re-run at another strength, show the report in its DOM
    await page.evaluate("app.extensionManager.setting.set('Comfy.VueNodes.Enabled', true).then(() => true)")
    await open_app(page, url)
    prompt_2, entry_2 = await _run(page, url, workflow(strength=0.5))
    texts = "[...document.querySelectorAll('textarea')].map(t => t.value).join('\\n---\\n')"
    dom = await page.wait_for(
        f"(() => {{ const t = {texts}; return t.includes('keys_applied') && t; }})()",
        20,
        "the report in the Nodes 2.0 DOM",
    )
    vue = await _report(page, "flux.safetensors: ")
    # the properties panel of the selected loader: its parameters, where the report must not pose as an input
    await page.evaluate(
        f"(() => {{ app.canvas.deselectAll(); app.canvas.selectNode(app.graph.getNodeById({LOADER})); "
        "document.querySelector('[aria-label=\"Toggle properties panel\"]')?.click(); return true; })()"
    )
    panel = await page.wait_for(
        "(() => { const p = document.querySelector('[data-testid=\"properties-panel\"]') ?? "
        "[...document.querySelectorAll('aside, [role=complementary]')].at(-1); "
        "return p && p.innerText.includes('strength_model') && p.innerText; })()",
        20,
        "the properties panel with the loader's parameters",
    )
    await asyncio.sleep(1.0)
    await page.screenshot(shot.with_name("comfy_browser_nodes2.png"))
    await page.evaluate(  # the properties panel closed again: the next workflow in the whole window
        "document.querySelector('[aria-label=\"Toggle properties panel\"]')?.click() ?? true"
    )
    seen |= await _cond_lora(page, url, shot)  # last: under Nodes 2.0, its run leaves the steps above alone
    return seen | {"vue": (prompt_2, entry_2, dom), "vue_report": vue, "panel": panel}


def _fits(report: dict) -> bool:
    """The whole report shows: the box is as tall as its text (no scroll bar), or it reached the cap."""
    box = report["box"]
    return box["scroll"] <= box["client"] + 2 or box["client"] >= REPORT_CAP - 8


def test_pack_in_a_real_browser(tmp_path):
    base = tmp_path / "comfy_base"
    _base_directory(base)
    log = tmp_path / "server.log"
    server, url = start_server(COMFYUI_DIR, base, log)
    chromium = None
    try:
        assert NODE_IDS <= set(get_json(f"{url}/object_info")), "our nodes are not in /object_info"
        chromium, ws_url = start_chromium(tmp_path / "profile")
        shot = tmp_path / "comfy_browser.png"
        seen = asyncio.run(_drive(ws_url, url, shot))
        names = ("comfy_browser_changed.png", "comfy_browser_cond.png", "comfy_browser_nodes2.png")
        print(f"screenshots: {shot} " + " ".join(str(shot.with_name(n)) for n in names))
    finally:
        for process in (chromium, server):
            if process is not None:
                stop(process)
    deadline = time.monotonic() + 10  # a browser's helpers leave shortly after their parent
    while processes_naming(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_naming(str(tmp_path)), "the server or the browser left processes behind"
    assert set(seen["registered"]) == NODE_IDS
    prompt, entry = seen["run"]
    assert prompt[str(LOADER)]["inputs"]["strength_model"] == 0.7
    assert entry["status"]["status_str"] == "success", entry["status"]
    report = entry["outputs"][str(LOADER)]["text"][0]
    assert report.startswith("flux.safetensors: ") and "keys_applied=6/6" in report
    shown = seen["shown"]
    assert shown["value"] == report and shown["box"]["shown"] == report, "the loader does not show its report"
    # all of it, in the node's own width, labelled as the output it is
    assert _fits(shown) and shown["box"]["client"] < REPORT_CAP, shown
    assert shown["width"] == LOADER_WIDTH, "the report widened the node over its neighbours"
    assert shown["bottom"] < shown["below"], shown
    assert shown["label"] == REPORT_LABEL and "loraweave_report" not in shown["placeholder"], shown
    inspect = seen["inspect"]
    assert "kohya" in entry["outputs"][str(INSPECT)]["text"][0] and inspect["value"].startswith("file ")
    assert inspect["scroll"] <= inspect["client"] + 2 or inspect["client"] >= REPORT_CAP - 8, inspect
    assert str(base) not in inspect["value"] and "--limit" not in inspect["value"], inspect["value"]
    assert {"LoraWeave Loader", "LoraWeave Inspect", "LoraWeave Stack"} <= {
        line.strip() for line in seen["library"].splitlines()
    }
    assert shot.stat().st_size > 10_000
    # reloaded and queued again: ComfyUI reused the cached loader, and its report is on the node again
    _, rerun = seen["rerun"]
    assert rerun["outputs"][str(LOADER)]["text"] == [report], "the cached loader's report was not sent"
    assert seen["reloaded"]["value"] == report and _fits(seen["reloaded"]), seen["reloaded"]
    # another file: the old report goes at once; the run shows the new file's
    assert seen["cleared"]["value"] == "", "the old file's report stayed on the node after lora_name changed"
    _, changed_run = seen["changed_run"]
    changed = changed_run["outputs"][str(LOADER)]["text"][0]
    assert changed.startswith("WARNING: partial.safetensors: 6 of 9 keys landed"), changed
    assert seen["changed"]["value"] == changed and _fits(seen["changed"]), seen["changed"]
    failed_run = seen["failed_run"]
    assert failed_run["status"]["status_str"] == "error" and str(LOADER) not in failed_run["outputs"]
    assert seen["failed"]["value"] == "", seen["failed"]
    assert seen["bypassed"]["value"] == "", "a bypassed node kept its report"
    # the shim and the clone: the server log says so once; the page ran the script three times (the shim's
    # folder, the clone's folder and the clone's pyproject name), and registered the first only
    console = "\n".join(seen["console"])
    # (a second registration throws in the frontend: "[vite:preloadError]" in 1.42.11's console)
    assert not any(e in console for e in ("preloadError", "Error loading extension")), console
    # the pack imports no module the frontend calls internal (its notice: "... is an internal module, not
    # part of the public API"; 1.42.11 and 1.49.6 print it for scripts/widgets.js)
    assert "is an internal module" not in console, console
    assert console.count("loraweave.report: http") == 2 * 3, console  # two copies skipped, three page loads
    assert log.read_text().count("pack_installed_twice") == 1
    # the positive-only conditioning LoRA: loaded as saved, queued with the LoRA on the positive, completed
    assert seen["cond_loaded"][:2] == ["flux.safetensors", STRENGTH], seen["cond_loaded"]
    cond_prompt, cond_entry = seen["cond_run"]
    assert cond_prompt[str(COND_LORA)]["inputs"]["strength"] == STRENGTH
    assert cond_prompt[str(SAMPLER)]["inputs"]["positive"] == [str(COND_LORA), 0], cond_prompt
    assert cond_entry["status"]["status_str"] == "success", cond_entry["status"]
    assert cond_entry["outputs"][str(SAVE)]["latents"], cond_entry["outputs"]
    assert log.read_text().count("comfy conditioning_loras=1 entries=1") == 1, "the LoRA was not run"
    prompt_2, second, dom = seen["vue"]
    assert prompt_2[str(LOADER)]["inputs"]["strength_model"] == 0.5
    assert second["status"]["status_str"] == "success", second["status"]
    vue_report = second["outputs"][str(LOADER)]["text"][0]
    assert vue_report in dom.split("\n---\n"), "Nodes 2.0 does not show the report"
    vue = seen["vue_report"]
    assert vue["box"]["shown"] == vue_report and _fits(vue) and vue["label"] == REPORT_LABEL, vue
    assert vue["width"] == LOADER_WIDTH and vue["bottom"] < vue["below"], vue  # and the node below is clear
    assert "loraweave_report" not in seen["panel"], seen["panel"]
