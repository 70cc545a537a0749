"""`loraweave bake`: merged checkpoint == apply(mode="merge") bit for bit; atomic output; metadata of what was
baked."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import loraweave
from loraweave.arguments import parse_adapter_arg
from loraweave.cli import main
from loraweave.tools import bake as bake_mod
from loraweave.tools.bake import bake
from loraweave.tools.bake_record import file_sha256

sys.path.insert(0, str(Path(__file__).parent))
from helpers.tiny_models import tiny_flux  # noqa: E402


def flux_lora(seed: int, rank: int = 4, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Mixed-layout LoRA on the tiny Flux (hidden 32): a fused kohya qkv, a diffusers key, a kohya single
    block."""
    g = torch.Generator().manual_seed(seed)

    def pair(prefix: str, rows: int, cols: int, alpha: float | None, kohya: bool) -> dict[str, torch.Tensor]:
        down, up = torch.randn(rank, cols, generator=g) * 0.3, torch.randn(rows, rank, generator=g) * 0.3
        names = (".lora_down.weight", ".lora_up.weight") if kohya else (".lora_A.weight", ".lora_B.weight")
        out = {prefix + names[0]: down.to(dtype), prefix + names[1]: up.to(dtype)}
        if alpha is not None:
            out[prefix + ".alpha"] = torch.tensor(alpha)
        return out

    sd = {}
    sd.update(pair("lora_unet_double_blocks_0_img_attn_qkv", 96, 32, 8.0, True))
    sd.update(pair("lora_unet_single_blocks_1_linear2", 32, 32 + 128, 2.0, True))
    sd.update(pair("transformer.transformer_blocks.1.ff.net.2", 32, 128, None, False))
    return sd


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("ckpt")
    model = tiny_flux(seed=3).to(torch.bfloat16)
    model.save_pretrained(root / "transformer", max_shard_size="60KB", safe_serialization=True)
    shards = list((root / "transformer").glob("*.safetensors"))
    assert len(shards) >= 3 and list((root / "transformer").glob("*.index.json"))
    return root / "transformer", model


def _folder_state(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_bake_sharded_equals_apply_merge(sharded, tmp_path):
    folder, model = sharded
    lora_a, lora_b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(flux_lora(1), lora_a)
    save_file(flux_lora(2), lora_b)
    out = tmp_path / "baked"
    res = bake(folder, [(str(lora_a), 0.7), (str(lora_b), -1.25)], out)
    assert res.keys_applied == res.keys_total == 16 and not res.unmatched
    reference = copy.deepcopy(model)
    loraweave.apply(reference, [(str(lora_a), 0.7), (str(lora_b), -1.25)], mode="merge", strict=True)
    baked = _folder_state(out)
    expected = reference.state_dict()
    assert set(baked) == set(expected)
    changed = [k for k in expected if not torch.equal(expected[k], model.state_dict()[k])]
    assert len(changed) == 5 and res.tensors_changed == 5  # q, k, v + linear2 (proj_out) + ff.net.2
    for k, v in expected.items():
        assert torch.equal(baked[k], v), k
    # Same shard layout, index kept, configs copied; metadata records what was baked.
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in folder.iterdir())
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:  # every shard's header holds the record
        meta = json.loads(f.metadata()["loraweave.baked"])
    assert [a["strength"] for a in meta["adapters"]] == [0.7, -1.25]
    assert meta["adapters"][0]["sha256"] == file_sha256(lora_a) and meta["version"] == loraweave.__version__
    index = json.loads(next(out.glob("*.index.json")).read_text())
    assert index["weight_map"] == json.loads(next(folder.glob("*.index.json")).read_text())["weight_map"]
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in baked.values())


def test_bake_single_file_and_dtype(tmp_path):
    model = tiny_flux(seed=4)
    ckpt = tmp_path / "model.safetensors"
    save_file(model.state_dict(), ckpt)
    (tmp_path / "config.json").write_text(
        json.dumps(dict(model.config) | {"_class_name": "FluxTransformer2DModel"})
    )
    lora = tmp_path / "l.safetensors"
    save_file(flux_lora(5), lora)
    out = tmp_path / "out" / "baked.safetensors"
    out.parent.mkdir()  # -o never creates folders
    assert main(["bake", str(ckpt), f"{lora}:0.5", "-o", str(out), "--dtype", "bf16"]) == 0
    reference = copy.deepcopy(model)
    loraweave.apply(reference, (str(lora), 0.5), mode="merge", strict=True)
    baked = load_file(out)
    for k, v in reference.state_dict().items():
        # --dtype casts once from the fp32 merge: equal to rounding the fp32 merged weight.
        assert torch.equal(baked[k], v.to(torch.bfloat16)), k


def test_interrupted_bake_leaves_nothing(sharded, tmp_path, monkeypatch):
    folder, _ = sharded
    lora = tmp_path / "l.safetensors"
    save_file(flux_lora(6), lora)
    calls = {"n": 0}
    real = bake_mod.merged_weight

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("simulated interrupt midway")
        return real(*args, **kwargs)

    monkeypatch.setattr(bake_mod, "merged_weight", failing)
    out = tmp_path / "baked"
    before = set(os.listdir(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        bake(folder, [(str(lora), 1.0)], out)
    assert calls["n"] == 3
    assert set(os.listdir(tmp_path)) == before  # no output, no temp folder left behind
    single = tmp_path / "one.safetensors"
    save_file(tiny_flux(seed=1).state_dict(), single)
    (tmp_path / "config.json").write_text(
        (folder / "config.json").read_text()
    )  # names the class: BFL keys resolve
    before = set(os.listdir(tmp_path))
    calls["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        bake(single, [(str(lora), 1.0)], tmp_path / "o.safetensors")
    assert set(os.listdir(tmp_path)) == before


def test_bake_refuses_to_overwrite_inputs(sharded, tmp_path):
    folder, _ = sharded
    lora = tmp_path / "l.safetensors"
    save_file(flux_lora(7), lora)
    with pytest.raises(loraweave.LoraweaveError, match="overwrite input"):
        bake(folder, [(str(lora), 1.0)], folder)
    with pytest.raises(loraweave.LoraweaveError, match="overwrite input"):
        bake(folder, [(str(lora), 1.0)], lora)
    assert main(["bake", str(folder), str(lora), "-o", str(folder / "x")]) == 2


def test_bake_strict_and_unmatched(sharded, tmp_path):
    folder, _ = sharded
    sd = flux_lora(8)
    sd["lora_unet_no_such_module.lora_down.weight"] = torch.zeros(4, 32)
    sd["lora_unet_no_such_module.lora_up.weight"] = torch.zeros(32, 4)
    lora = tmp_path / "l.safetensors"
    save_file(sd, lora)
    with pytest.raises(loraweave.StrictApplyError):
        bake(folder, [(str(lora), 1.0)], tmp_path / "strict", strict=True)
    assert not (tmp_path / "strict").exists()
    res = bake(folder, [(str(lora), 1.0)], tmp_path / "loose")
    assert res.keys_applied == 8 and [u["key"] for u in res.unmatched] == [
        "lora_unet_no_such_module.lora_down.weight",
        "lora_unet_no_such_module.lora_up.weight",
    ]


def test_adapter_argument_strength():
    assert parse_adapter_arg("a/b.safetensors:0.5") == ("a/b.safetensors", 0.5)
    assert parse_adapter_arg("c:/x/b.safetensors") == ("c:/x/b.safetensors", 1.0)
    assert parse_adapter_arg("b.safetensors:-1e-1") == ("b.safetensors", -0.1)


def test_bake_pipeline_folder(tmp_path):
    """A pipeline folder: the transformer is baked, other components and files are carried over unchanged."""
    root = tmp_path / "pipe"
    model = tiny_flux(seed=9)
    model.save_pretrained(root / "transformer", max_shard_size="100KB", safe_serialization=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (root / "vae").mkdir()
    vae = {"decoder.conv_in.weight": torch.randn(8, 4, 3, 3), "decoder.conv_in.bias": torch.randn(8)}
    save_file(vae, root / "vae" / "diffusion_pytorch_model.safetensors")
    (root / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    lora = tmp_path / "l.safetensors"
    save_file(flux_lora(10), lora)
    out = tmp_path / "baked"
    res = bake(root, [(str(lora), 1.0)], out)
    assert res.keys_applied == res.keys_total == 8
    rel = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == rel
    reference = copy.deepcopy(model)
    loraweave.apply(reference, str(lora), mode="merge", strict=True)
    baked = _folder_state(out / "transformer")
    for k, v in reference.state_dict().items():
        assert torch.equal(baked[k], v), k
    for k, v in load_file(out / "vae" / "diffusion_pytorch_model.safetensors").items():
        assert torch.equal(v, vae[k])
    assert (out / "scheduler" / "scheduler_config.json").read_text() == "{}"


def _to_bfl(sd: dict[str, torch.Tensor], double: int = 2, single: int = 2) -> dict[str, torch.Tensor]:
    """Diffusers Flux state dict -> BFL names, written out by hand (independent of loraweave's alias
    tables)."""
    out, used = {}, set()

    def put(bfl: str, *names: str, swap: bool = False) -> None:
        for suffix in ("weight", "bias"):
            parts = [sd[f"{n}.{suffix}"] for n in names if f"{n}.{suffix}" in sd]
            if parts:
                t = torch.cat(parts)
                if swap:  # BFL final layer holds (shift, scale); diffusers holds (scale, shift)
                    t = torch.cat(t.chunk(2)[::-1])
                out[f"{bfl}.{suffix}"] = t
                used.update(f"{n}.{suffix}" for n in names)

    for i in range(double):
        d, b = f"transformer_blocks.{i}", f"double_blocks.{i}"
        put(f"{b}.img_attn.qkv", f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v")
        put(f"{b}.txt_attn.qkv", f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj")
        put(f"{b}.img_attn.proj", f"{d}.attn.to_out.0")
        put(f"{b}.txt_attn.proj", f"{d}.attn.to_add_out")
        put(f"{b}.img_mlp.0", f"{d}.ff.net.0.proj")
        put(f"{b}.img_mlp.2", f"{d}.ff.net.2")
        put(f"{b}.txt_mlp.0", f"{d}.ff_context.net.0.proj")
        put(f"{b}.txt_mlp.2", f"{d}.ff_context.net.2")
        put(f"{b}.img_mod.lin", f"{d}.norm1.linear")
        put(f"{b}.txt_mod.lin", f"{d}.norm1_context.linear")
    for i in range(single):
        s, b = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        put(f"{b}.linear1", f"{s}.attn.to_q", f"{s}.attn.to_k", f"{s}.attn.to_v", f"{s}.proj_mlp")
        put(f"{b}.linear2", f"{s}.proj_out")
        put(f"{b}.modulation.lin", f"{s}.norm.linear")
    put("final_layer.adaLN_modulation.1", "norm_out.linear", swap=True)
    put("final_layer.linear", "proj_out")
    put("img_in", "x_embedder")
    put("txt_in", "context_embedder")
    for emb, bfl in (
        ("timestep_embedder", "time_in"),
        ("guidance_embedder", "guidance_in"),
        ("text_embedder", "vector_in"),
    ):
        put(f"{bfl}.in_layer", f"time_text_embed.{emb}.linear_1")
        put(f"{bfl}.out_layer", f"time_text_embed.{emb}.linear_2")
    out.update({k: v for k, v in sd.items() if k not in used})  # q/k norms etc. keep their names here
    return out


def test_bake_original_named_single_file(tmp_path):
    """A BFL-named single file: kohya (BFL) and diffusers keys both land on the right rows of the fused
    tensors."""
    model = tiny_flux(seed=11)
    ckpt = tmp_path / "flux_bfl.safetensors"
    save_file(_to_bfl(model.state_dict()), ckpt)
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel", **config}))
    sd = flux_lora(12)
    g = torch.Generator().manual_seed(13)
    sd["transformer.norm_out.linear.lora_A.weight"] = torch.randn(4, 32, generator=g)
    sd["transformer.norm_out.linear.lora_B.weight"] = torch.randn(64, 4, generator=g)
    sd["transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight"] = torch.randn(4, 32, generator=g)
    sd["transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight"] = torch.randn(128, 4, generator=g)
    lora = tmp_path / "l.safetensors"
    save_file(sd, lora)
    res = bake(ckpt, [(str(lora), 0.9)], tmp_path / "out.safetensors")
    assert res.keys_applied == res.keys_total == 12 and not res.unmatched
    reference = copy.deepcopy(model)
    loraweave.apply(reference, (str(lora), 0.9), mode="merge", strict=True)
    expected = _to_bfl(reference.state_dict())
    baked = load_file(tmp_path / "out.safetensors")
    assert set(baked) == set(expected)
    for k, v in expected.items():
        assert torch.equal(baked[k], v), k
    assert not torch.equal(
        baked["final_layer.adaLN_modulation.1.weight"],
        _to_bfl(model.state_dict())["final_layer.adaLN_modulation.1.weight"],
    )


def test_bake_ldm_single_file_with_prefix(tmp_path):
    """An ldm/sgm single file (`model.diffusion_model.input_blocks...`): diffusers-named and sgm-named keys
    land; tensors outside the UNet (here a VAE one) pass through untouched."""
    from helpers.tiny_models import tiny_sdxl_unet

    from loraweave.arch.unet_original import unet_original_names

    model = tiny_sdxl_unet(seed=5)
    rename = {
        f"{d}.{s}": f"{o}.{s}" for o, d in unet_original_names(model).items() for s in ("weight", "bias")
    }

    def to_ldm(sd):
        out = {"model.diffusion_model." + rename.get(k, k): v for k, v in sd.items()}
        out["first_stage_model.decoder.conv_in.weight"] = torch.ones(4, 4, 3, 3)
        return out

    ckpt = tmp_path / "sdxl.safetensors"
    save_file(to_ldm(model.state_dict()), ckpt)
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel", **config}))
    g = torch.Generator().manual_seed(14)
    attn = "down_blocks.1.attentions.0.transformer_blocks.1"
    lora = {
        f"unet.{attn}.attn2.to_k.lora_A.weight": torch.randn(2, 32, generator=g),
        f"unet.{attn}.attn2.to_k.lora_B.weight": torch.randn(32, 2, generator=g),
        # sgm name of down_blocks.1.attentions.0.proj_in
        "lora_unet_input_blocks_4_1_proj_in.lora_down.weight": torch.randn(2, 32, generator=g),
        "lora_unet_input_blocks_4_1_proj_in.lora_up.weight": torch.randn(32, 2, generator=g),
        "lora_unet_input_blocks_4_1_proj_in.alpha": torch.tensor(1.0),
    }
    save_file(lora, tmp_path / "l.safetensors")
    res = bake(ckpt, [(str(tmp_path / "l.safetensors"), 1.0)], tmp_path / "out.safetensors")
    assert res.keys_applied == res.keys_total == 5 and res.tensors_changed == 2
    reference = copy.deepcopy(model)
    loraweave.apply(reference, str(tmp_path / "l.safetensors"), mode="merge", strict=True)
    baked = load_file(tmp_path / "out.safetensors")
    expected = to_ldm(reference.state_dict())
    assert set(baked) == set(expected)
    for k, v in expected.items():
        assert torch.equal(baked[k], v), k


@pytest.mark.parametrize(
    "folder, cls",
    [
        ("text_conditioner", "AnimaTextConditioner"),
        ("connectors", "LTX2TextConnectors"),
        ("transformer", "FluxTransformer2DModel"),
    ],
)
def test_a_component_folder_is_named_by_its_folder(tmp_path, folder, cls):
    """A component folder given alone: Anima's text_conditioner and LTX-2's connectors were named
    "transformer" by their class (not a UNet, not a text model), so the file's keys for them could not
    land."""
    from loraweave.tools.checkpoint import open_checkpoint

    root = tmp_path / folder
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"_class_name": cls}))
    save_file({"proj.weight": torch.zeros(2, 2)}, root / "diffusion_pytorch_model.safetensors")
    assert [c.name for c in open_checkpoint(root).components] == [folder]
