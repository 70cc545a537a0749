"""Support matrix: architecture x key layout x family, each cell a real check on a tiny model of that class.

A cell passes when a synthetic adapter of that family, on every Linear layer of the model, written in that
layout, (1) lands 100% (no unmatched key), (2) changes the output, (3) gives the same output merged and at
runtime (rel. error <= 1e-5, fp32), and (4) is removed exactly. `scripts/support_matrix.py` runs this file and
renders docs/support-matrix.md from the results: the table is never typed by hand."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers.arch_matrix import ARCHS, factors

import loraweave

LAYOUTS = {
    "diffusers": lambda path: f"transformer.{path}.",
    "peft": lambda path: f"base_model.model.{path}.",
    "kohya": lambda path: "lora_unet_" + path.replace(".", "_") + ".",
    "lycoris": lambda path: "lycoris_" + path.replace(".", "_") + ".",
}
FAMILIES = ("lora", "loha", "lokr", "dora", "oft", "ia3", "glora", "full")


def synthetic_adapter(model: torch.nn.Module, family: str, layout: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    sd = {}
    for path, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            prefix = LAYOUTS[layout](path)
            for suffix, t in factors(family, module.out_features, module.in_features, g).items():
                if family == "full" and suffix == "diff_b" and module.bias is None:
                    continue
                sd[prefix + suffix] = t
    return sd


def probe(model: torch.nn.Module, seed: int = 3) -> torch.Tensor:
    """Every Linear's output for a fixed input, concatenated: covers layers the model's forward may skip."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    with torch.no_grad():
        for _, module in sorted((n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear):
            outs.append(module(torch.randn(3, module.in_features, generator=g)).flatten())
    return torch.cat(outs)


# Architectures added later run two families per layout unless LORAWEAVE_FULL_MATRIX=1 (the matrix script sets
# it): the other families exercise the same resolution and mechanisms, and CI time is bounded.
LATER = ("wan-vace", "ltx2", "lumina2", "anima", "sana", "ernie-image", "ltx-video", "pixart")
CELLS = [
    (a, lay, f)
    for a in sorted(ARCHS)
    for lay in sorted(LAYOUTS)
    for f in FAMILIES
    if a not in LATER or f in ("lora", "full") or os.environ.get("LORAWEAVE_FULL_MATRIX") == "1"
]


@pytest.mark.parametrize("arch, layout, family", CELLS, ids=["-".join(c) for c in CELLS])
def test_cell(arch, layout, family):
    base = ARCHS[arch]()
    sd = synthetic_adapter(base, family, layout)
    before = probe(base)
    results = {}
    for mode in ("merge", "runtime"):
        model = copy.deepcopy(base)
        handle = loraweave.apply(model, sd, mode=mode, strict=True)
        assert handle.report.keys_applied == handle.report.keys_total == len(sd)
        results[mode] = probe(model)
        handle.remove()
        assert torch.equal(probe(model), before)
    assert float((results["merge"] - before).abs().max()) > 1e-4, "adapter had no visible effect"
    err = float((results["runtime"] - results["merge"]).abs().max() / results["merge"].abs().max())
    assert err <= 1e-5, err
