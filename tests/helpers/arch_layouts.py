"""Original-layout state dicts, LoRA key names and file builders for the arch-layout tests, and the peft
comparison they share."""

from __future__ import annotations

import copy

import torch

import loraweave
from helpers.common import rel_err


def linears(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if type(m) is torch.nn.Linear}


def ltx2_original(live: str) -> str:
    """Write a live LTX-2 name the way the original checkpoint does (the test's own inverse of the
    renames)."""
    for new, old in (
        ("prompt_adaln", "prompt_adaln_single"),
        ("norm_k", "k_norm"),
        ("norm_q", "q_norm"),
        ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
        ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
        ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
        ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
        ("proj_in", "patchify_proj"),
    ):
        live = live.replace(new, old)
    for new, old in (("time_embed.", "adaln_single."), ("audio_time_embed.", "audio_adaln_single.")):
        if live.startswith(new):
            live = old + live[len(new) :]
    return live


def lora_file(modules: dict[str, torch.nn.Module], name_of, rank: int = 2, seed: int = 4, meta: bool = False):
    """{file key: tensor}: a LoRA on every module, named by `name_of(live name)`; no alpha (scale 1, as
    PEFT)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for live, m in modules.items():
        out, inp = m.weight.shape
        stem = name_of(live)
        if meta:
            sd[f"{stem}.lora_A.weight"] = torch.empty(rank, inp, device="meta")
            sd[f"{stem}.lora_B.weight"] = torch.empty(out, rank, device="meta")
        else:
            sd[f"{stem}.lora_A.weight"] = torch.randn(rank, inp, generator=g)
            sd[f"{stem}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.1
    return sd


def assert_matches_peft(model, sd: dict, converted: dict, prefix: str = "transformer"):
    """Every Linear's output: ours (merge, runtime) vs diffusers' converted keys loaded by PEFT."""
    names = list(linears(model))
    g = torch.Generator().manual_seed(9)
    xs = {n: torch.randn(3, linears(model)[n].in_features, generator=g) for n in names}
    ref = copy.deepcopy(model)
    ref.load_lora_adapter(converted, prefix=prefix, adapter_name="ref")
    with torch.no_grad():
        expected = {n: ref.get_submodule(n)(xs[n]) for n in names}
        changed = sum(not torch.equal(expected[n], linears(model)[n](xs[n])) for n in names)
    assert changed > 0
    for mode in ("merge", "runtime"):
        ours = copy.deepcopy(model)
        loraweave.apply(ours, sd, mode=mode, strict=True)
        with torch.no_grad():
            worst = max(rel_err(ours.get_submodule(n)(xs[n]), expected[n]) for n in names)
        assert worst <= 1e-5, (mode, worst)


def lumina2_lora_names(model) -> dict[str, tuple[int, int]]:
    """{original stem: (rows, in)} in the order and spelling of diffusers' Lumina2 LoRA converter."""
    mods, out = dict(model.named_modules()), {}
    for stack, n, modulated in (
        ("noise_refiner", len(model.noise_refiner), True),
        ("context_refiner", len(model.context_refiner), False),
        ("layers", len(model.layers), True),
    ):
        for i in range(n):
            b = f"{stack}.{i}"
            out[f"{b}.attention.qkv"] = (
                sum(mods[f"{b}.attn.to_{x}"].out_features for x in "qkv"),
                mods[f"{b}.attn.to_q"].in_features,
            )
            out[f"{b}.attention.out"] = tuple(mods[f"{b}.attn.to_out.0"].weight.shape)
            out.update(
                {
                    f"{b}.feed_forward.w{j}": tuple(mods[f"{b}.feed_forward.linear_{j}"].weight.shape)
                    for j in (1, 2, 3)
                }
            )
            if modulated:
                out[f"{b}.adaLN_modulation.1"] = tuple(mods[f"{b}.norm1.linear"].weight.shape)
    return out


# Live Cosmos name -> original (the test's own inverse of the converter's renames; the converter checks it).
ANIMA_ORIGINAL = (
    ("attn1.to_out.0", "self_attn.output_proj"),
    ("attn2.to_out.0", "cross_attn.output_proj"),
    *((f"attn{n}.to_{x}", f"{a}.{x}_proj") for n, a in ((1, "self_attn"), (2, "cross_attn")) for x in "qkv"),
    *(
        (f"norm{n}.linear_{j}", f"adaln_modulation_{a}.{j}")
        for n, a in ((1, "self_attn"), (2, "cross_attn"), (3, "mlp"))
        for j in (1, 2)
    ),
    ("ff.net.0.proj", "mlp.layer1"),
    ("ff.net.2", "mlp.layer2"),
    ("norm_out.linear_", "final_layer.adaln_modulation."),
    ("proj_out", "final_layer.linear"),
    ("time_embed.t_embedder", "t_embedder.1"),
    ("patch_embed.proj", "x_embedder.proj.1"),
    ("transformer_blocks.", "blocks."),
)


def anima_original(live: str) -> str:
    for new, old in ANIMA_ORIGINAL:
        live = live.replace(new, old)
    return live


def _anima(meta: bool, dit: dict, conditioner: dict) -> dict[str, torch.nn.Module]:
    import diffusers

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        parts = {
            "transformer": diffusers.CosmosTransformer3DModel(**dit),
            "text_conditioner": diffusers.AnimaTextConditioner(**conditioner),
        }
    return {n: m.eval() for n, m in parts.items()}


def anima_file(parts: dict, meta: bool) -> dict[str, torch.Tensor]:
    """ComfyUI/diffusion-pipe form: every Linear of the DiT by its original name, the adapter under
    llm_adapter."""
    return {
        **lora_file(
            linears(parts["transformer"]), lambda n: f"diffusion_model.{anima_original(n)}", meta=meta
        ),
        **lora_file(
            linears(parts["text_conditioner"]),
            lambda n: f"diffusion_model.llm_adapter.{n}",
            meta=meta,
            seed=8,
        ),
    }


# Original weight -> diffusers module, one-to-one (the test's own inverse of the converter; the fused ones
# below).
SANA_TOP = {
    "x_embedder.proj": "patch_embed.proj",
    "t_embedder.mlp.0": "time_embed.emb.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_embed.emb.timestep_embedder.linear_2",
    "t_block.1": "time_embed.linear",
    "y_embedder.y_proj.fc1": "caption_projection.linear_1",
    "y_embedder.y_proj.fc2": "caption_projection.linear_2",
    "attention_y_norm": "caption_norm",
    "final_layer.linear": "proj_out",
}


SANA_BLOCK = {
    "attn.proj": "attn1.to_out.0",
    "cross_attn.q_linear": "attn2.to_q",
    "cross_attn.proj": "attn2.to_out.0",
    "mlp.inverted_conv.conv": "ff.conv_inverted",
    "mlp.depth_conv.conv": "ff.conv_depth",
    "mlp.point_conv.conv": "ff.conv_point",
}


SANA_FUSED = {
    "attn.qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
    "cross_attn.kv_linear": ("attn2.to_k", "attn2.to_v"),
}


def sana_original(model, make) -> dict[str, torch.Tensor]:
    """The original (NVlabs) checkpoint of `model`: {name: make(name, shape)}, every key the converter
    reads."""
    live = dict(model.named_parameters())
    pairs = {
        **SANA_TOP,
        **{
            f"blocks.{i}.{o}": f"transformer_blocks.{i}.{n}"
            for i in range(len(model.transformer_blocks))
            for o, n in SANA_BLOCK.items()
        },
    }
    out = {
        "pos_embed": make("pos_embed", (1,)),
        "y_embedder.y_embedding": make("y_embedder.y_embedding", (1,)),
    }
    for old, new in pairs.items():
        for p in ("weight", "bias"):
            if f"{new}.{p}" in live:
                out[f"{old}.{p}"] = make(f"{old}.{p}", tuple(live[f"{new}.{p}"].shape))
    for i in range(len(model.transformer_blocks)):
        for old, news in SANA_FUSED.items():
            for p in ("weight", "bias"):
                parts = [live.get(f"transformer_blocks.{i}.{n}.{p}") for n in news]
                if parts[0] is not None:
                    shape = (sum(t.shape[0] for t in parts), *parts[0].shape[1:])
                    out[f"blocks.{i}.{old}.{p}"] = make(f"blocks.{i}.{old}.{p}", shape)
        out[f"blocks.{i}.scale_shift_table"] = make(
            f"blocks.{i}.scale_shift_table", tuple(live[f"transformer_blocks.{i}.scale_shift_table"].shape)
        )
    out["final_layer.scale_shift_table"] = make(
        "final_layer.scale_shift_table", tuple(live["scale_shift_table"].shape)
    )
    return out


H3_STANDALONE = {
    "video_patch_proj": "proj_in",
    "audio_patch_proj": "audio_proj_in",
    "condition_proj": "context_embedder",
    "time_embedder.proj_in": "time_embedder.linear_1",
    "time_embedder.proj_out": "time_embedder.linear_2",
    "final_layer.adaln_proj.linear": "norm_out.linear",
    "final_layer.video_out": "proj_out",
    "final_layer.audio_out": "audio_proj_out",
}


def h3_lora_names(model) -> dict[str, tuple[int, int]]:
    """{original stem: (rows, in)}: every Linear of the model under its original MiniMax-H3 name."""
    mods = dict(model.named_modules())
    out = {src: tuple(mods[live].weight.shape) for src, live in H3_STANDALONE.items()}
    for src, dst, n in (
        ("blocks", "transformer_blocks", len(model.transformer_blocks)),
        ("token_refiner.blocks", "token_refiner.refiner_blocks", len(model.token_refiner.refiner_blocks)),
    ):
        for i in range(n):
            s, d = f"{src}.{i}", f"{dst}.{i}"
            q = mods[f"{d}.attn.to_q"]
            out[f"{s}.attn.qkv_proj"] = (3 * q.out_features, q.in_features)
            for o, live in (
                ("attn.out_proj", "attn.to_out.0"),
                ("mlp.fc1", "ff.net.0.proj"),
                ("mlp.fc2", "ff.net.2"),
                ("adaln_proj.linear", "adaln_proj.linear"),
            ):
                if f"{d}.{live}" in mods:
                    out[f"{s}.{o}"] = tuple(mods[f"{d}.{live}"].weight.shape)
    return out


def ideogram4_lora_names(model) -> dict[str, tuple[int, int]]:
    """{original stem: (rows, in)} of every module the converter maps (it maps `layers.N.*` only)."""
    mods, out = dict(model.named_modules()), {}
    for i in range(len(model.layers)):
        b = f"layers.{i}"
        q = mods[f"{b}.attention.to_q"]
        out[f"{b}.attention.qkv"] = (3 * q.out_features, q.in_features)
        out[f"{b}.attention.o"] = tuple(mods[f"{b}.attention.to_out.0"].weight.shape)
        for n in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "adaln_modulation"):
            out[f"{b}.{n}"] = tuple(mods[f"{b}.{n}"].weight.shape)
    return out


def qwen21_lora_names(model) -> dict[str, tuple[int, int]]:
    """{original (ComfyUI) stem: (rows, in)}: diffusers names, with each block's gate_layer + proj fused to
    gate_up."""
    out = {}
    for name, m in linears(model).items():
        if name.endswith("img_mlp.proj"):
            continue
        if name.endswith("img_mlp.gate_layer"):
            out[name.replace("gate_layer", "gate_up")] = (2 * m.out_features, m.in_features)
        else:
            out[name] = tuple(m.weight.shape)
    return out
