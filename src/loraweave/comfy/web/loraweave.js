// Shows each LoraWeave node's report (its "text" ui output) in a read-only text box on the node, sized to
// its lines up to a cap, in the node's own width. A standard STRING widget, so it renders under the classic
// canvas and under Nodes 2.0 alike. The report describes the last run of the file the node names: it is
// cleared when its file changes (lora_name, a Multi Loader row's file), when the node is bypassed or muted,
// and when the node fails.
// The LoRA picker marks the files whose header says they are for another architecture than the model the
// node last ran on ("⚠ file.safetensors (SD2)"): the run names the model's architecture (MODEL_UI), the
// server's ARCH_ROUTE says which files fit it. Only the label changes: the values stay the file names.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const EXTENSION = "loraweave.report";
const REPORT_WIDGET = "loraweave_report"; // the widget's internal name; users see LABEL
const LABEL = "report (output)";
const MAX_HEIGHT = 480; // px: a longer report scrolls inside its box
const MIN_HEIGHT = 24; // px: one line
const GAP = 10; // px kept free above a node below
const BYPASS = 4;
const NEVER = 2; // muted
const MODEL_UI = "loraweave_model";
const ARCH_ROUTE = "/loraweave/lora_archs";
const OTHER_ARCH = "\u26a0"; // ⚠
// Set by the first copy of this script that runs: another copy registers nothing.
const LOADED = Symbol.for("loraweave.report.loaded");

function reportWidget(node) {
  return node.widgets?.find((w) => w.name === REPORT_WIDGET);
}

function addReportWidget(node) {
  // app.widgets: the frontend's widget constructors (scripts/widgets.js warns that it is internal)
  const widget = app.widgets.STRING(node, REPORT_WIDGET, ["STRING", { multiline: true }], app).widget;
  widget.label = LABEL;
  widget.serialize = false; // an output: never saved into the workflow's widget values nor sent as an input
  widget.options.read_only = true;
  widget.options.placeholder = "the report shows here after a run";
  if (widget.inputEl) {
    widget.inputEl.readOnly = true;
    widget.inputEl.placeholder = widget.options.placeholder;
  }
  // classic canvas: the box is exactly as tall as its text (fit() sets the height); the node's computeSize
  // counts it
  widget.options.getMinHeight = () => widget.loraweaveHeight ?? MIN_HEIGHT;
  widget.options.getMaxHeight = () => widget.loraweaveHeight ?? MIN_HEIGHT;
  return widget;
}

// The textarea that shows the report: Nodes 2.0 draws its own, the classic canvas the widget's element.
function reportBox(node, widget) {
  if (globalThis.LiteGraph?.vueNodesMode) {
    const boxes = document.querySelectorAll(`[data-node-id="${node.id}"] textarea`);
    return boxes.length ? boxes[boxes.length - 1] : null;
  }
  return widget.inputEl?.isConnected ? widget.inputEl : null;
}

// Height of the box's text at `width` px (wrapped lines counted), capped.
function textHeight(box, width) {
  const saved = [box.style.height, box.style.width];
  box.style.height = "0px";
  if (width) box.style.width = `${width}px`;
  const height = box.scrollHeight + (box.offsetHeight - box.clientHeight);
  [box.style.height, box.style.width] = saved;
  return Math.max(MIN_HEIGHT, Math.min(MAX_HEIGHT, Math.ceil(height) + 2));
}

// The node height `wanted`, or less where growing to it would cover a node below (the box then scrolls).
function allowedHeight(node, wanted) {
  if (wanted <= node.size[1]) return wanted;
  const title = globalThis.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  const [left, top] = node.pos;
  const right = left + node.size[0];
  let room = Infinity;
  for (const other of app.graph?.nodes ?? []) {
    const [x, y] = other.pos;
    if (other === node || y <= top || x >= right || x + other.size[0] <= left) continue;
    room = Math.min(room, y - title - GAP - top);
  }
  return Math.min(wanted, Math.max(room, node.size[1]));
}

// Make the node as tall as its report needs (never wider), once the renderer has drawn the box.
function fit(node, widget, tries = 6) {
  requestAnimationFrame(() => {
    const box = reportBox(node, widget);
    if (!box || !box.offsetWidth || box.value !== widget.value) {
      if (tries > 0) fit(node, widget, tries - 1); // not drawn yet, or not yet with this text
      return;
    }
    if (!globalThis.LiteGraph?.vueNodesMode) {
      // the classic canvas draws the box at the node's width less the widget's margins, wherever it is now
      const margins = 2 * (widget.margin ?? 0);
      widget.loraweaveHeight = textHeight(box, node.size[0] - margins) + margins;
      const over = node.computeSize()[1] - allowedHeight(node, node.computeSize()[1]);
      widget.loraweaveHeight = Math.max(MIN_HEIGHT + margins, widget.loraweaveHeight - over);
      node.setSize([node.size[0], node.computeSize()[1]]);
    } else {
      const change = textHeight(box) - box.offsetHeight;
      if (Math.abs(change) > 1) {
        const height = allowedHeight(node, node.size[1] + change);
        if (Math.abs(height - node.size[1]) > 1) {
          node.setSize([node.size[0], height]);
          if (tries > 0) fit(node, widget, tries - 1); // Nodes 2.0 lays the node out again: check it
        }
      }
    }
    app.graph?.setDirtyCanvas(true, true);
  });
}

function showReport(node, text) {
  const widget = reportWidget(node) ?? (text ? addReportWidget(node) : null);
  if (!widget) return;
  widget.value = text;
  fit(node, widget);
}

// A LoraWeave node that has a report box (the stack row has none).
function reportNode(nodeId) {
  const node = app.graph?.getNodeById(nodeId);
  return node && reportWidget(node) ? node : null;
}

// Call `onChange(mode)` whenever the node's mode is set (bypass, mute), keeping the frontend's own accessor.
function watchMode(node, onChange) {
  const own = Object.getOwnPropertyDescriptor(node, "mode");
  let value = node.mode;
  const get = own?.get ? () => own.get.call(node) : () => value;
  const set = own?.set ? (v) => own.set.call(node, v) : (v) => (value = v);
  Object.defineProperty(node, "mode", {
    configurable: true,
    enumerable: true,
    get,
    set(mode) {
      const before = get();
      set(mode);
      if (mode !== before) onChange(mode);
    },
  });
}

// A widget that picks a file: lora_name, or a Multi Loader row's file (loras.lora_1, loras.lora_2, ...).
function isFileWidget(name) {
  return name === "lora_name" || /^loras\.lora_\d+$/.test(name ?? "");
}

// How the picker shows file `value`: marked when its architecture does not fit the node's model.
function fileLabel(node, value) {
  const file = value == null ? null : node.loraweaveFiles?.[value];
  return file?.fits === false ? `${OTHER_ARCH} ${value} (${file.label})` : (value ?? "");
}

// The classic canvas asks getOptionLabel, Nodes 2.0's select its optionLabel: both get the one label.
function markFiles(node, widget) {
  if (!isFileWidget(widget?.name) || !widget.options) return widget;
  widget.options.getOptionLabel = (value) => fileLabel(node, value);
  widget.options.optionLabel = (value) => fileLabel(node, value);
  return widget;
}

// Which files fit the architecture `model` the node ran on (the server reads each file's header only).
async function learnModel(node, model) {
  try {
    const response = await api.fetchApi(`${ARCH_ROUTE}?model=${encodeURIComponent(model)}`);
    if (!response.ok) return;
    node.loraweaveFiles = (await response.json()).files ?? {};
    app.graph?.setDirtyCanvas(true, true);
  } catch (error) {
    console.warn(`[loraweave] ${ARCH_ROUTE}: ${error}`);
  }
}

const extension = {
  name: EXTENSION,
  async setup() {
    api.addEventListener("execution_error", ({ detail }) => {
      const node = reportNode(detail?.node_id);
      if (node) showReport(node, "");
    });
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!nodeData.name.startsWith("LoraWeave")) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = (message?.text ?? []).join("\n");
      if (text) showReport(this, text);
      const model = message?.[MODEL_UI]?.[0];
      if (model) learnModel(this, model);
    };
    const onWidgetChanged = nodeType.prototype.onWidgetChanged;
    nodeType.prototype.onWidgetChanged = function (name, value, oldValue) {
      onWidgetChanged?.apply(this, arguments);
      if (isFileWidget(name) && value !== oldValue) showReport(this, "");
    };
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      onNodeCreated?.apply(this, arguments);
      this.widgets?.forEach((widget) => markFiles(this, widget));
      const addWidget = this.addWidget;
      this.addWidget = function () {
        return markFiles(this, addWidget.apply(this, arguments)); // a Multi Loader's rows come and go
      };
      watchMode(this, (mode) => {
        if (mode === BYPASS || mode === NEVER) showReport(this, "");
      });
    };
  },
};

// ComfyUI serves one web folder under several names: a clone's folder name and its pyproject name, or the
// shim's beside a clone (the server log says when two installs are loaded). The first copy registers.
if (globalThis[LOADED]) {
  const first = globalThis[LOADED];
  console.info(`[loraweave] ${EXTENSION}: ${import.meta.url} not registered again (${first} was)`);
} else {
  globalThis[LOADED] = import.meta.url;
  app.registerExtension(extension);
}
