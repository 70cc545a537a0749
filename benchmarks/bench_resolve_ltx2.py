"""Resolution of a 1,500-key LTX-2 LoRA in the original (Lightricks/ComfyUI) names against the full-size
LTX-2.3 transformer on `meta` (48 blocks with audio tower, audio<->video cross-attention, gate logits, prompt
modulation).

The file: LoRA A/B on the first 750 Linear layers of the model (every top-level embedder and modulation, then
the blocks in order), written with the original names (`patchify_proj`, `adaln_single`,
`av_ca_*_adaln_single`, `q_norm`, ...) under `diffusion_model.`, and the same in kohya-flattened spelling
(`lora_unet_...`), whose renames run on underscored paths. Measured round-robin (medians of N rounds):
  name index     AliasTable of the transformer (built once per model)
  resolve only   every part matched against the pre-built index (target < 100 ms)
  plan           loraweave.plan end to end: key parsing + index + resolve + report
  peer           diffusers' _convert_non_diffusers_ltx2_lora_to_diffusers on the diffusion_model. keys (it has
                 no kohya form; renames only:
                 no model is consulted), the work a diffusers user pays before PEFT injection

    .venv/bin/python benchmarks/bench_resolve_ltx2.py [--quick]
"""

from __future__ import annotations

import argparse

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import Variant, interleaved, median, table

CONFIG = dict(gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True)
INVERSE = (
    ("prompt_adaln", "prompt_adaln_single"),
    ("norm_k", "k_norm"),
    ("norm_q", "q_norm"),
    ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
    ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
    ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
    ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
    ("proj_in", "patchify_proj"),
)


def original(live: str) -> str:
    for new, old in INVERSE:
        live = live.replace(new, old)
    for new, old in (("time_embed.", "adaln_single."), ("audio_time_embed.", "audio_adaln_single.")):
        if live.startswith(new):
            live = old + live[len(new) :]
    return live


def lora_keys(
    model: torch.nn.Module, kohya: bool, modules: int = 750, rank: int = 32
) -> dict[str, torch.Tensor]:
    out = {}
    linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear][:modules]
    for name, m in linears:
        stem = (
            "lora_unet_" + original(name).replace(".", "_") if kohya else f"diffusion_model.{original(name)}"
        )
        down, up = ("lora_down", "lora_up") if kohya else ("lora_A", "lora_B")
        out[f"{stem}.{down}.weight"] = torch.empty(rank, m.in_features, device="meta")
        out[f"{stem}.{up}.weight"] = torch.empty(m.out_features, rank, device="meta")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 rounds instead of 20")
    rounds = 5 if ap.parse_args().quick else 20
    benchutil.setup_torch()
    benchutil.header(
        "bench_resolve_ltx2: 1,500-key LTX-2 LoRA (original names) vs the full-size LTX-2.3 transformer on "
        "meta"
    )
    import diffusers
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers

    import loraweave
    from loraweave.arch.aliases import AliasTable
    from loraweave.resolve import planner as resolve_mod
    from loraweave.resolve.target import as_components

    with torch.device("meta"):
        model = diffusers.LTX2VideoTransformer3DModel(**CONFIG)
    components = as_components(model)
    rows, verdicts = [], []
    for label, kohya in (("diffusion_model. 1500 keys", False), ("lora_unet_ 1500 keys", True)):
        sd = lora_keys(model, kohya)
        adapter = loraweave.load_adapter(sd)
        tables = {name: AliasTable(module) for name, module in components}
        report = loraweave.plan(model, sd)
        peer_sd = {
            k.replace("lora_down", "lora_A").replace("lora_up", "lora_B"): v
            for k, v in lora_keys(model, False).items()
        }
        variants = [
            Variant("name index", lambda: [AliasTable(m) for _, m in components]),
            Variant(
                "resolve only",
                lambda a=adapter, t=tables: resolve_mod.resolve(components, [(a, 1.0)], tables=t),
            ),
            Variant("plan", lambda s=sd: loraweave.plan(model, s)),
            Variant(
                "peer: diffusers converter",
                lambda s=peer_sd: _convert_non_diffusers_ltx2_lora_to_diffusers(dict(s)),
            ),
        ]
        times = interleaved(variants, rounds=rounds, warmup=2, log=False, collect=False)
        for v in variants:
            rows.append(
                [label, v.name, f"{median(times[v.name]) * 1e3:.1f}", f"{min(times[v.name]) * 1e3:.1f}"]
            )
        resolve_ms, peer_ms = (
            median(times["resolve only"]) * 1e3,
            median(times["peer: diffusers converter"]) * 1e3,
        )
        rows.append([label, "resolve / peer", f"{resolve_ms / peer_ms:.2f}x", ""])
        rows.append(
            [
                label,
                "keys applied",
                f"{report.keys_applied}/{report.keys_total}",
                f"unmatched {len(report.unmatched)}",
            ]
        )
        verdicts.append(
            f"{label}: resolve {resolve_ms:.1f} ms < 100 ms {'PASS' if resolve_ms < 100 else 'FAIL'}; "
            f"all keys applied: {'PASS' if report.ok and report.keys_total == 1500 else 'FAIL'}"
        )
    print(benchutil.noise_line())
    print(table(["key list", "phase", "median ms", "min ms"], rows))
    print()
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
