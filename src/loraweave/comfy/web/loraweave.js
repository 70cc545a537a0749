// Shows each LoraWeave node's report (its "text" ui output) in a read-only text box on the node.
// A standard STRING widget, so it renders under the classic canvas and under Nodes 2.0 alike.
import { app } from "../../scripts/app.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const REPORT_WIDGET = "loraweave_report";

app.registerExtension({
  name: "loraweave.report",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!nodeData.name.startsWith("LoraWeave")) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = (message?.text ?? []).join("\n");
      if (!text) return;
      let widget = this.widgets?.find((w) => w.name === REPORT_WIDGET);
      if (!widget) {
        widget = ComfyWidgets["STRING"](this, REPORT_WIDGET, ["STRING", { multiline: true }], app).widget;
        widget.serialize = false; // output, not an input: never saved into the workflow's widget values
        if (widget.inputEl) widget.inputEl.readOnly = true;
      }
      widget.value = text;
      this.setSize?.([Math.max(this.size[0], 420), Math.max(this.size[1], this.computeSize()[1])]);
      app.graph?.setDirtyCanvas(true, true);
    };
  },
});
