"""Patches of bare parameters: lightx2v/Lightning Wan `blocks.N.diff_m` (delta of the per-block modulation
table, diffusers `scale_shift_table`), `head.modulation.diff`, plus the module diffs those files carry
(`norm_k_img.diff`, `*.diff_b`), and Krea2's per-block `scale_shift_table` (stored flat as
`blocks.N.mod.lin`).

Reference: a copy of the model whose parameters are set by hand to (P.fp32 + s·ΔP).to(P.dtype) (and
weights/biases to W + s·ΔW). Merged and runtime outputs must equal it bit-exactly, after a strength change
too, and undo must give back every tensor bit-exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.tiny_configs import TINY, tiny_wan

import loraweave


def wan_inputs(model):
    g = torch.Generator().manual_seed(5)
    cfg = model.config
    xs = {
        "hidden_states": torch.randn(1, cfg.in_channels, 2, 4, 4, generator=g),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 512 if cfg.image_dim else 5, cfg.text_dim, generator=g),
    }
    if cfg.image_dim:
        xs["encoder_hidden_states_image"] = torch.randn(1, 3, cfg.image_dim, generator=g)
    return xs


def krea2_inputs(model):
    g = torch.Generator().manual_seed(5)
    cfg = model.config
    image, text = 4, 3
    pos = torch.zeros(text + image, 3)
    pos[text:, 1] = torch.arange(image) // 2
    pos[text:, 2] = torch.arange(image) % 2
    return {
        "hidden_states": torch.randn(1, image, cfg.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, text, cfg.num_text_layers, cfg.text_hidden_dim, generator=g),
        "timestep": torch.tensor([0.5]),
        "position_ids": pos,
    }


def run(model, xs):
    with torch.no_grad():
        return model(**xs, return_dict=False)[0]


def _rnd(g, *shape):
    return torch.randn(*shape, generator=g) * 0.05


def lightx2v_file(model, modules: bool = False) -> tuple[dict, dict]:
    """(file, {live tensor name: delta}) in lightx2v's Wan spelling."""
    g = torch.Generator().manual_seed(11)
    state = model.state_dict()
    sd, live = {}, {}
    for i in range(model.config.num_layers):
        sd[f"diffusion_model.blocks.{i}.diff_m"] = live[f"blocks.{i}.scale_shift_table"] = _rnd(
            g, 1, 6, model.config.num_attention_heads * model.config.attention_head_dim
        )
    sd["diffusion_model.head.modulation.diff"] = live["scale_shift_table"] = _rnd(
        g, *state["scale_shift_table"].shape
    )
    if model.config.image_dim:  # I2V only
        sd["diffusion_model.blocks.0.cross_attn.norm_k_img.diff"] = live[
            "blocks.0.attn2.norm_added_k.weight"
        ] = _rnd(g, *state["blocks.0.attn2.norm_added_k.weight"].shape)
    if modules:  # module diffs lightx2v files also carry (bias and weight deltas: dense runtime terms)
        sd["diffusion_model.blocks.1.self_attn.q.diff_b"] = live["blocks.1.attn1.to_q.bias"] = _rnd(
            g, *state["blocks.1.attn1.to_q.bias"].shape
        )
        sd["diffusion_model.head.head.diff"] = live["proj_out.weight"] = _rnd(
            g, *state["proj_out.weight"].shape
        )
    return sd, live


def krea2_file(model, modules: bool = False) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(11)
    state = model.state_dict()
    sd, live = {}, {}
    for i in range(model.config.num_layers):
        delta = _rnd(g, *state[f"transformer_blocks.{i}.scale_shift_table"].shape)
        sd[f"diffusion_model.blocks.{i}.mod.lin.diff"] = delta.flatten()  # the original stores it flat
        live[f"transformer_blocks.{i}.scale_shift_table"] = delta
    sd["diffusion_model.last.modulation.lin.diff"] = live["final_layer.scale_shift_table"] = _rnd(
        g, *state["final_layer.scale_shift_table"].shape
    )
    return sd, live


def reference(model, live: dict, s: float):
    ref = copy.deepcopy(model)
    state = ref.state_dict()
    with torch.no_grad():
        for name, delta in live.items():
            p = state[name]
            p.copy_((p.float() + s * delta.float()).to(p.dtype))
    return ref


CASES = {
    "wan-i2v": (lambda: tiny_wan(True), wan_inputs, lightx2v_file),
    "krea2": (TINY["krea2"], krea2_inputs, krea2_file),
}


def test_lightx2v_file_with_module_diffs_merged_and_runtime():
    """The whole lightx2v spelling at once; module diffs at runtime are dense extra terms (fp32, 1e-5 rel)."""
    base = tiny_wan(True).eval()
    xs = wan_inputs(base)
    sd, live = lightx2v_file(base, modules=True)
    expected = run(reference(copy.deepcopy(base), live, 1.0), xs)
    for mode in ("merge", "runtime"):
        with loraweave.apply(base, sd, mode=mode, strict=True) as h:
            assert h.report.keys_applied == len(sd) == 1 + 2 + 3
            out = run(base, xs)
            assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()
            if mode == "merge":
                assert torch.equal(out, expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_parameter_patches_merge_runtime_strength_undo_bit_exact(case):
    build, inputs, make = CASES[case]
    base = build().eval()
    pristine = copy.deepcopy(base)
    xs = inputs(base)
    sd, live = make(base)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    expected = {s: run(reference(pristine, live, s), xs) for s in (1.0, -0.5)}
    assert not torch.equal(expected[1.0], run(base, xs))  # the patch changes the output
    for mode in ("merge", "runtime"):
        h = loraweave.apply(base, sd, mode=mode, strict=True)
        rep = h.report.to_dict()
        assert rep["keys_applied"] == rep["keys_total"] == len(sd)
        params = {m["module"] for m in rep["applied"] if any(n.startswith("parameter ") for n in m["notes"])}
        # The report names each parameter; a norm's 1-D weight is patched the same way.
        assert {p for p in live if "scale_shift_table" in p or "norm" in p} == params
        assert all(m["mechanism"] == mode for m in rep["applied"])
        assert torch.equal(run(base, xs), expected[1.0])
        h.set_strength(next(iter(h.strengths)), -0.5)
        assert torch.equal(run(base, xs), expected[-0.5])
        h.remove()
        assert all(torch.equal(v, original[k]) for k, v in base.state_dict().items())
        assert all(type(p) is torch.nn.Parameter for p in base.parameters())


def test_runtime_leaves_the_stored_parameter_alone_and_stacks():
    base = tiny_wan(False).eval()
    xs = wan_inputs(base)
    sd, live = lightx2v_file(base)
    stored = base.blocks[0].scale_shift_table.detach().clone()
    ref = reference(reference(base, live, 1.0), live, 2.0)
    h1 = loraweave.apply(base, sd, mode="runtime")
    h2 = loraweave.apply(base, {k: 2 * v for k, v in sd.items()}, mode="runtime")
    assert torch.equal(base.blocks[0].scale_shift_table, stored)
    assert isinstance(base.blocks[0].scale_shift_table, torch.nn.Parameter)
    both = run(base, xs)
    assert (both - run(ref, xs)).abs().max() <= 1e-6 * run(ref, xs).abs().max()
    h2.remove()
    h1.remove()
    assert base.blocks[0]._forward_pre_hooks == {} and base.blocks[0]._forward_hooks == {}


def test_shape_mismatch_is_reported_and_the_model_untouched():
    base = tiny_wan(False)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    rep = loraweave.plan(base, {"diffusion_model.blocks.0.diff_m": torch.zeros(1, 5, 32)})
    assert (
        rep.unmatched[0]["reason"].startswith("shape mismatch")
        and "blocks.0.scale_shift_table" in rep.unmatched[0]["reason"]
    )
    assert all(torch.equal(v, before[k]) for k, v in base.state_dict().items())


def test_diff_m_on_full_size_wan_meta_resolves():
    import diffusers

    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(num_layers=40, num_attention_heads=40, ffn_dim=13824)
    sd = {f"diffusion_model.blocks.{i}.diff_m": torch.empty(1, 6, 5120, device="meta") for i in range(40)}
    rep = loraweave.plan(model, sd)
    assert rep.unmatched == [] and len(rep.applied) == 40


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_block_weights_scale_parameter_patches_by_their_owning_block(mode):
    """A parameter takes the block weight of the module holding it (`blocks.N.scale_shift_table`: slot BNN;
    the root's `scale_shift_table`: BASE), as a module's weight does; merge and runtime alike."""
    base = tiny_wan(False).eval()
    pristine = copy.deepcopy(base)
    xs = wan_inputs(base)
    sd, live = lightx2v_file(base)
    weights = {"BASE": 0.5, "B00": 0.0, "B01": 2.0}
    spec = loraweave.AdapterSpec(sd, -0.5, block_weights=weights, name="a")  # powers of 2: bit-exact
    # independent of the slot table: the block index is read off the live parameter's path by hand
    scale = {"blocks.0.scale_shift_table": 0.0, "blocks.1.scale_shift_table": 2.0, "scale_shift_table": 0.5}
    assert set(scale) == set(live)
    expected = reference(pristine, {k: scale[k] * v for k, v in live.items()}, -0.5)
    with loraweave.apply(base, spec, mode=mode, strict=True) as h:
        assert h.report.keys_applied == len(sd)
        out, ref = run(base, xs), run(expected, xs)
        assert (out - ref).abs().max() <= 1e-6 * ref.abs().max()
        if mode == "merge":
            state, want = base.state_dict(), expected.state_dict()
            assert all(torch.equal(state[k], want[k]) for k in live)
