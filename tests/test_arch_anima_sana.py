"""Original-name tables for Anima (Cosmos-Predict2 + LLM adapter), Sana and ERNIE-Image, each against
diffusers.

Per architecture (as tests/test_arch_ltx_layouts.py):
1. the converter is the oracle for names: every original name of a converter-derived key list lands on the
   module (and, across pipeline components, the component) the converter maps it to, on the full-size meta
   model;
2. merged and runtime outputs equal diffusers' converter + PEFT (`load_lora_adapter`) on a tiny model (fp32,
   1e-5);
3. negative controls: a swapped table row makes (1) fail.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from helpers.arch_layouts import _anima, anima_file, linears, lora_file, sana_original
from helpers.common import rel_err
from helpers.registry import patch_tables
from helpers.tiny_configs import ANIMA_DIT, ANIMA_DIT_TINY, ERNIE_TINY, SANA_TINY

import loraweave
from loraweave.arch.aliases import AliasTable
from loraweave.formats.keys import DENOISER, parse_key, split_stem, underscore_form

ANIMA_CONDITIONER_TINY = dict(
    source_dim=8, target_dim=12, model_dim=16, num_layers=2, num_attention_heads=2, target_vocab_size=32
)


def _anima_convert(sd):
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_anima_lora_to_diffusers

    return _convert_non_diffusers_anima_lora_to_diffusers(dict(sd))


def component_targets(convert, sd: dict) -> dict[str, tuple[str, str]]:
    """{file stem: (component, live module)} as diffusers' converter maps them, one key at a time."""
    out = {}
    for key in sd:
        if ".lora_A." in key:
            (converted,) = convert({key: sd[key]})
            component, module = converted.removesuffix(".lora_A.weight").split(".", 1)
            out[key.removesuffix(".lora_A.weight")] = (component, module)
    return out


def landed(tables: dict[str, AliasTable], stem: str) -> tuple[str, list[str]]:
    """(component, modules) where our key parser and the components' alias tables put a file stem."""
    target = split_stem(stem)
    component = "transformer" if target.component == DENOISER else target.component
    found = tables[component].lookup(target.path) if component in tables else None
    return component, [p.module for p in found] if isinstance(found, tuple) else []


def alias_tables(parts: dict) -> dict[str, AliasTable]:
    return {name: AliasTable(model) for name, model in parts.items()}


def assert_lands_on_components(parts: dict, sd: dict, targets: dict[str, tuple[str, str]]):
    report = loraweave.plan(parts, sd)
    assert report.unmatched == [] and report.keys_applied == report.keys_total == len(sd)
    tables = alias_tables(parts)
    wrong = {
        stem: (found, want)
        for stem, want in targets.items()
        if (found := landed(tables, stem)) != (want[0], [want[1]])
    }
    assert not wrong, list(wrong.items())[:3]


def module_inputs(parts: dict, seed: int = 9) -> dict[tuple[str, str], torch.Tensor]:
    """A random input for every Linear and 1x1 Conv2d of every component."""
    g = torch.Generator().manual_seed(seed)
    xs = {}
    for component, model in parts.items():
        for name, m in model.named_modules():
            if type(m) is torch.nn.Linear:
                xs[component, name] = torch.randn(3, m.in_features, generator=g)
            elif type(m) is torch.nn.Conv2d and m.kernel_size == (1, 1) and m.groups == 1:
                xs[component, name] = torch.randn(1, m.in_channels, 2, 2, generator=g)
    return xs


def assert_components_match_peft(parts: dict, sd: dict, converted: dict):
    """Every Linear/1x1 conv output: ours (merge, runtime) vs the converted keys loaded by PEFT per
    component."""
    refs = {}
    for name, model in parts.items():
        refs[name] = copy.deepcopy(model)
        if any(k.startswith(f"{name}.") for k in converted):
            refs[name].load_lora_adapter(converted, prefix=name, adapter_name="ref")
    assert_outputs_match(parts, sd, refs, {c for c in parts if any(k.startswith(f"{c}.") for k in converted)})


def assert_outputs_match(parts: dict, sd: dict, refs: dict, changed: set[str], wrap=dict):
    """Ours (merge, runtime; applied to `wrap(copy of parts)`) vs reference components, module by module."""
    xs = module_inputs(parts)
    with torch.no_grad():
        expected = {(c, n): refs[c].get_submodule(n)(x) for (c, n), x in xs.items()}
        assert changed == {
            c for (c, n), x in xs.items() if not torch.equal(expected[c, n], parts[c].get_submodule(n)(x))
        }
    for mode in ("merge", "runtime"):
        ours = copy.deepcopy(parts)
        report = loraweave.apply(wrap(ours), sd, mode=mode, strict=True).report
        assert {m.component for m in report.applied} == changed
        with torch.no_grad():
            worst = max(rel_err(ours[c].get_submodule(n)(x), expected[c, n]) for (c, n), x in xs.items())
        assert worst <= 1e-5, (mode, worst)


def kohya_form(sd: dict) -> dict[str, torch.Tensor]:
    """sd-scripts' Anima names: `lora_unet_` + the flattened original name (llm_adapter included),
    lora_down/up."""
    out = {}
    for key, value in sd.items():
        stem, role = key.removeprefix("diffusion_model.").rsplit(".lora_", 1)
        role = role.replace("A.weight", "down.weight").replace("B.weight", "up.weight")
        out[f"lora_unet_{stem.replace('.', '_')}.lora_{role}"] = value
    return out


def test_anima_full_size_lands_where_the_converter_says():
    parts = _anima(True, ANIMA_DIT, {})
    sd = anima_file(parts, meta=True)
    targets = component_targets(_anima_convert, sd)
    assert {(c, m) for c, m in targets.values()} == {(c, m) for c in parts for m in linears(parts[c])}
    assert_lands_on_components(parts, sd, targets)
    # kohya (sd-scripts) spelling of the same file: same modules.
    kohya = kohya_form(sd)
    report = loraweave.plan(parts, kohya)
    assert report.unmatched == [] and {m.component for m in report.applied} == {
        "transformer",
        "text_conditioner",
    }
    flat = {f"lora_unet_{underscore_form(s.removeprefix('diffusion_model.'))}": t for s, t in targets.items()}
    tables = alias_tables(parts)
    wrong = {s: found for s, t in flat.items() if (found := landed(tables, s)) != (t[0], [t[1]])}
    assert not wrong, list(wrong.items())[:3]
    # The converter's only non-Linear rename, a norm: a full diff on it lands where the converter says.
    (norm,) = _anima_convert({"diffusion_model.t_embedding_norm.diff": torch.empty(2048, device="meta")})
    assert norm == "transformer.time_embed.norm.diff" and landed(
        tables, "diffusion_model.t_embedding_norm"
    ) == ("transformer", ["time_embed.norm"])
    # The DiT alone (no text_conditioner component): its keys land, the adapter's are typed misses.
    report = loraweave.plan(parts["transformer"], sd)
    assert {u["key"] for u in report.unmatched} == {k for k in sd if ".llm_adapter." in k}
    assert {u.kind for u in report.unmatched} == {"no_such_component"}
    assert not wrong, list(wrong.items())[:3]


def test_anima_matches_diffusers_and_peft():
    parts = _anima(False, ANIMA_DIT_TINY, ANIMA_CONDITIONER_TINY)
    assert "in_proj" in linears(parts["text_conditioner"])
    sd = anima_file(parts, meta=False)
    converted = _anima_convert(sd)
    assert_components_match_peft(parts, sd, converted)
    assert_components_match_peft(parts, kohya_form(sd), converted)


def _anima_pipeline(parts: dict):
    from diffusers.modular_pipelines import AnimaAutoBlocks

    pipe = AnimaAutoBlocks().init_pipeline()
    pipe.update_components(**parts)
    return pipe


def test_anima_pipeline_matches_load_lora_weights():
    """One file, DiT + LLM adapter, on diffusers' Anima pipeline: ours lands on its transformer and
    text_conditioner as the pipeline's own load_lora_weights (AnimaLoraLoaderMixin) does."""
    parts = _anima(False, ANIMA_DIT_TINY, ANIMA_CONDITIONER_TINY)
    sd = anima_file(parts, meta=False)
    reference = _anima_pipeline(copy.deepcopy(parts))
    reference.load_lora_weights(dict(sd), adapter_name="ref")
    refs = {c: getattr(reference, c) for c in parts}
    assert_outputs_match(parts, sd, refs, set(parts), wrap=_anima_pipeline)


def test_anima_swapped_rename_row_is_caught(monkeypatch):
    def swap(t):
        r = [
            ("self_attn.q_proj", "attn1.to_k")
            if o == "self_attn.q_proj"
            else ("self_attn.k_proj", "attn1.to_q")
            if o == "self_attn.k_proj"
            else (o, n)
            for o, n in t.renames
        ]
        return dataclasses.replace(t, renames=tuple(r))

    patch_tables(monkeypatch, lambda t: swap(t) if t.name == "anima" else t)
    parts = _anima(True, dict(ANIMA_DIT, num_layers=1), dict(num_layers=1))
    sd = anima_file(parts, meta=True)
    with pytest.raises(AssertionError):
        assert_lands_on_components(parts, sd, component_targets(_anima_convert, sd))


def _qwen3_06b():
    from transformers import Qwen3Config, Qwen3Model

    with torch.device("meta"):  # Qwen3-0.6B, Anima's text encoder
        return Qwen3Model(
            Qwen3Config(
                vocab_size=151936,
                hidden_size=1024,
                intermediate_size=3072,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
            )
        )


@pytest.mark.parametrize(
    "name",
    [
        "anima_lora_peft_format.json",
        "anima_lora_kohya_format.json",
        "anima_lora_kohya_with_te_format.json",
        "anima_lora_lokr_format.json",
    ],
)
def test_anima_real_key_names(name, realdata):
    """InvokeAI's Anima key lists (PEFT, kohya, kohya + Qwen3 encoder, LoKr + DoRA): every name lands on the
    module the converter (DiT) or Qwen3Model's own name (encoder) says. The files' shapes are hand-made, so
    only the names are real: tensors take the live modules' shapes."""
    parts = {**_anima(True, ANIMA_DIT, {}), "text_encoder": _qwen3_06b()}
    keys = json.loads((realdata / "keys" / "invokeai" / name).read_text())["keys"]
    dotted = component_targets(_anima_convert, anima_file(parts, meta=True))
    expected = {
        **{f"lora_unet_{underscore_form(s.removeprefix('diffusion_model.'))}": t for s, t in dotted.items()},
        **dotted,
        **{f"lora_te_{underscore_form(n)}": ("text_encoder", n) for n in linears(parts["text_encoder"])},
    }
    stems = {parse_key(k).stem for k in keys}
    assert stems <= set(expected), sorted(stems - set(expected))[:3]
    tables = alias_tables(parts)
    wrong = {s: found for s in stems if (found := landed(tables, s)) != (expected[s][0], [expected[s][1]])}
    assert not wrong, list(wrong.items())[:3]
    if "te" in name:
        assert {expected[s][0] for s in stems} == {"transformer", "text_encoder"}


def test_anima_qwen3_comfy_prefix_matches_kohya():
    """sd-scripts' convert_anima_lora_to_comfy writes the encoder as `text_encoder.qwen3.<Qwen3 name>`."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    te = Qwen3Model(
        Qwen3Config(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    ).eval()
    comfy = lora_file(linears(te), lambda n: f"text_encoder.qwen3.{n}")
    kohya = {
        f"lora_te_{k.removeprefix('text_encoder.qwen3.').rsplit('.lora_', 1)[0].replace('.', '_')}.lora_"
        f"{k.rsplit('.lora_', 1)[1].replace('A.', 'down.').replace('B.', 'up.')}": v
        for k, v in comfy.items()
    }
    results = []
    for sd in (comfy, kohya):
        model = copy.deepcopy(te)
        report = loraweave.apply(
            {"transformer": torch.nn.Linear(2, 2), "text_encoder": model}, sd, strict=True
        ).report
        assert report.counts() == {"text_encoder": {"merge": len(linears(te))}}
        results.append(model.state_dict())
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
    delta = (
        comfy["text_encoder.qwen3.layers.0.mlp.up_proj.lora_B.weight"]
        @ comfy["text_encoder.qwen3.layers.0.mlp.up_proj.lora_A.weight"]
    )
    assert (
        rel_err(
            results[0]["layers.0.mlp.up_proj.weight"] - te.state_dict()["layers.0.mlp.up_proj.weight"], delta
        )
        <= 1e-6
    )


def _sana(meta: bool, **config):
    import diffusers

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return diffusers.SanaTransformer2DModel(**config).eval()


def _sana_convert(checkpoint: dict) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_sana_transformer_to_diffusers

    return convert_sana_transformer_to_diffusers(dict(checkpoint))


def sana_row_map(model) -> dict[str, list[tuple[str, int, int, int]]]:
    """{original tensor: [(diffusers tensor, src_start, dst_start, length)]}, read off the converter's output
    by giving every row of every original tensor its own number (1-D tensors: cheap at full size)."""
    names: list[str] = []

    def tag(name, shape):
        names.append(name)
        return torch.arange(shape[0], dtype=torch.float64) + 1e6 * len(names)

    converted = _sana_convert(sana_original(model, tag))
    assert {k: tuple(v.shape[:1]) for k, v in converted.items()} == {
        k: tuple(v.shape[:1]) for k, v in model.state_dict().items()
    }
    out: dict[str, list] = {}
    for new, rows in converted.items():
        src = names[int(rows[0] // 1e6) - 1]
        start = int(rows[0] % 1e6)
        assert torch.equal(rows, torch.arange(len(rows), dtype=torch.float64) + rows[0])  # one contiguous run
        out.setdefault(src, []).append((new, start, 0, len(rows)))  # the converter fills whole tensors
    return {k: sorted(v, key=lambda r: r[1]) for k, v in out.items()}


def assert_sana_rows_are_the_converters(model):
    table = AliasTable(model)
    wrong = {}
    for src, runs in sana_row_map(model).items():
        stem, _, p = src.rpartition(".")
        if p == "bias":
            continue  # biases ride with their weight's pieces
        if p == "scale_shift_table":
            found = table.param(src)
            want = (runs[0][0], False)
        else:
            found = [(q.module, q.src_start, q.dst_start, q.length) for q in table.lookup(stem) or ()]
            want = [(n.removesuffix(".weight"), s, d, length) for n, s, d, length in runs]
        if found != want:
            wrong[src] = (found, want)
    assert not wrong, list(wrong.items())[:3]


def test_sana_full_size_rows_are_the_converters():
    """Every weight of the original checkpoint of the default (1600M) Sana lands on exactly the rows of the
    module convert_sana_transformer_to_diffusers puts it in; scale_shift_tables on their parameter."""
    model = _sana(True)
    assert_sana_rows_are_the_converters(model)
    table = AliasTable(model)  # kohya-flattened original names land on the same rows
    stems = {k.rpartition(".")[0] for k in sana_row_map(model) if k.endswith(".weight")}
    assert all(table.lookup(underscore_form(s)) == table.lookup(s) is not None for s in stems)


@pytest.mark.parametrize("swap", ["qkv", "kv", "conv"])
def test_sana_swapped_row_is_caught(monkeypatch, swap):
    def swapped(t):
        aliases = []
        for a in t.aliases:
            if swap == "qkv" and a.source.endswith(".attn.qkv"):
                a = dataclasses.replace(a, targets=(a.targets[1], a.targets[0], a.targets[2]))
            elif swap == "kv" and a.source.endswith(".kv_linear"):
                a = dataclasses.replace(a, targets=a.targets[::-1])
            elif swap == "conv" and a.source.endswith((".inverted_conv.conv", ".point_conv.conv")):
                a = dataclasses.replace(
                    a,
                    source=a.source.replace("inverted", "#")
                    .replace("point", "inverted")
                    .replace("#", "point"),
                )
            aliases.append(a)
        return dataclasses.replace(t, aliases=tuple(aliases))

    patch_tables(monkeypatch, lambda t: swapped(t) if t.name == "sana" else t)
    with pytest.raises(AssertionError):
        assert_sana_rows_are_the_converters(_sana(False, **SANA_TINY))


def sana_lora(model, seed: int = 3) -> tuple[dict, dict]:
    """(original-name LoRA on every Linear and 1x1 conv, its diffusers form). diffusers has no Sana LoRA
    converter: the reference gives each target the source's lora_A and the rows of lora_B the weight converter
    gives it."""
    g = torch.Generator().manual_seed(seed)
    weights = {
        k: v for k, v in sana_original(model, lambda n, s: torch.empty(s)).items() if k.endswith(".weight")
    }
    sd, converted = {}, {}
    for src, runs in sana_row_map(model).items():
        if (
            src not in weights
            or weights[src].dim() == 1
            or (weights[src].dim() == 4 and weights[src].shape[1:] != weights[src].shape[1:2] + (1, 1))
        ):
            continue  # norms and the depthwise 3x3 conv: no PEFT LoRA for them (full diffs cover them below)
        shape = weights[src].shape
        a = torch.randn(2, *shape[1:], generator=g)
        b = torch.randn(shape[0], 2, *shape[2:], generator=g) * 0.1
        stem = src.removesuffix(".weight")
        sd[f"diffusion_model.{stem}.lora_A.weight"], sd[f"diffusion_model.{stem}.lora_B.weight"] = a, b
        for new, start, _, length in runs:
            target = new.removesuffix(".weight")
            converted[f"transformer.{target}.lora_A.weight"] = a
            converted[f"transformer.{target}.lora_B.weight"] = b[start : start + length]
    return sd, converted


def test_sana_matches_diffusers_and_peft():
    model = _sana(False, **SANA_TINY)
    sd, converted = sana_lora(model)
    assert any(".kv_linear." in k for k in sd) and any(".inverted_conv.conv." in k for k in sd)
    assert_components_match_peft({"transformer": model}, sd, converted)


def test_sana_full_diffs_match_the_converter():
    """A full-difference file is an original checkpoint of deltas: the converter turns it into the diffusers
    deltas, which merging ours must add to every tensor (depthwise conv, norm, biases and scale_shift_tables
    too)."""
    model = _sana(False, **SANA_TINY)
    g = torch.Generator().manual_seed(5)
    deltas = sana_original(model, lambda n, s: torch.randn(s, generator=g))
    expected = _sana_convert(deltas)
    sd = {}
    for name, value in deltas.items():
        stem, _, p = name.rpartition(".")
        if name in ("pos_embed", "y_embedder.y_embedding"):
            continue  # the converter drops them: no diffusers tensor
        key = (
            f"diffusion_model.{name}.diff"
            if p == "scale_shift_table"
            else f"diffusion_model.{stem}.{'diff_b' if p == 'bias' else 'diff'}"
        )
        sd[key] = value
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loraweave.apply(model, sd, mode="merge", strict=True)
    after = model.state_dict()
    assert set(expected) == set(before)
    worst = max(rel_err(after[k] - before[k], expected[k]) for k in expected)
    assert worst <= 1e-6, worst


def _ernie(meta: bool, **config):
    import diffusers

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return diffusers.ErnieImageTransformer2DModel(**config).eval()


def _ernie_convert(sd):
    from diffusers.loaders.lora_pipeline import ErnieImageLoraLoaderMixin

    return ErnieImageLoraLoaderMixin.lora_state_dict(dict(sd))


@pytest.mark.parametrize("prefix", ["diffusion_model.", "base_model.model."])
def test_ernie_image_prefix_only_full_size(prefix):
    """ERNIE-Image LoRAs (AI-Toolkit, PEFT) use the diffusers module names behind a prefix:
    ErnieImageLoraLoaderMixin only swaps it for `transformer.`. Every Linear of the default-config model
    lands."""
    parts = {"transformer": _ernie(True)}
    sd = lora_file(linears(parts["transformer"]), lambda n: f"{prefix}{n}", meta=True)
    targets = component_targets(_ernie_convert, sd)
    assert {m for _, m in targets.values()} == set(linears(parts["transformer"]))
    assert_lands_on_components(parts, sd, targets)


def test_ernie_image_matches_diffusers_and_peft():
    model = _ernie(False, **ERNIE_TINY)
    for prefix in ("diffusion_model.", "base_model.model."):
        sd = lora_file(linears(model), lambda n, p=prefix: f"{p}{n}")
        assert_components_match_peft({"transformer": model}, sd, _ernie_convert(sd))


def test_ernie_image_without_the_prefix_row_is_caught(monkeypatch):
    from loraweave.formats import keys

    monkeypatch.setattr(
        keys, "_PREFIXES_BY_LENGTH", tuple(p for p in keys._PREFIXES_BY_LENGTH if p[0] != "diffusion_model.")
    )
    parts = {"transformer": _ernie(True, num_layers=1)}
    sd = lora_file(linears(parts["transformer"]), lambda n: f"diffusion_model.{n}", meta=True)
    with pytest.raises(AssertionError):
        assert_lands_on_components(parts, sd, component_targets(_ernie_convert, sd))


@pytest.mark.parametrize("to", ["kohya", "comfy", "diffusers"])
def test_anima_convert_keeps_the_text_conditioner(tmp_path, to):
    """convert wrote the text_conditioner's keys under the text encoder's kohya prefix (`lora_te_`, read back
    as the text encoder) and refused them in comfy; now each layout's own prefix (the DiT's llm_adapter), and
    the converted file merges to what the original merges to, on both components."""
    from safetensors.torch import save_file

    from loraweave.tools.convert import convert

    parts = _anima(False, ANIMA_DIT_TINY, ANIMA_CONDITIONER_TINY)
    src, out = tmp_path / "anima.safetensors", tmp_path / f"{to}.safetensors"
    save_file(anima_file(parts, meta=False), str(src))
    convert(src, to, out, target=parts)
    merged = []
    for path in (src, out):
        ours = copy.deepcopy(parts)
        report = loraweave.apply(ours, str(path), mode="merge", strict=True).report
        assert {m.component for m in report.applied} == {"transformer", "text_conditioner"}
        merged.append(ours)
    for c, model in parts.items():
        for n in linears(model):
            base = model.get_submodule(n).weight
            got, want = (m[c].get_submodule(n).weight - base for m in merged)
            assert rel_err(got, want) <= 1e-6, (c, n)
