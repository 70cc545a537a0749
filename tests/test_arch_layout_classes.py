"""Issue 41 item 2 (and 5): the key classes this year's files carry that did not land, each from a real key
list quoted from a public source, with shapes from the real model config.

1. MiniMax-H3's token refiner under split original names, both spellings: lightx2v's
   `token_refiner.refiner_blocks.N.attn.k_proj` (Wan2GP #2101, `minimax_h3_fl2v_turbo_4step_v0.1`) and
   Fizgig's half-flattened `token_refiner_blocks.N.attn.q_proj.lora_down.weight` (Wan2GP #2126).
2. LTX-2 text connectors in SimpleTuner's ComfyUI export
   (`diffusion_model.connectors.audio_connector.transformer_blocks.N.attn1.to_k`, SimpleTuner #2349) and the
   original projection `text_embedding_projection.aggregate_embed`: the pipeline's `connectors` component.
3. ai-toolkit's DoRA magnitude `<module>.magnitude` (`diffusion_model.blocks.N.attn.wq.magnitude` on Krea 2,
   issue 41; the suffix and its out-axis orientation: InvokeAI #9517, #9558): PEFT's DoRA on every
   architecture.
4. Mixed-rank files without alpha keys (diffusers #14409: `larryvrh/MiniMax-H3-Turbo-Lora`, ranks 64 on
   attention/FFN and 16 on AdaLN, no alpha): alpha = rank per module, scale 1, as kohya and PEFT read them.

Names: on the full-size meta model every key lands on the module the test's own inverse says (100 %).
Numbers: layer outputs against PEFT (`load_lora_adapter` on the diffusers names), fp32, rel. error <= 1e-5
merged and at runtime; mixed ranks also against an fp64 W + B·A. Hostile magnitudes end in typed errors,
the model unchanged.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers.arch_layouts import assert_matches_peft, h3_lora_names, linears
from helpers.arch_matrix import ARCHS
from helpers.common import rel_err
from helpers.registry import patch_tables
from helpers.tiny_configs import LTX2_TINY, TINY

import loraweave
from loraweave.arch.aliases import AliasTable
from loraweave.arch.detect import detect_architecture

TOL = 1e-5


def _diffusers(cls: str, meta: bool, **config):
    import diffusers

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return getattr(diffusers, cls)(**config)
    return getattr(diffusers, cls)(**config).eval()


def _pair(stem: str, rows: int, inp: int, g, down: str, up: str, meta: bool = False) -> dict:
    if meta:
        return {
            f"{stem}{down}": torch.empty(2, inp, device="meta"),
            f"{stem}{up}": torch.empty(rows, 2, device="meta"),
        }
    return {
        f"{stem}{down}": torch.randn(2, inp, generator=g),
        f"{stem}{up}": torch.randn(rows, 2, generator=g) * 0.1,
    }


PEFT = (".lora_A.weight", ".lora_B.weight")
KOHYA = (".lora_down.weight", ".lora_up.weight")


def assert_lands_on(model, sd: dict, where: dict[str, str], component: str | None = None):
    """Every key lands (plan), and each file stem's pieces are the whole live module `where` names."""
    report = loraweave.plan(model, sd)
    assert report.unmatched == [] and report.keys_applied == report.keys_total == len(sd), report.unmatched[
        :3
    ]
    target = model[component] if component else model
    table = AliasTable(target)
    traits = loraweave.load_adapter(sd).traits
    wrong = {}
    for path, live in where.items():
        found = table.lookup(path, traits)
        if not isinstance(found, tuple) or [(p.module, p.whole) for p in found] != [(live, True)]:
            wrong[path] = (found, live)
    assert not wrong, list(wrong.items())[:3]


# --- 1. MiniMax-H3 token refiner -------------------------------------------------------------------------

# Quoted from the issue threads (the error messages list the file's first keys).
WAN2GP_2101 = (  # lightx2v/Minimax-h3-Turbo, minimax_h3_fl2v_turbo_4step_v0.1.safetensors
    "token_refiner.refiner_blocks.0.attn.k_proj.lora_A.weight",
    "token_refiner.refiner_blocks.0.attn.k_proj.lora_B.weight",
    "token_refiner.refiner_blocks.0.attn.out_proj.lora_A.weight",
)
WAN2GP_2126 = (  # a Fizgig-trained H3 LoRA (kohya lora_down/lora_up, half-flattened names)
    "token_refiner_blocks.0.attn.out_proj.lora_down.weight",
    "token_refiner_blocks.0.attn.out_proj.lora_up.weight",
    "token_refiner_blocks.0.attn.q_proj.lora_down.weight",
    "blocks.0_adaln_proj_linear.lora_down.weight",
    "blocks.10_adaln_proj_linear.lora_up.weight",
)
# The test's own inverse: a refiner projection's split original name -> its diffusers module.
H3_SPLIT = {"attn.q_proj": "attn.to_q", "attn.k_proj": "attn.to_k", "attn.v_proj": "attn.to_v"}
H3_SPLIT_REST = {"attn.out_proj": "attn.to_out.0", "mlp.fc2": "ff.net.2"}
H3_TINY = dict(
    num_attention_heads=2,
    attention_head_dim=128,
    hidden_size=32,
    num_layers=2,
    num_refiner_layers=2,
    ffn_dim=16,
    in_channels=4,
    audio_in_channels=4,
    text_dim=24,
    freq_dim=16,
    time_embed_hidden_dim=32,
    time_embed_dim=16,
)


def h3_refiner_file(model, spelling: str, meta: bool = False, seed: int = 2) -> tuple[dict, dict, dict]:
    """(file, {file stem: live module}, PEFT reference on diffusers names) for every refiner projection in
    `spelling` ("lightx2v": dotted, lora_A/B; "fizgig": half-flattened, lora_down/up), plus the main blocks'
    AdaLN projection as Fizgig writes it. fc1 ([gate; value] -> diffusers' [value; gate]) is in the
    lightx2v file only (its spelling of the fused names)."""
    g = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    sd, where, ref = {}, {}, {}
    suffixes = PEFT if spelling == "lightx2v" else KOHYA
    names = {**H3_SPLIT, **H3_SPLIT_REST}
    for i in range(len(model.token_refiner.refiner_blocks)):
        stem = (
            f"token_refiner.refiner_blocks.{i}." if spelling == "lightx2v" else f"token_refiner_blocks.{i}."
        )
        live = f"token_refiner.refiner_blocks.{i}."
        for src, dst in (
            *names.items(),
            *((("mlp.fc1", "ff.net.0.proj"),) if spelling == "lightx2v" else ()),
        ):
            rows, inp = mods[live + dst].weight.shape
            pair = _pair(stem + src, rows, inp, g, *suffixes, meta=meta)
            sd.update(pair)
            if src != "mlp.fc1":
                where[stem + src] = live + dst
            if not meta:
                down, up = pair.values()
                up = torch.cat(up.chunk(2)[::-1]) if src == "mlp.fc1" else up
                (
                    ref[f"transformer.{live}{dst}.lora_A.weight"],
                    ref[f"transformer.{live}{dst}.lora_B.weight"],
                ) = down, up
    if spelling == "fizgig":
        for i in range(len(model.transformer_blocks)):
            live = f"transformer_blocks.{i}.adaln_proj.linear"
            rows, inp = mods[live].weight.shape
            pair = _pair(f"blocks.{i}_adaln_proj_linear", rows, inp, g, *suffixes, meta=meta)
            sd.update(pair)
            where[f"blocks.{i}_adaln_proj_linear"] = live
            if not meta:
                ref[f"transformer.{live}.lora_A.weight"], ref[f"transformer.{live}.lora_B.weight"] = (
                    pair.values()
                )
    return sd, where, ref


@pytest.mark.parametrize("spelling, quoted", [("lightx2v", WAN2GP_2101), ("fizgig", WAN2GP_2126)])
def test_h3_refiner_split_names_full_size(spelling, quoted):
    """The full-size model (diffusers' defaults: 2 refiner blocks, hidden 5376, 56 heads): every refiner
    projection in the trainer's spelling lands whole on its diffusers module; the quoted keys are among
    them, spelled exactly."""
    model = _diffusers("MiniMaxH3Transformer3DModel", True)
    sd, where, _ = h3_refiner_file(model, spelling, meta=True)
    assert set(quoted) <= set(sd), sorted(set(quoted) - set(sd))
    whole = dict(sd)
    if spelling == "lightx2v":  # its main blocks under the released names (Wan2GP expected those)
        for stem, (rows, inp) in h3_lora_names(model).items():
            if not stem.startswith("token_refiner."):
                whole.update(_pair(stem, rows, inp, None, *PEFT, meta=True))
        sd.update({k: v for k, v in whole.items() if k.startswith(("blocks.0.", "blocks.49."))})
    assert_lands_on(model, sd, where)  # two main blocks: planning every block adds ~10 s
    assert detect_architecture(loraweave.load_adapter(whole)).architecture == "minimax-h3"


@pytest.mark.parametrize("spelling", ["lightx2v", "fizgig"])
def test_h3_refiner_split_names_match_peft(spelling):
    model = _diffusers("MiniMaxH3Transformer3DModel", False, **H3_TINY)
    sd, _, ref = h3_refiner_file(model, spelling)
    assert_matches_peft(model, sd, ref)


def test_h3_refiner_swapped_split_row_is_caught(monkeypatch):
    """Negative control: the table's q_proj and k_proj swapped sends the quoted keys to the wrong module."""

    def swap(a):
        if a.source.endswith("attn.q_proj"):
            return dataclasses.replace(a, targets=(a.targets[0].replace("to_q", "to_k"),))
        if a.source.endswith("attn.k_proj"):
            return dataclasses.replace(a, targets=(a.targets[0].replace("to_k", "to_q"),))
        return a

    patch_tables(
        monkeypatch,
        lambda t: (
            dataclasses.replace(t, aliases=tuple(map(swap, t.aliases))) if t.name == "minimax-h3" else t
        ),
    )
    model = _diffusers("MiniMaxH3Transformer3DModel", True)
    sd, where, _ = h3_refiner_file(model, "lightx2v", meta=True)
    with pytest.raises(AssertionError):
        assert_lands_on(model, sd, where)


# --- 2. LTX-2 text connectors ------------------------------------------------------------------------------

SIMPLETUNER_2349 = (  # the module paths the thread's file trains (its converter's docstring lists them)
    "diffusion_model.connectors.audio_connector.transformer_blocks.{i}.attn1.to_{x}",
    "diffusion_model.connectors.video_connector.transformer_blocks.{i}.attn1.to_{x}",
)
CONNECTORS_TINY = dict(
    caption_channels=8,
    text_proj_in_factor=3,
    video_connector_num_attention_heads=2,
    video_connector_attention_head_dim=4,
    video_connector_num_layers=2,
    video_connector_num_learnable_registers=None,
    audio_connector_num_attention_heads=2,
    audio_connector_attention_head_dim=4,
    audio_connector_num_layers=2,
    audio_connector_num_learnable_registers=None,
)


def _connectors(meta: bool, **config):
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return LTX2TextConnectors(**config)
    return LTX2TextConnectors(**config).eval()


def connectors_file(connectors, meta: bool = False, seed: int = 5) -> tuple[dict, dict, dict]:
    """(file, {file stem: live module}, diffusers-named reference) for every Linear of the connectors: the
    connector stacks under `diffusion_model.connectors.`, the input projection under its original name."""
    g = torch.Generator().manual_seed(seed)
    sd, where, ref = {}, {}, {}
    for live, m in linears(connectors).items():
        if live == "text_proj_in":
            stem = "diffusion_model.text_embedding_projection.aggregate_embed"
        else:
            stem = f"diffusion_model.connectors.{live}"
        pair = _pair(stem, *m.weight.shape, g, *PEFT, meta=meta)
        sd.update(pair)
        where[stem.split(".", 2)[2] if live != "text_proj_in" else "aggregate_embed"] = live
        if not meta:
            ref[f"connectors.{live}.lora_A.weight"], ref[f"connectors.{live}.lora_B.weight"] = pair.values()
    return sd, where, ref


def test_ltx2_connectors_comfy_layout_full_size():
    """LTX-2's connectors at the released config (diffusers' defaults): the file's
    `diffusion_model.connectors.` keys and `text_embedding_projection.aggregate_embed` land on the
    `connectors` component only, 100 %."""
    connectors = _connectors(True)
    sd, where, _ = connectors_file(connectors, meta=True)
    quoted = {p.format(i=i, x=x) for p in SIMPLETUNER_2349 for i in (0, 1) for x in ("q", "k", "v", "out.0")}
    assert quoted <= {k.removesuffix(PEFT[0]) for k in sd}
    pipe = {
        "transformer": _diffusers("LTX2VideoTransformer3DModel", True, num_layers=1),
        "connectors": connectors,
    }
    report = loraweave.plan(pipe, sd)
    assert {m.component for m in report.applied} == {"connectors"}
    assert_lands_on(pipe, sd, where, component="connectors")


def test_ltx2_connectors_comfy_layout_match_peft():
    """Together with transformer keys in the same file: the connectors' keys change the connectors exactly as
    PEFT does on the diffusers names, the transformer's the transformer."""
    connectors = _connectors(False, **CONNECTORS_TINY)
    transformer = _diffusers("LTX2VideoTransformer3DModel", False, **LTX2_TINY)
    sd, _, ref = connectors_file(connectors)
    g = torch.Generator().manual_seed(6)
    for live, m in list(linears(transformer).items())[:4]:
        pair = _pair(f"diffusion_model.{live}", *m.weight.shape, g, *PEFT)
        sd.update(pair)
    xs = {n: torch.randn(3, m.in_features, generator=g) for n, m in linears(connectors).items()}
    want = copy.deepcopy(connectors)
    want.load_lora_adapter(ref, prefix="connectors", adapter_name="ref")
    for mode in ("merge", "runtime"):
        pipe = {"transformer": copy.deepcopy(transformer), "connectors": copy.deepcopy(connectors)}
        report = loraweave.apply(pipe, sd, mode=mode, strict=True).report
        assert {m.component for m in report.applied} == {"connectors", "transformer"}
        with torch.no_grad():
            worst = max(
                rel_err(pipe["connectors"].get_submodule(n)(x), want.get_submodule(n)(x))
                for n, x in xs.items()
            )
            moved = max(
                rel_err(connectors.get_submodule(n)(x), want.get_submodule(n)(x)) for n, x in xs.items()
            )
        assert worst <= TOL < moved, (mode, worst, moved)


# --- 3. ai-toolkit's DoRA `.magnitude` ---------------------------------------------------------------------

# Krea 2's original names (krea-ai, ComfyUI, ai-toolkit) -> diffusers, the test's own inverse of the table.
KREA2_ORIGINAL = {
    "attn.to_q": "attn.wq",
    "attn.to_k": "attn.wk",
    "attn.to_v": "attn.wv",
    "attn.to_out.0": "attn.wo",
    "attn.to_gate": "attn.gate",
    "ff.gate": "mlp.gate",
    "ff.up": "mlp.up",
    "ff.down": "mlp.down",
}


def krea2_original(live: str) -> str | None:
    head, _, tail = live.partition(".attn.") if ".attn." in live else live.partition(".ff.")
    tail = ("attn." if ".attn." in live else "ff.") + tail
    if not head.startswith("transformer_blocks.") or tail not in KREA2_ORIGINAL:
        return None
    return head.replace("transformer_blocks.", "blocks.") + "." + KREA2_ORIGINAL[tail]


def peft_dora(model, modules: list[str], seed: int = 3):
    """PEFT's own DoRA (use_dora=True, r 4, alpha 4) on `modules`, trained-looking factors and magnitudes:
    (the wrapped model, its state dict on the diffusers names: `lora_A.weight`, `lora_B.weight`,
    `lora_magnitude_vector`)."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    wrapped = inject_adapter_in_model(
        LoraConfig(r=4, lora_alpha=4, use_dora=True, target_modules=modules), copy.deepcopy(model)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in wrapped.named_parameters():
            if "lora_magnitude_vector" in n:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return wrapped, dict(get_peft_model_state_dict(wrapped))


def ai_toolkit(sd: dict, name_of, prefix: str) -> dict[str, torch.Tensor]:
    """ai-toolkit's file of a PEFT DoRA: `<prefix><name>.lora_A/B.weight` and `<prefix><name>.magnitude`."""
    out = {}
    for k, v in sd.items():
        module, _, suffix = k.rpartition(".lora_")
        suffix = "magnitude" if suffix == "magnitude_vector" else f"lora_{suffix}"
        out[f"{prefix}{name_of(module)}.{suffix}"] = v
    return out


def assert_dora_matches_peft(model, sd: dict, wrapped, modules: list[str], strengths=(1.0, 0.5)):
    """The adapted layers' outputs, ours (merge, runtime) against PEFT's DoRA layers (`set_scale` to the
    strength: PEFT puts it inside the norm)."""
    from peft.tuners.lora import LoraLayer

    g = torch.Generator().manual_seed(9)
    xs = {n: torch.randn(3, linears(model)[n].in_features, generator=g) for n in modules}
    for s in strengths:
        for layer in wrapped.modules():
            if isinstance(layer, LoraLayer):
                layer.set_scale("default", s)
        with torch.no_grad():
            expected = {n: wrapped.get_submodule(n)(xs[n]) for n in modules}
            assert min(rel_err(expected[n], model.get_submodule(n)(xs[n])) for n in modules) > 1e-3
        for mode in ("merge", "runtime"):
            ours = copy.deepcopy(model)
            report = loraweave.apply(ours, sd, mode=mode, strength=s, strict=True).report
            assert report.keys_applied == report.keys_total == len(sd)
            assert report.adapters[0]["families"] == {"dora": len(modules)}, report.adapters[0]["families"]
            with torch.no_grad():
                worst = max(rel_err(ours.get_submodule(n)(xs[n]), expected[n]) for n in modules)
            assert worst <= TOL, (mode, s, worst)


def test_krea2_ai_toolkit_magnitude_matches_peft():
    """The issue's key: `diffusion_model.blocks.N.attn.wq.magnitude`, on every attention and MLP projection
    of Krea 2's blocks (original names), equal to PEFT's DoRA at strengths 1 and 0.5."""
    model = TINY["krea2"]()
    live = [n for n in linears(model) if krea2_original(n)]
    wrapped, ref = peft_dora(model, live)
    sd = ai_toolkit(ref, krea2_original, "diffusion_model.")
    assert "diffusion_model.blocks.0.attn.wq.magnitude" in sd
    assert_dora_matches_peft(model, sd, wrapped, live)


def test_krea2_magnitude_full_size_lands():
    """At the released width (diffusers' defaults), every block projection's `.magnitude` lands with its pair
    (planning reads shapes only)."""
    model = _diffusers("Krea2Transformer2DModel", True)
    sd = {}
    for n, m in linears(model).items():
        if (name := krea2_original(n)) is not None:
            out, inp = m.weight.shape
            stem = f"diffusion_model.{name}"
            sd.update(_pair(stem, out, inp, None, *PEFT, meta=True))
            sd[f"{stem}.magnitude"] = torch.empty(out, device="meta")
    report = loraweave.plan(model, sd)
    assert report.unmatched == [] and report.keys_applied == report.keys_total == len(sd)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_ai_toolkit_magnitude_on_every_architecture(arch):
    """`.magnitude` is a family suffix, not an architecture's: on every architecture of the support matrix
    (diffusers names under `transformer.`, three Linears each) it is PEFT's DoRA, exactly; at strength 0.5,
    where PEFT's convention (strength inside the norm) and LyCORIS's `dora_scale` part."""
    model = ARCHS[arch]()
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model = model.float()
    live = [n for n, m in linears(model).items() if m.in_features > 1][:3]
    wrapped, ref = peft_dora(model, live)
    sd = ai_toolkit(ref, lambda n: n, "transformer.")
    assert_dora_matches_peft(model, sd, wrapped, live, strengths=(0.5,))  # 0.5: the convention shows


def _one_layer_dora(magnitude: torch.Tensor):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6))
    sd = {
        "0.lora_A.weight": torch.randn(2, 8),
        "0.lora_B.weight": torch.randn(6, 2),
        "0.magnitude": magnitude,
    }
    return model, sd


@pytest.mark.parametrize(
    "magnitude, why",
    [
        (torch.ones(7), "shape mismatch"),  # one row too many
        (torch.ones(1, 8), "shape mismatch"),  # LyCORIS's input-axis orientation: not PEFT's vector
        (torch.ones(6, 2), "shape mismatch"),
    ],
    ids=["rows+1", "input_axis", "two_dims"],
)
def test_hostile_magnitude_is_a_typed_error(tmp_path, magnitude, why):
    from safetensors.torch import save_file

    model, sd = _one_layer_dora(magnitude)
    path = tmp_path / "dora.safetensors"
    save_file(sd, str(path))
    before = copy.deepcopy(model.state_dict())
    report = loraweave.plan(model, str(path))
    assert [u["key"] for u in report.unmatched] and why in report.unmatched[0]["reason"], report.unmatched
    with pytest.raises(loraweave.StrictApplyError, match="shape_mismatch.* of dora") as err:
        loraweave.apply(model, str(path), mode="merge", strict=True)
    missed = err.value.report.unmatched
    assert {u["key"] for u in missed} == set(sd) and why in missed[0]["reason"], missed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_magnitude_without_its_pair_is_refused():
    model, sd = _one_layer_dora(torch.ones(6))
    del sd["0.lora_B.weight"]
    report = loraweave.plan(model, sd)
    assert report.keys_applied == 0 and all(u["kind"] == "incomplete" for u in report.unmatched), (
        report.unmatched
    )


# --- 4. HiDream-O1: named, not mapped ----------------------------------------------------------------------

WAN2GP_1831 = (  # bare names (Kijai's Dev-Distill LoRAs, a CivitAI LoRA)
    "final_layer2.linear.lora_A.weight",
    "final_layer2.linear.lora_B.weight",
    "language_model.layers.0.mlp.down_proj.lora_A.weight",
    "language_model.layers.0.mlp.down_proj.lora_B.weight",
)


@pytest.mark.parametrize("prefix", ["", "model."], ids=["wan2gp_1831", "modelscope_comfyui_14767"])
def test_hidream_o1_is_named_and_refused_elsewhere(prefix):
    """No diffusers class to land on: detection names the file (ModelScope's trainer writes `model.` in front,
    ComfyUI PR #14767), and a model of another architecture refuses it (no key lands), unchanged."""
    sd = {prefix + k: torch.zeros(2, 8) if "lora_A" in k else torch.zeros(8, 2) for k in WAN2GP_1831}
    assert detect_architecture(loraweave.load_adapter(sd)).architecture == "hidream-o1"
    model = ARCHS["qwen-image"]()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(loraweave.NoKeysLandedError, match="final_layer2.linear"):
        loraweave.apply(model, sd, mode="merge")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- 5. Mixed ranks without alpha keys ---------------------------------------------------------------------

# larryvrh/MiniMax-H3-Turbo-Lora as diffusers #14409 describes it: rank 64 on attention and FFN, 16 on the
# AdaLN projections (whose key sorts first), no alpha anywhere; the trainer states W' = W + B·A.
H3_RANKS = {"adaln_proj.linear": 16}


def mixed_rank_file(
    model, layout: str, seed: int = 4
) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(file, {live module: (B, A)}): every block Linear, rank 16 on AdaLN and 8 elsewhere (the tiny model's
    stand-in for 64), AdaLN first in key order; no `.alpha`, no metadata. layout: "peft" (transformer.,
    lora_A/B, diffusers names) or "kohya" (lora_unet_, lora_down/up)."""
    g = torch.Generator().manual_seed(seed)
    mods = sorted(
        ((n, m) for n, m in linears(model).items() if n.startswith("transformer_blocks.")),
        key=lambda nm: "adaln" not in nm[0],
    )
    sd, factors = {}, {}
    for live, m in mods:
        rank = 16 if "adaln_proj" in live else 8
        a = torch.randn(rank, m.in_features, generator=g)
        b = torch.randn(m.out_features, rank, generator=g) * 0.1
        factors[live] = (b, a)
        if layout == "peft":
            sd[f"transformer.{live}.lora_A.weight"], sd[f"transformer.{live}.lora_B.weight"] = a, b
        else:
            stem = "lora_unet_" + live.replace(".", "_")
            sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"] = a, b
    assert "adaln" in next(iter(sd))  # the minority rank first, as in the real file
    return sd, factors


@pytest.mark.parametrize("layout", ["peft", "kohya"])
def test_mixed_ranks_without_alpha_scale_one(tmp_path, layout):
    """Every module at scale 1 (alpha = its own rank): merged weights equal W + B·A in fp64 (<= 1e-6
    rel.), and layer outputs equal diffusers 0.42.1 + PEFT (`load_lora_adapter`, which mirrors the ranks
    into the alphas since #14409), <= 1e-5."""
    from safetensors.torch import save_file

    model = _diffusers("MiniMaxH3Transformer3DModel", False, **H3_TINY)
    sd, factors = mixed_rank_file(model, layout)
    assert {b.shape[1] for b, _ in factors.values()} == {8, 16}
    path = tmp_path / "mixed.safetensors"
    save_file(sd, str(path))
    ours = copy.deepcopy(model)
    report = loraweave.apply(ours, str(path), mode="merge", strict=True).report
    assert report.adapters[0]["alpha_sources"] == {"default:1": len(factors)}, report.adapters[0][
        "alpha_sources"
    ]
    for live, (b, a) in factors.items():
        want = model.get_submodule(live).weight.double() + b.double() @ a.double()
        assert rel_err(ours.get_submodule(live).weight, want) <= 1e-6, live
    peft_sd = {
        f"transformer.{live}.{n}.weight": t
        for live, (b, a) in factors.items()
        for n, t in (("lora_A", a), ("lora_B", b))
    }
    assert_matches_peft(model, sd, peft_sd)
