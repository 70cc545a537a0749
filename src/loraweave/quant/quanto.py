"""optimum-quanto layers: `QLinear` / `QConv2d` (QModuleMixin) after `quantize(model, weights=qint8|qint4)`.

Frozen layers store a `WeightQBytesTensor` (int8, per-row scale) or `WeightQBitsTensor` (packed 4/2-bit,
grouped scale and shift). Requantize runs the layer's own quantizer (its optimizer, qtype, group size) on the
new weight."""

from __future__ import annotations

import logging
from typing import Any

import torch

from .backend import Capabilities, KindProbedBackend, Restore, probe_once

log = logging.getLogger("loraweave")


def _run_probe() -> dict[str, str | None]:
    """{kind: why it cannot run here or None}: each weight qtype quantizes, freezes and runs a tiny Linear."""
    try:
        from optimum.quanto import freeze, qint4, qint8, quantize
    except Exception as exc:
        return {"package": f"optimum-quanto not importable: {type(exc).__name__}: {exc}"}
    out: dict[str, str | None] = {"package": None}
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    for kind, qtype in (("qint8", qint8), ("qint4", qint4)):
        try:
            linear = torch.nn.Linear(64, 32, bias=False)
            model = torch.nn.Sequential(linear)
            ref = linear.weight.detach().clone()
            quantize(model, weights=qtype)
            freeze(model)
            with torch.no_grad():
                y = model(x)
            err = float((y - x @ ref.t()).abs().max() / (x @ ref.t()).abs().max())
            out[kind] = None if err < 0.2 else f"{kind} forward on CPU is wrong (rel. err {err:.3g})"
        except Exception as exc:
            out[kind] = f"{kind} does not run on CPU: {type(exc).__name__}: {exc}"
    return out


def _is_qtensor(t) -> bool:
    return any(c.__name__ == "QTensor" for c in type(t).__mro__)


_probe = probe_once(_run_probe)


class QuantoBackend(KindProbedBackend):
    probe = staticmethod(_probe)
    name = "quanto"

    def owns(self, module: torch.nn.Module) -> bool:
        is_qmodule = any(c.__name__ == "QModuleMixin" for c in type(module).__mro__)
        return is_qmodule and getattr(module, "weight_qtype", None) is not None

    def capabilities(self, module: torch.nn.Module) -> Capabilities:
        layer: Any = module  # a QModuleMixin: optimum-quanto ships no types
        probe = (
            _probe()
        )  # qtypes the probe did not try (qint2, qfloat8) are taken as working: the layer exists
        why = probe["package"] or probe.get(layer.weight_qtype.name)
        if why:
            return Capabilities(False, False, False, why)
        if not _is_qtensor(module.weight):
            # Not frozen: the float weight is the storage and forward quantizes it on the fly.
            return Capabilities(
                True, False, False, "quanto layer not frozen: its float weight is the storage"
            )
        note = "; forward also quantizes activations" if layer.activation_qtype is not None else ""
        return Capabilities(True, True, False, "no low-rank side branch" + note)

    def bits(self, module: torch.nn.Module) -> int:
        layer: Any = module  # a QModuleMixin: optimum-quanto ships no types
        return int(layer.weight_qtype.bits)

    def grid_step(self, module: torch.nn.Module) -> float:
        qweight: Any = module.qweight  # a quanto QTensor: optimum-quanto ships no types
        return float(qweight._scale.float().abs().mean())  # int grids: one level = one scale

    def dequantize(self, module: torch.nn.Module) -> torch.Tensor:
        layer: Any = module  # a QModuleMixin: optimum-quanto ships no types
        return layer.qweight.dequantize().detach().float().reshape(layer.weight.shape)

    def requantize(self, module: torch.nn.Module, weight: torch.Tensor) -> Restore:
        layer: Any = module  # a QModuleMixin: optimum-quanto ships no types
        old_param = module._parameters["weight"]
        if old_param is None or not _is_qtensor(old_param):
            raise NotImplementedError("quanto layer not frozen: write its float weight instead")
        # The layer's own quantizer reads a float `weight`: give it one, then store the result frozen.
        module._parameters["weight"] = torch.nn.Parameter(
            weight.detach().to(old_param.dtype), requires_grad=False
        )
        try:
            qweight = layer.qweight
        finally:
            module._parameters["weight"] = old_param
        module._parameters["weight"] = torch.nn.Parameter(qweight, requires_grad=old_param.requires_grad)
        log.debug("requantize backend=quanto qtype=%s shape=%s", layer.weight_qtype.name, tuple(weight.shape))

        def restore() -> None:
            module._parameters["weight"] = old_param

        return restore


BACKEND = QuantoBackend()
