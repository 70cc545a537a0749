"""Z-Image SwiGLU w1/w3 fused by runtimes in either row order: the order is proven by the model's own output,
then LoRAs for the separate projections land on the fused rows (and fused-module LoRAs on the separate
ones)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention import FeedForward
from helpers.common import gen, rel_err
from helpers.tiny_models import tiny_zimage, zimage_forward

import loraweave


class W13FeedForward(torch.nn.Module):
    """A runtime's fused SwiGLU: one `w13` projection, first half gated (silu(w1 x) * w3 x)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> None:
        super().__init__()
        self.w13 = torch.nn.Linear(w1.shape[1], 2 * w1.shape[0], bias=False)
        self.w2 = torch.nn.Linear(w2.shape[1], w2.shape[0], bias=False)
        with torch.no_grad():
            self.w13.weight.copy_(torch.cat([w1, w3]))
            self.w2.weight.copy_(w2)

    def forward(self, x):
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)


def _swiglu_feedforward(w1, w2, w3) -> FeedForward:
    """diffusers FeedForward(swiglu) as Nunchaku builds it: net.0.proj rows are [w3; w1]."""
    ff = FeedForward(
        w1.shape[1], dim_out=w2.shape[0], inner_dim=w1.shape[0], activation_fn="swiglu", bias=False
    )
    with torch.no_grad():
        ff.net[0].proj.weight.copy_(torch.cat([w3, w1]))
        ff.net[2].weight.copy_(w2)
    return ff


FUSERS = {"swiglu_net0": _swiglu_feedforward, "w13": W13FeedForward}


def _blocks(model):
    return [
        (f"{stack}.{i}", blk)
        for stack in ("layers", "noise_refiner", "context_refiner")
        for i, blk in enumerate(getattr(model, stack))
    ]


def _fused(model, kind: str):
    out = copy.deepcopy(model)
    for _, blk in _blocks(out):
        ff = blk.feed_forward
        blk.feed_forward = FUSERS[kind](ff.w1.weight.detach(), ff.w2.weight.detach(), ff.w3.weight.detach())
    return out


def _ffn_lora(model, prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    g = gen(11)
    sd = {}
    for stem, blk in _blocks(model):
        for proj in ("w1", "w2", "w3"):
            w = getattr(blk.feed_forward, proj).weight
            sd[f"{prefix}{stem}.feed_forward.{proj}.lora_A.weight"] = (
                torch.randn(4, w.shape[1], generator=g) * 0.3
            )
            sd[f"{prefix}{stem}.feed_forward.{proj}.lora_B.weight"] = (
                torch.randn(w.shape[0], 4, generator=g) * 0.3
            )
    return sd


@pytest.fixture(scope="module")
def base():
    return tiny_zimage()


@pytest.mark.parametrize("kind", sorted(FUSERS))
def test_fused_row_order_is_the_models_computation(base, kind):
    with torch.no_grad():
        assert rel_err(zimage_forward(_fused(base, kind)), zimage_forward(base)) <= 1e-6


@pytest.mark.parametrize("mode", ["merge", "runtime"])
@pytest.mark.parametrize("kind", sorted(FUSERS))
def test_separate_w1_w3_keys_land_on_fused_rows(base, kind, mode):
    sd = _ffn_lora(base)
    ref = copy.deepcopy(base)
    loraweave.apply(ref, sd, mode="merge", strict=True)
    fused = _fused(base, kind)
    handle = loraweave.apply(fused, sd, mode=mode, strict=True)
    fused_names = {m.module for m in handle.report.applied}
    assert all(".w1" not in n and ".w3" not in n or ".w13" in n for n in fused_names)
    assert len(fused_names) == 2 * len(_blocks(base))  # one fused projection + w2 per block
    with torch.no_grad():
        effect = (zimage_forward(ref) - zimage_forward(base)).abs().max()
        assert effect > 1e-3  # the LoRA changes the output, so the comparison below can fail
        assert rel_err(zimage_forward(fused), zimage_forward(ref)) <= 1e-5
    handle.remove()


@pytest.mark.parametrize("kind", sorted(FUSERS))
def test_fused_module_keys_split_onto_separate_w1_w3(base, kind):
    """A LoRA trained on the fused projection lands on an unfused model with the same effect."""
    fused = _fused(base, kind)
    name = "net.0.proj" if kind == "swiglu_net0" else "w13"
    out_name = "net.2" if kind == "swiglu_net0" else "w2"
    g = gen(5)
    sd = {}
    for stem, blk in _blocks(fused):
        for proj in (name, out_name):
            w = blk.feed_forward.get_submodule(proj).weight
            sd[f"diffusion_model.{stem}.feed_forward.{proj}.lora_down.weight"] = (
                torch.randn(4, w.shape[1], generator=g) * 0.3
            )
            sd[f"diffusion_model.{stem}.feed_forward.{proj}.lora_up.weight"] = (
                torch.randn(w.shape[0], 4, generator=g) * 0.3
            )
    ref = copy.deepcopy(fused)
    loraweave.apply(ref, sd, mode="merge", strict=True)
    unfused = copy.deepcopy(base)
    loraweave.apply(unfused, sd, mode="merge", strict=True)
    with torch.no_grad():
        assert rel_err(zimage_forward(unfused), zimage_forward(ref)) <= 1e-5
