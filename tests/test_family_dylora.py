"""DyLoRA files (LyCORIS `dylora`, kohya `networks/dylora.py`): LoRA keys whose conv `lora_up` is 2-D (out,
r).

A DyLoRA file holds `lora_down.weight` (r, in[, k, k]), `lora_up.weight` and `alpha`. Both trainers
concatenate the per-rank up blocks along dim 1 and save the result as is, so for a 3x3 conv `lora_up` is (out,
r), not (out, r, 1, 1) as a LoCon up is. Read as LoRA: ΔW = (alpha/r)·up @ down, times the strength.

References:
- an independent fp64 formula on a hand-made file (Linear + Conv2d 3x3, saved to and applied from
  .safetensors);
- LyCORIS 4.x's wrapped forward on a file LyCORIS creates and saves (the file is read back only by loraweave:
  LyCORIS's create_lycoris_from_weights crashes on dylora). DyLoRA's forward draws a random rank on every call
  (training or not, `eval()` does not stop it), so the test pins it to the full rank through LyCORIS's own
  `get_weight(rank)`, and uses block_size 1: at full rank LyCORIS scales by alpha/block_count, which is
  alpha/r only when a block is one rank (see test_lycoris_full_rank_scale_is_per_block).
Tolerances: rel. error = max|ours - ref| / max|ref| <= 1e-5 on layer outputs and on the adapter's share of
them; merged weights against the fp64 reference <= 1e-6.
"""

from __future__ import annotations

import copy

import lycoris  # the reference must be installed: a missing package fails here, it is never skipped
import pytest
import torch
import torch.nn.functional as F
from helpers.common import gen, outputs, randn_inputs, rel_err, write_preset
from safetensors.torch import load_file, save_file
from torch import nn

import loraweave

TOL = 1e-5
STRENGTHS = (1.0, 0.5, -1.0)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(20, 24)
        self.conv = nn.Conv2d(6, 10, 3, stride=2, padding=1)


def inputs() -> dict[str, torch.Tensor]:
    return randn_inputs({"lin": (3, 5, 20), "conv": (2, 6, 9, 7)})


@torch.no_grad()
def reference(pristine: Net, sd: dict[str, torch.Tensor], s: float, xs: dict[str, torch.Tensor]):
    """fp64 W' = W + s·(alpha/r)·up @ down (up (out, r) even for the conv) and the layer outputs with it."""
    weights, outs = {}, {}
    for name in ("lin", "conv"):
        module = pristine.get_submodule(name)
        down = sd[f"lycoris_{name}.lora_down.weight"].double()
        up = sd[f"lycoris_{name}.lora_up.weight"].double()
        rank = down.shape[0]
        gamma = float(sd[f"lycoris_{name}.alpha"]) / rank
        w = module.weight.double()
        weights[name] = w + s * gamma * (up.reshape(up.shape[0], rank) @ down.reshape(rank, -1)).view_as(w)
        x, b = xs[name].double(), module.bias.double()
        outs[name] = (
            F.linear(x, weights[name], b)
            if name == "lin"
            else F.conv2d(x, weights[name], b, stride=2, padding=1)
        )
    return weights, outs


def check(pristine: Net, source, sd: dict[str, torch.Tensor], refs=None, strengths=STRENGTHS) -> None:
    """merge and runtime at each strength: every key lands, outputs match the fp64 formula (and `refs` when
    given, per strength), merged weights match it, runtime equals merge, remove() restores the layers bit for
    bit."""
    xs = inputs()
    base = outputs(pristine, xs)
    for s in strengths:
        ref_w, ref = reference(pristine, sd, s, xs)
        got = {}
        for mode in ("merge", "runtime"):
            model = copy.deepcopy(pristine)
            handle = loraweave.apply(model, source, mode=mode, strength=s)
            report = handle.report
            assert report.unmatched == [], [(u["key"], u["reason"]) for u in report.unmatched]
            assert report.keys_applied == report.keys_total == len(sd) == 6, report.summary()
            got[mode] = outputs(model, xs)
            for name in xs:
                ours = got[mode][name]
                assert rel_err(ref[name] - base[name], base[name]) > 0.05, (
                    f"{name}: adapter has no visible effect"
                )
                assert rel_err(ours, ref[name]) <= TOL, (mode, s, name, rel_err(ours, ref[name]))
                assert rel_err(ours - base[name], ref[name] - base[name]) <= TOL, (mode, s, name)
                if refs is not None:
                    assert rel_err(ours, refs[s][name]) <= TOL, (mode, s, name, "vs LyCORIS forward")
                    assert rel_err(ours - base[name], refs[s][name] - base[name]) <= TOL, (mode, s, name)
                if mode == "merge":
                    assert rel_err(model.get_submodule(name).weight, ref_w[name]) <= 1e-6, (s, name)
            handle.remove()
            for name, out in outputs(model, xs).items():
                assert torch.equal(out, base[name]), f"{mode}: remove() did not restore {name}"
        for name in xs:
            assert rel_err(got["runtime"][name], got["merge"][name]) <= TOL, (s, name)


# ------------------------------------------------------------------------ hand-made file, independent formula


def hand_made(pristine: Net) -> dict[str, torch.Tensor]:
    """DyLoRA as both trainers save it: per-rank blocks concatenated, conv 3x3 up left 2-D (out, r)."""
    g = gen(2)
    sd = {}
    for name, rank, alpha in (("lin", 6, 3.0), ("conv", 4, 1.5)):  # gamma 0.5 and 0.375
        w = pristine.get_submodule(name).weight
        down = torch.randn(rank, *w.shape[1:], generator=g) / w[0].numel() ** 0.5
        up_blocks = [torch.randn(w.shape[0], 1, generator=g) for _ in range(rank)]  # kohya unit 1
        sd[f"lycoris_{name}.lora_down.weight"] = down
        sd[f"lycoris_{name}.lora_up.weight"] = torch.cat(up_blocks, dim=1)
        sd[f"lycoris_{name}.alpha"] = torch.tensor(alpha)
    assert sd["lycoris_conv.lora_up.weight"].shape == (10, 4)
    return sd


@pytest.mark.parametrize("source", ["file", "state_dict"])
def test_hand_made_dylora_matches_formula(tmp_path, source):
    pristine = Net()
    sd = hand_made(pristine)
    path = tmp_path / "dylora.safetensors"
    save_file(sd, str(path))
    parsed = loraweave.load_adapter(str(path))
    assert parsed.unparsed == [] and {p.family for p in parsed.parts} == {"lora"}
    check(pristine, str(path) if source == "file" else sd, sd)


def test_conv_up_2d_equals_4d():
    """The 2-D conv up and the usual (out, r, 1, 1) one are the same adapter: identical merged weights."""
    pristine = Net()
    sd = hand_made(pristine)
    sd4 = dict(sd, **{"lycoris_conv.lora_up.weight": sd["lycoris_conv.lora_up.weight"][:, :, None, None]})
    merged = []
    for state in (sd, sd4):
        model = copy.deepcopy(pristine)
        loraweave.apply(model, state, mode="merge", strength=0.5, strict=True)
        merged.append(model.conv.weight.detach().clone())
    assert torch.equal(merged[0], merged[1])
    assert not torch.equal(merged[0], pristine.conv.weight)


# ------------------------------------------------------------------------ LyCORIS-created file, wrapped
# forward


def lycoris_dylora(tmp_path, block_size: int):
    """(pristine, wrapped model, network, saved path): LyCORIS dylora on lin (r 4, alpha 2) and conv (r 4,
    alpha 1), random blocks (LyCORIS zero-inits up), forward pinned to the full rank (otherwise random on
    every call)."""
    preset = write_preset(tmp_path / "p.toml", ("Linear", "Conv2d"))
    pristine = Net()
    wrapped = copy.deepcopy(pristine)
    net = lycoris.create_lycoris(
        wrapped,
        1.0,
        linear_dim=4,
        linear_alpha=2.0,
        conv_dim=4,
        conv_alpha=1.0,
        algo="dylora",
        block_size=block_size,
        preset=preset,
    )
    assert sorted(m.lora_name for m in net.loras) == ["lycoris_conv", "lycoris_lin"]
    g = gen(3)
    with torch.no_grad():
        for m in net.loras:
            assert type(m).__name__ == "DyLoraModule" and m.block_size == block_size
            for p in m.down_list:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            for p in m.up_list:
                p.copy_(torch.randn(p.shape, generator=g))
            # LyCORIS's own rank API: get_weight(rank) uses blocks 0..ceil(rank/bs), so lora_dim - bs is all
            # of them
            m.get_random_rank_weight = lambda m=m: m.get_weight(m.lora_dim - m.block_size)
    net.apply_to()
    net.eval()
    path = tmp_path / "dylora.safetensors"
    net.save_weights(str(path), dtype=torch.float32, metadata=None)
    return pristine, wrapped, net, path


def lycoris_outputs(wrapped: nn.Module, net, xs) -> dict[float, dict[str, torch.Tensor]]:
    refs = {}
    for s in STRENGTHS:
        net.set_multiplier(s)
        refs[s] = outputs(wrapped, xs)
        again = outputs(wrapped, xs)
        assert all(torch.equal(refs[s][n], again[n]) for n in xs), "LyCORIS forward is not deterministic"
    return refs


def test_matches_lycoris_wrapped_forward(tmp_path, lycoris_state):
    pristine, wrapped, net, path = lycoris_dylora(tmp_path, block_size=1)
    sd = load_file(str(path))
    assert sorted(sd) == sorted(
        f"lycoris_{n}.{r}" for n in ("lin", "conv") for r in ("alpha", "lora_down.weight", "lora_up.weight")
    )
    assert sd["lycoris_conv.lora_up.weight"].shape == (10, 4)  # 2-D for the 3x3 conv
    assert sd["lycoris_conv.lora_down.weight"].shape == (4, 6, 3, 3)
    refs = lycoris_outputs(wrapped, net, inputs())
    check(pristine, str(path), sd, refs=refs)


def test_lycoris_full_rank_scale_is_per_block(tmp_path, lycoris_state):
    """LyCORIS's DyLoRA forward scales by alpha/(blocks in use), not alpha/r: with block_size 2 and rank 4 its
    full-rank output change is twice the file's LoRA reading. Ours reads the file as LoRA (alpha/r), as
    kohya's DyLoRA does at full rank (scale·sqrt(r/r)) and as every LoRA loader does; this pins the
    divergence."""
    pristine, wrapped, net, path = lycoris_dylora(tmp_path, block_size=2)
    xs = inputs()
    base = outputs(pristine, xs)
    refs = lycoris_outputs(wrapped, net, xs)
    model = copy.deepcopy(pristine)
    loraweave.apply(model, str(path), mode="merge", strict=True)
    got = outputs(model, xs)
    for name in xs:
        assert rel_err(2 * (got[name] - base[name]), refs[1.0][name] - base[name]) <= TOL, name
