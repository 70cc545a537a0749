"""Stack modes on quantized layers: the combined dense delta runs beside an SDNQ layer (runtime) or rides its
side channel (hosted); either way the layer's output change equals the float layer's under the same stack
mode."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.common import rel_err
from helpers.sdnq_models import IN, OUT_A, OUT_B, float_model, lora, quantized

import loraweave
from loraweave.request.spec import AdapterSpec


def _two_loras():
    (sa, _), (sb, _) = lora("a", OUT_A, 8, 1), lora("b", OUT_B, 8, 2)
    (sa2, _), (sb2, _) = lora("a", OUT_A, 4, 3), lora("b", OUT_B, 4, 4)
    return [AdapterSpec(sa | sb, 0.9, name="x"), AdapterSpec(sa2 | sb2, -0.7, name="y")]


def _outputs(model, x):
    with torch.no_grad():
        return {n: model.get_submodule(n)(x) for n in ("a", "b")}


@pytest.mark.parametrize(
    ("mode", "quant", "mechanism"), [("runtime", "auto", "runtime"), ("auto", "host", "hosted")]
)
def test_ties_on_sdnq_matches_the_float_layer(mode, quant, mechanism):
    base = float_model()
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(9))
    ref = copy.deepcopy(base)
    loraweave.apply(ref, _two_loras(), mode="merge", stack="ties", density=0.5)
    want = {n: _outputs(ref, x)[n] - _outputs(base, x)[n] for n in ("a", "b")}
    q = quantized(base, "uint4")
    before = _outputs(q, x)
    handle = loraweave.apply(q, _two_loras(), mode=mode, stack="ties", density=0.5, quantized=quant)
    assert {m.mechanism for m in handle.report.applied} == {mechanism}
    after = _outputs(q, x)
    # runtime is exact; hosted truncates a TIES delta (pruning makes it full rank): its reported capture
    # bounds it
    tol = 1e-4 if mechanism == "runtime" else 2e-2
    for m in handle.report.applied if mechanism == "hosted" else ():
        assert m.capture is not None and m.capture > 0.999 and m.retention > 0.99, (m.capture, m.retention)
    for n in ("a", "b"):
        assert rel_err(after[n] - before[n], want[n]) <= tol, n
    handle.remove()
    assert all(torch.equal(v, _outputs(q, x)[k]) for k, v in before.items())
