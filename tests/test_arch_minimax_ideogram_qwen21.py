"""Original-name tables of MiniMax-H3, Ideogram4 and Qwen-Image 2.1, each against diffusers' own converter.

Per architecture:
1. the converter is the oracle for names and rows: on the full-size meta model every original name lands 100
   %, and every row of every key lands on the live module and row the converter sends it to (checked with a
   row-index `lora_B`: row r holds the value r);
2. merged and runtime outputs of every Linear equal diffusers' converter + PEFT on a tiny model (fp32, 1e-5
   rel.);
3. negative controls: a swapped table row makes (1) fail.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers.arch_layouts import (
    assert_matches_peft,
    h3_lora_names,
    ideogram4_lora_names,
    linears,
    qwen21_lora_names,
)
from helpers.common import rel_err
from helpers.registry import patch_tables

import loraweave
from loraweave.arch.aliases import AliasTable


def _model(cls: str, meta: bool, **config):
    import diffusers

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return getattr(diffusers, cls)(**config)
    return getattr(diffusers, cls)(**config).eval()


def lora_from_shapes(shapes: dict, name_of, rank: int = 2, seed: int = 3, infix: str = "") -> dict:
    """{file key: tensor} for {original stem: (rows, in)}; `name_of(stem)` writes the key's stem."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for stem, (rows, inp) in shapes.items():
        sd[f"{name_of(stem)}.lora_A{infix}.weight"] = torch.randn(rank, inp, generator=g)
        sd[f"{name_of(stem)}.lora_B{infix}.weight"] = torch.randn(rows, rank, generator=g) * 0.1
    return sd


def row_index_file(shapes: dict, name_of, infix: str = "") -> dict:
    """Rank-1 LoRAs whose `lora_B` row r holds r: where a row lands says which source row it was."""
    return {
        k: v
        for stem, (rows, inp) in shapes.items()
        for k, v in (
            (f"{name_of(stem)}.lora_A{infix}.weight", torch.zeros(1, inp)),
            (f"{name_of(stem)}.lora_B{infix}.weight", torch.arange(rows, dtype=torch.float32)[:, None]),
        )
    }


def converter_rows(converted: dict, prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    """{live module: source row of each of its rows} from a converted row-index file."""
    return {
        k.removeprefix(prefix).removesuffix(".lora_B.weight"): v[:, 0]
        for k, v in converted.items()
        if k.endswith(".lora_B.weight")
    }


def table_rows(model, sd: dict) -> dict[str, torch.Tensor]:
    """The same map by loraweave's table: every source row of every part, placed where its pieces say."""
    adapter = loraweave.load_adapter(sd)
    table = AliasTable(model)
    out: dict[str, torch.Tensor] = {}
    for part in adapter.parts:
        for p in table.lookup(part.path, adapter.traits):
            rows = out.setdefault(p.module, torch.full((table.modules[p.module].out_features,), -1.0))
            rows[p.dst_start : p.dst_start + p.length] = torch.arange(p.src_start, p.src_start + p.length)
    return out


def assert_rows_match_converter(model, sd: dict, converted: dict, modules: set[str]):
    """Names and rows: loraweave plans every key, and each lands on the converter's module rows, nothing
    else."""
    report = loraweave.plan(model, sd)
    assert report.unmatched == [] and report.keys_applied == report.keys_total == len(sd)
    ours, theirs = table_rows(model, sd), converter_rows(converted)
    assert set(theirs) == modules and set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))[:4]
    wrong = [m for m in theirs if not torch.equal(ours[m], theirs[m])]
    assert not wrong, wrong[:4]


def swap_in_table(monkeypatch, name: str, swap):
    patch_tables(
        monkeypatch,
        lambda t: dataclasses.replace(t, aliases=tuple(swap(a) for a in t.aliases)) if t.name == name else t,
    )


# --- MiniMax-H3
# -------------------------------------------------------------------------------------------------

H3_TINY = dict(
    num_attention_heads=2,
    attention_head_dim=128,
    hidden_size=32,
    num_layers=2,
    num_refiner_layers=1,
    ffn_dim=16,
    in_channels=4,
    audio_in_channels=4,
    text_dim=24,
    freq_dim=16,
    time_embed_hidden_dim=32,
    time_embed_dim=16,
)


def _h3_convert(sd):
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers

    return _convert_non_diffusers_minimax_h3_lora_to_diffusers(dict(sd))


def musubi(sd: dict) -> dict:
    """musubi-tuner: `lora_unet_` + the dotted path flattened, lora_down/lora_up."""
    return {
        "lora_unet_"
        + k.split(".lora_")[0].replace(".", "_")
        + {"A": ".lora_down.weight", "B": ".lora_up.weight"}[k.split(".lora_")[1][0]]: v
        for k, v in sd.items()
    }


@pytest.mark.parametrize("form", ["bare", "diffusion_model", "musubi", "diffsynth"])
def test_minimax_h3_full_size_rows_match_the_converter(form):
    """Every original name of the full-size model (50 blocks, 2 refiner blocks, 56 heads), in each producer's
    spelling; DiffSynth's per-head interleaved QKV lands de-interleaved, fc1's halves swapped."""
    model = _model("MiniMaxH3Transformer3DModel", True)
    prefix = "diffusion_model." if form == "diffusion_model" else ""
    sd = row_index_file(
        h3_lora_names(model), lambda s: prefix + s, infix=".default" if form == "diffsynth" else ""
    )
    sd = musubi(sd) if form == "musubi" else sd
    assert (loraweave.load_adapter(sd).traits == {"diffsynth"}) == (form == "diffsynth")
    assert_rows_match_converter(model, sd, _h3_convert(sd), set(linears(model)))


@pytest.mark.parametrize("form", ["bare", "diffsynth"])
def test_minimax_h3_matches_diffusers_and_peft(form):
    model = _model("MiniMaxH3Transformer3DModel", False, **H3_TINY)
    sd = lora_from_shapes(h3_lora_names(model), lambda s: s, infix=".default" if form == "diffsynth" else "")
    assert_matches_peft(model, sd, _h3_convert(sd))


def test_minimax_h3_runtime_holds_one_pair_per_part():
    """DiffSynth's QKV lands as one row chunk per head (and fc1 as two halves); the runtime path still holds
    the file's rank-r pair once per layer, not once per chunk (heads x r)."""
    from loraweave.streaming.factors import runtime_paths

    model = _model("MiniMaxH3Transformer3DModel", False, **dict(H3_TINY, num_attention_heads=4))
    sd = lora_from_shapes(h3_lora_names(model), lambda s: s, infix=".default")
    loraweave.apply(model, sd, mode="runtime", strict=True)
    ranks = {id(p.module): p.down.shape[0] for p in runtime_paths(model)}
    for name in (
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.1.attn.to_v",
        "transformer_blocks.0.ff.net.0.proj",
    ):
        assert ranks[id(model.get_submodule(name))] == 2, name


def test_minimax_h3_alpha_tensors_fold_as_the_converter():
    """Kohya `.alpha` (musubi-tuner) is alpha / rank, which the converter folds into the factors."""
    model = _model("MiniMaxH3Transformer3DModel", False, **H3_TINY)
    sd = musubi(lora_from_shapes(h3_lora_names(model), lambda s: s, rank=4))
    sd.update(
        {
            k.split(".lora_")[0] + ".alpha": torch.tensor(2.0)
            for k in list(sd)
            if k.endswith("lora_down.weight")
        }
    )
    assert_matches_peft(model, sd, _h3_convert(sd))


def _mixed_rank_file(model) -> dict:
    """Rank 4 on attention/FFN, rank 2 on the AdaLN projections (published H3 LoRAs mix ranks like this)."""
    shapes = h3_lora_names(model)
    sd = lora_from_shapes({s: v for s, v in shapes.items() if "adaln" not in s}, lambda s: s, rank=4)
    sd.update(
        lora_from_shapes({s: v for s, v in shapes.items() if "adaln" in s}, lambda s: s, rank=2, seed=8)
    )
    return sd


@pytest.mark.parametrize("metadata", [{"alpha": "2"}, {}])
def test_minimax_h3_metadata_alpha_as_diffusers_loader(tmp_path, metadata):
    """A file without `.alpha` tensors: `__metadata__["alpha"]` is every module's network alpha (γ = alpha /
    rank, mixed ranks), else γ = 1. The reference is diffusers' MiniMax-H3 loader (its lora_state_dict +
    metadata) + PEFT."""
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin
    from safetensors.torch import save_file

    model = _model("MiniMaxH3Transformer3DModel", False, **H3_TINY)
    path = tmp_path / "h3.safetensors"
    save_file(_mixed_rank_file(model), str(path), metadata=metadata)
    converted, peft_metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(path), return_lora_metadata=True)
    assert (peft_metadata is None) == (not metadata)
    ref = copy.deepcopy(model)
    ref.load_lora_adapter(converted, prefix="transformer", adapter_name="ref", metadata=peft_metadata)
    names = list(linears(model))
    g = torch.Generator().manual_seed(9)
    xs = {n: torch.randn(3, linears(model)[n].in_features, generator=g) for n in names}
    ours = copy.deepcopy(model)
    report = loraweave.apply(ours, str(path), mode="merge", strict=True).report
    assert report.adapters[0]["alpha_sources"] == {
        "metadata:alpha" if metadata else "default:1": len(h3_lora_names(model))
    }
    with torch.no_grad():
        worst = max(rel_err(ours.get_submodule(n)(xs[n]), ref.get_submodule(n)(xs[n])) for n in names)
    assert report.keys_applied == report.keys_total and worst <= 1e-5, worst


@pytest.mark.parametrize("arch", [None, "minimax"])
def test_minimax_h3_resize_keeps_the_metadata_alpha(tmp_path, arch):
    """resize folds γ = alpha / rank from `__metadata__["alpha"]` (it wrote γ = 1: the resized file was 2/rank
    off), with the architecture detected or given by a catalog alias (read by name, "minimax" missed the
    table). Full rank (4, the file's highest), so the resized file must merge to what the original merges
    to."""
    from safetensors.torch import save_file

    from loraweave.tools.resize import resize

    model = _model("MiniMaxH3Transformer3DModel", False, **H3_TINY)
    path, out = tmp_path / "h3.safetensors", tmp_path / "resized.safetensors"
    save_file(_mixed_rank_file(model), str(path), metadata={"alpha": "2"})
    resize(path, out, rank=4, arch=arch)
    merged = {}
    for name, source in (("original", path), ("resized", out)):
        merged[name] = copy.deepcopy(model)
        report = loraweave.apply(merged[name], str(source), mode="merge", strict=True).report
        assert report.keys_applied == report.keys_total
    for n, layer in linears(model).items():
        want, got = merged["original"].get_submodule(n).weight, merged["resized"].get_submodule(n).weight
        assert rel_err(got - layer.weight, want - layer.weight) <= 1e-5, n


def test_minimax_h3_metadata_alpha_not_a_number_is_refused(tmp_path):
    from safetensors.torch import save_file

    model = _model("MiniMaxH3Transformer3DModel", False, **H3_TINY)
    path = tmp_path / "h3.safetensors"
    save_file(_mixed_rank_file(model), str(path), metadata={"alpha": "sixteen"})
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(loraweave.errors.AdapterMetadataError, match="'alpha'") as err:
        loraweave.apply(model, str(path), mode="merge")
    assert str(path) in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    from loraweave.tools.resize import resize

    out = tmp_path / "resized.safetensors"
    with pytest.raises(
        loraweave.errors.AdapterMetadataError, match="'alpha'"
    ) as err:  # resize reads it alike
        resize(path, out, rank=2)
    assert str(path) in str(err.value) and not out.exists()


def test_minimax_h3_partitions():
    """`transformer` by default; `transformer_ref` when it is the only partition, when the keys say so, or
    with component_strengths (diffusers' load_into_transformer_ref=True)."""
    t, ref = (_model("MiniMaxH3Transformer3DModel", True, **H3_TINY) for _ in range(2))
    sd = lora_from_shapes(h3_lora_names(t), lambda s: f"diffusion_model.{s}")
    both = {"transformer": t, "transformer_ref": ref}

    def adapter_keys(adapter):
        return adapter.source if isinstance(adapter, loraweave.AdapterSpec) else adapter

    def landed(target, adapter):
        report = loraweave.plan(target, adapter)
        assert report.unmatched == [] and report.keys_applied == report.keys_total == len(
            adapter_keys(adapter)
        )
        return {m.component for m in report.applied}

    assert landed(both, sd) == {"transformer"}
    assert landed({"transformer_ref": ref}, sd) == {"transformer_ref"}
    assert landed(both, loraweave.AdapterSpec(sd, component_strengths={"transformer_ref": 1.0})) == {
        "transformer_ref"
    }
    converted = {k.replace("transformer.", "transformer_ref.", 1): v for k, v in _h3_convert(sd).items()}
    assert landed(both, converted) == {"transformer_ref"}


def test_minimax_h3_swapped_rows_are_caught(monkeypatch):
    """Negative controls: fc1's halves not swapped, and DiffSynth's QKV read as stacked."""
    model = _model("MiniMaxH3Transformer3DModel", True, num_layers=2)
    sd = row_index_file(h3_lora_names(model), lambda s: s)
    diffsynth = row_index_file(h3_lora_names(model), lambda s: s, infix=".default")
    with monkeypatch.context() as m:
        swap_in_table(
            m,
            "minimax-h3",
            lambda a: dataclasses.replace(a, targets=a.targets[::-1]) if a.source.endswith("mlp.fc1") else a,
        )
        with pytest.raises(AssertionError):
            assert_rows_match_converter(model, sd, _h3_convert(sd), set(linears(model)))
    with monkeypatch.context() as m:
        swap_in_table(
            m, "minimax-h3", lambda a: dataclasses.replace(a, interleave=None) if a.interleave else a
        )
        with pytest.raises(AssertionError):
            assert_rows_match_converter(model, diffsynth, _h3_convert(diffsynth), set(linears(model)))


# --- Ideogram4
# --------------------------------------------------------------------------------------------------

IDEOGRAM4_TINY = dict(
    in_channels=8,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    intermediate_size=32,
    adaln_dim=16,
    llm_features_dim=24,
    mrope_section=(2, 1, 1),
)


def _ideogram4_convert(sd):
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ideogram4_lora_to_diffusers

    return _convert_non_diffusers_ideogram4_lora_to_diffusers(dict(sd))


def kohya_dotted(sd: dict) -> dict:
    """The converter's kohya form: dotted original names, lora_down/lora_up, `.alpha` (here alpha / rank =
    0.5)."""
    out = {k.replace(".lora_A.", ".lora_down.").replace(".lora_B.", ".lora_up."): v for k, v in sd.items()}
    out.update(
        {
            k.split(".lora_A.")[0] + ".alpha": torch.tensor(float(v.shape[0]) / 2)
            for k, v in sd.items()
            if ".lora_A." in k
        }
    )
    return out


def _ideogram4_blocks(model) -> set[str]:
    return {n for n in linears(model) if n.startswith("layers.")}


@pytest.mark.parametrize("prefix", ["diffusion_model.", "conditional_transformer.", ""])
def test_ideogram4_full_size_rows_match_the_converter(prefix):
    model = _model("Ideogram4Transformer2DModel", True)
    sd = row_index_file(ideogram4_lora_names(model), lambda s: prefix + s)
    assert_rows_match_converter(model, sd, _ideogram4_convert(sd), _ideogram4_blocks(model))
    kohya = {
        "lora_unet_"
        + k.removeprefix(prefix).split(".lora_")[0].replace(".", "_")
        + ".lora_"
        + k.split(".lora_")[1]: v
        for k, v in sd.items()
    }
    assert loraweave.plan(model, kohya).unmatched == []  # flattened too (no converter reads this form)


@pytest.mark.parametrize("kohya", [False, True])
def test_ideogram4_matches_diffusers_and_peft(kohya):
    model = _model("Ideogram4Transformer2DModel", False, **IDEOGRAM4_TINY)
    sd = lora_from_shapes(ideogram4_lora_names(model), lambda s: f"diffusion_model.{s}", rank=4)
    sd = kohya_dotted(sd) if kohya else sd
    assert_matches_peft(model, sd, _ideogram4_convert(sd))


def test_ideogram4_swapped_row_is_caught(monkeypatch):
    model = _model("Ideogram4Transformer2DModel", True, num_layers=2)
    sd = row_index_file(ideogram4_lora_names(model), lambda s: f"diffusion_model.{s}")
    swap_in_table(
        monkeypatch,
        "ideogram4",
        lambda a: (
            dataclasses.replace(a, targets=(a.targets[1], a.targets[0], a.targets[2]))
            if a.source.endswith(".qkv")
            else a
        ),
    )
    with pytest.raises(AssertionError):
        assert_rows_match_converter(model, sd, _ideogram4_convert(sd), _ideogram4_blocks(model))


# --- Qwen-Image 2.1
# ---------------------------------------------------------------------------------------------

QWEN21_TINY = dict(
    in_channels=8,
    out_channels=8,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    context_in_dim=16,
    axes_dims_rope=(2, 2, 4),
)


def _qwen21_convert(sd: dict) -> dict:
    """A LoRA converter made of diffusers' single-file converter: it runs on each `lora_B` (the split is a row
    operation) with `lora_A` shared, the way every LoRA converter of a fused checkpoint tensor works."""
    from diffusers.loaders.single_file_utils import (
        convert_qwen_image21_transformer_checkpoint_to_diffusers as convert,
    )

    out = {}
    for key, value in sd.items():
        module, _, role = key.partition(".lora_")
        module, role = (
            module.removeprefix("model.").removeprefix("diffusion_model."),
            role.replace(".default", ""),
        )
        if role.startswith("B"):
            for live, v in convert({f"{module}.weight": value}).items():
                out[f"transformer.{live.removesuffix('.weight')}.lora_B.weight"] = v
        else:
            for live in ("gate_layer", "proj") if module.endswith("gate_up") else (None,):
                stem = module.replace("gate_up", live) if live else module
                out[f"transformer.{stem}.lora_A.weight"] = value
    return out


@pytest.mark.parametrize("form", ["model.diffusion_model.", "diffusion_model.", "diffsynth"])
def test_qwen21_full_size_rows_match_the_converter(form):
    model = _model("QwenImage21Transformer2DModel", True)
    prefix = "" if form == "diffsynth" else form
    sd = row_index_file(
        qwen21_lora_names(model), lambda s: prefix + s, infix=".default" if form == "diffsynth" else ""
    )
    assert any(".gate_up." in k for k in sd)
    assert_rows_match_converter(model, sd, _qwen21_convert(sd), set(linears(model)))
    if form == "diffusion_model.":  # kohya-flattened too (no converter reads this form)
        kohya = {
            "lora_unet_"
            + k.removeprefix(form).split(".lora_")[0].replace(".", "_")
            + ".lora_"
            + k.split(".lora_")[1]: v
            for k, v in sd.items()
        }
        ours, flat = table_rows(model, sd), table_rows(model, kohya)
        assert flat.keys() == ours.keys() and all(torch.equal(flat[m], ours[m]) for m in ours)


@pytest.mark.parametrize("form", ["comfy", "diffsynth"])
def test_qwen21_matches_diffusers_and_peft(form):
    model = _model("QwenImage21Transformer2DModel", False, **QWEN21_TINY)
    if form == "comfy":
        sd = lora_from_shapes(qwen21_lora_names(model), lambda s: f"diffusion_model.{s}")
    else:  # DiffSynth: diffusers names, peft's `default` adapter name, no prefix
        sd = lora_from_shapes(
            {n: tuple(m.weight.shape) for n, m in linears(model).items()}, lambda s: s, infix=".default"
        )
    assert_matches_peft(model, sd, _qwen21_convert(sd))


def test_qwen21_swapped_row_is_caught(monkeypatch):
    model = _model("QwenImage21Transformer2DModel", True, num_layers=2)
    sd = row_index_file(qwen21_lora_names(model), lambda s: f"diffusion_model.{s}")
    swap_in_table(monkeypatch, "qwenimage21", lambda a: dataclasses.replace(a, targets=a.targets[::-1]))
    with pytest.raises(AssertionError):
        assert_rows_match_converter(model, sd, _qwen21_convert(sd), set(linears(model)))
