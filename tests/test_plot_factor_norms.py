"""The heatmap's ‖ΔW‖ per module without forming a layer-sized ΔW: LoKr from its factors' row norms, other
families a bounded block of rows at a time (issue 43 G: a 650 KB LoKr took 8-17 s, most of it page faults
of per-layer ΔW allocations). Checked against ΔW formed in fp64 here; the size of every tensor made is
counted by a dispatch mode (no timing)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from loraweave.families import lokr
from loraweave.tools.plot import FORMED_BLOCK, block_grid

LOKR_FILE = "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors"


class LargestTensor(TorchDispatchMode):
    """The most elements of any CPU tensor an op returns while active (meta tensors, the skeleton, are
    free)."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.most = max(self.most, t.numel())
        return out


def _kron(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """ΔW of LoKr (a·b, c·n) in fp64: the Kronecker product formed element by element's definition."""
    return torch.kron(w1.double().flatten(1), w2.double().flatten(1))


@pytest.mark.parametrize(
    "w1_roles, w2_roles",
    [
        ({"lokr_w1": (4, 6)}, {"lokr_w2": (8, 10)}),
        ({"lokr_w1_a": (4, 2), "lokr_w1_b": (2, 6)}, {"lokr_w2_a": (8, 3), "lokr_w2_b": (3, 10)}),
        ({"lokr_w1": (4, 6, 1, 1)}, {"lokr_w2_a": (8, 3), "lokr_w2_b": (3, 5, 3, 3)}),
        ({"lokr_w1": (4, 6)}, {"lokr_w2": (8, 5, 3, 3)}),
        ({"lokr_w1": (4, 6)}, {"lokr_t2": (3, 2, 3, 3), "lokr_w2_a": (3, 8), "lokr_w2_b": (2, 5)}),
    ],
    ids=["full", "low-rank", "conv-low-rank", "conv-full", "tucker"],
)
def test_lokr_squared_norm_equals_formed_kron(w1_roles, w2_roles):
    g = torch.Generator().manual_seed(1)
    tensors = {k: torch.randn(*s, generator=g) for k, s in (w1_roles | w2_roles).items()}
    f = lokr.load(tensors, {k: k for k in tensors})
    if "lokr_t2" in tensors:  # Tucker w2[p, q, ...] = Σ t2[i, j, ...]·w2_a[i, p]·w2_b[j, q]
        t2, wa, wb = (tensors[k].double() for k in ("lokr_t2", "lokr_w2_a", "lokr_w2_b"))
        w2 = torch.einsum("ij...,ip,jq->pq...", t2, wa, wb)
    elif "lokr_w2" in tensors:
        w2 = tensors["lokr_w2"]
    else:
        w2 = (tensors["lokr_w2_a"].double() @ tensors["lokr_w2_b"].double().flatten(1)).reshape(8, -1)
    w1 = tensors.get("lokr_w1")
    if w1 is None:
        w1 = tensors["lokr_w1_a"].double() @ tensors["lokr_w1_b"].double()
    delta = _kron(w1, w2)
    assert delta.shape[0] == f.rows == 32
    for src, length in [(0, 32), (0, 8), (3, 11), (8, 16), (31, 1)]:  # whole, w1-aligned, straddling chunks
        want = float(delta[src : src + length].square().sum())
        assert lokr.squared_norm(f, src, length) == pytest.approx(want, rel=1e-12), (src, length)


def _lokr_energy(path: Path) -> float:
    """Σ‖γ·kron(w1, w2)‖² over the file's keys, γ = alpha / w1 rank (LyCORIS), in fp64, through
    ‖kron(A, B)‖_F = ‖A‖_F·‖B‖_F on whole formed halves (forming every layer's kron here takes ~30 s)."""
    sd = load_file(path)
    total = 0.0
    for key in sd:
        if key.endswith(".lokr_w1_a"):
            name = key[: -len(".lokr_w1_a")]
            w1 = sd[f"{name}.lokr_w1_a"].double() @ sd[f"{name}.lokr_w1_b"].double()
            w2 = sd[f"{name}.lokr_w2_a"].double() @ sd[f"{name}.lokr_w2_b"].double().flatten(1)
            gamma = float(sd[f"{name}.alpha"]) / sd[f"{name}.lokr_w1_a"].shape[1]
            total += gamma**2 * float(w1.square().sum()) * float(w2.square().sum())
    return total


def test_heatmap_of_real_lokr_forms_no_layer_sized_delta(realdata):
    """The real 350-layer SD1 LoKr: no tensor as large as the smallest layer it touches (320 x 320) is made
    (main formed each layer's kron, up to 1280 x 11520), and the cells hold the file's ΔW energy."""
    path = realdata / "lora" / LOKR_FILE
    with LargestTensor() as seen:
        grid = block_grid(path)
    assert grid.architecture == "sd1" and not grid.skipped
    assert seen.most < 320 * 320, seen.most
    total = sum(v * v for row in grid.values for v in row if v is not None)
    assert total == pytest.approx(_lokr_energy(path), rel=1e-9)


def test_formed_heatmap_norm_works_in_bounded_blocks(tmp_path):
    """A LoHa (no factor-norm formula) on SD1's mid ff.net.2 (1280 x 5120): ΔW formed FORMED_BLOCK elements at
    a time, and its norm that of the whole ΔW formed here in fp64."""
    g = torch.Generator().manual_seed(2)
    name = "lora_unet_mid_block_attentions_0_transformer_blocks_0_ff_net_2"
    shapes = {"hada_w1_a": (1280, 4), "hada_w1_b": (4, 5120), "hada_w2_a": (1280, 4), "hada_w2_b": (4, 5120)}
    w = {k: torch.randn(*s, generator=g) * 0.1 for k, s in shapes.items()}
    path = tmp_path / "loha.safetensors"
    save_file({f"{name}.{k}": v for k, v in w.items()} | {f"{name}.alpha": torch.tensor(2.0)}, path)
    delta = (w["hada_w1_a"].double() @ w["hada_w1_b"].double()) * (
        w["hada_w2_a"].double() @ w["hada_w2_b"].double()
    )
    with LargestTensor() as seen:
        grid = block_grid(path, arch="sd1")
    cells = [v for row in grid.values for v in row if v is not None]
    assert cells == [pytest.approx(float(delta.norm()) * 2.0 / 4, rel=1e-6)]
    assert seen.most <= FORMED_BLOCK < math.prod(delta.shape), seen.most
