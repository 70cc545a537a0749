// LoraWeave Multi Loader: keeps each row's settings when the number of rows changes. The frontend rebuilds
// a dynamic combo's widgets with their defaults on every change of the count (core's count combos do the
// same); here each row widget's value is kept as the widget goes and given to the new widget of that name.
// The widgets stay ComfyUI's standard ones, so the node works under the classic canvas and Nodes 2.0 alike.
import { app } from "../../scripts/app.js";

const NODE = "LoraWeaveMultiLoader";
const ROWS = "loras."; // the row widgets' names: loras.on_1, loras.lora_1, loras.strength_model_1, ...
const EXTENSION = "loraweave.multiLoader";
const LOADED = Symbol.for("loraweave.multiLoader.loaded");

const extension = {
  name: EXTENSION,
  nodeCreated(node) {
    if (node.comfyClass !== NODE) return;
    const kept = new Map(); // row widget name -> its last value
    const keep = (widget) => {
      if (!widget?.name?.startsWith(ROWS)) return widget;
      const onRemove = widget.onRemove;
      widget.onRemove = function () {
        kept.set(widget.name, widget.value);
        return onRemove?.apply(this, arguments);
      };
      return widget;
    };
    const addWidget = node.addWidget;
    node.addWidget = function (type, name, value, ...rest) {
      return keep(addWidget.call(this, type, name, kept.has(name) ? kept.get(name) : value, ...rest));
    };
    node.widgets?.forEach(keep);
  },
};

// Served under several names when the pack is installed twice (see loraweave.js): the first copy registers.
if (!globalThis[LOADED]) {
  globalThis[LOADED] = import.meta.url;
  app.registerExtension(extension);
}
