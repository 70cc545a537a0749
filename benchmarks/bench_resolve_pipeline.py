"""Resolution of the largest real Flux key lists, and of a Flux LoRA that also trained the text encoder.

Lists: /work/shared/realdata/keys/invokeai/flux_lora_diffusers_with_norm_out_format.json (1008 keys, the
largest real list in shared data; transformer only) and a Flux + TE file: the real 912-key kohya list plus
kohya CLIP-L keys (`lora_te1_…`, down/up/alpha for the 6 Linear layers of each of the 12 layers: 216 keys,
names and shapes from the real SD1.5 text-encoder config, which is CLIP-L) = 1128 keys. Models on `meta` (no
weights): Flux.1-dev transformer (real config), CLIP-L (real config), T5-XXL encoder (v1.1 XXL sizes) — the
three Flux components.

Measured, round-robin with the garbage collector paused around each call (medians of N rounds):
  name index     AliasTable per component (what resolve builds first; target < 1 s)
  resolve only   matching every part against the pre-built index (target < 100 ms)
  plan           loraweave.plan end to end: key parsing + index + resolve + report

    .venv/bin/python benchmarks/bench_resolve_pipeline.py [--quick]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import Variant, interleaved, median, table

REALDATA = Path("/work/shared/realdata")
KEYS = REALDATA / "keys/invokeai"


def _config(name: str) -> dict:
    return {
        k: v
        for k, v in json.loads((REALDATA / "configs" / name).read_text()).items()
        if not k.startswith("_")
    }


def build_components() -> dict[str, torch.nn.Module]:
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with torch.device("meta"):
        return {
            "transformer": FluxTransformer2DModel(**_config("flux1-dev__transformer_config.json")),
            "text_encoder": CLIPTextModel(CLIPTextConfig(**_config("sd15__text_encoder_config.json"))),
            "text_encoder_2": T5EncoderModel(
                T5Config(
                    d_model=4096,
                    d_ff=10240,
                    d_kv=64,
                    num_layers=24,
                    num_heads=64,
                    feed_forward_proj="gated-gelu",
                    vocab_size=32128,
                )
            ),
        }


def key_list(name: str) -> dict[str, torch.Tensor]:
    keys = json.loads((KEYS / name).read_text())["keys"]
    return {k: torch.empty(tuple(s), device="meta") for k, s in keys.items()}


def clip_te_keys(clip: torch.nn.Module, rank: int = 16) -> dict[str, torch.Tensor]:
    out = {}
    for name, mod in clip.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            stem = "lora_te1_text_model_" + name.removeprefix("text_model.").replace(".", "_")
            out[f"{stem}.lora_down.weight"] = torch.empty(rank, mod.in_features, device="meta")
            out[f"{stem}.lora_up.weight"] = torch.empty(mod.out_features, rank, device="meta")
            out[f"{stem}.alpha"] = torch.empty((), device="meta")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 rounds instead of 20")
    rounds = 5 if ap.parse_args().quick else 20
    benchutil.setup_torch()
    benchutil.header(
        "bench_resolve_pipeline: largest real Flux key lists vs full-size Flux components on meta"
    )
    import loraweave
    from loraweave.arch.aliases import AliasTable
    from loraweave.resolve import planner as resolve_mod
    from loraweave.resolve.target import as_components

    comps = build_components()
    cases = {
        "diffusers 1008 keys": (
            {"transformer": comps["transformer"]},
            key_list("flux_lora_diffusers_with_norm_out_format.json"),
        ),
        "kohya 912 + CLIP-L 216": (
            comps,
            {**key_list("flux_lora_kohya_format.json"), **clip_te_keys(comps["text_encoder"])},
        ),
    }
    rows, verdicts = [], []
    for label, (target, sd) in cases.items():
        components = as_components(target)
        adapter = loraweave.load_adapter(sd)
        tables = {name: AliasTable(module) for name, module in components}
        report = loraweave.plan(target, sd)
        state: dict = {}

        def prebuilt(prepare_tables=tables, st=state):
            st["orig"] = resolve_mod.AliasTable
            by_id = {id(m): t for m, t in ((t.root, t) for t in prepare_tables.values())}
            resolve_mod.AliasTable = lambda mod, by_id=by_id: by_id[id(mod)]

        def restore(st=state):
            resolve_mod.AliasTable = st.pop("orig")

        variants = [
            Variant("name index", lambda c=components: [AliasTable(m) for _, m in c]),
            Variant(
                "resolve only",
                lambda c=components, a=adapter: resolve_mod.resolve(c, [(a, 1.0)]),
                prepare=prebuilt,
                cleanup=restore,
            ),
            Variant("plan", lambda t=target, s=sd: loraweave.plan(t, s)),
        ]
        times = interleaved(variants, rounds=rounds, warmup=2, log=False, collect=False)
        for v in variants:
            rows.append(
                [label, v.name, f"{median(times[v.name]) * 1e3:.1f}", f"{min(times[v.name]) * 1e3:.1f}"]
            )
        rows.append(
            [
                label,
                "keys applied",
                f"{report.keys_applied}/{report.keys_total}",
                f"unmatched {len(report.unmatched)}",
            ]
        )
        index_ms, resolve_ms = median(times["name index"]) * 1e3, median(times["resolve only"]) * 1e3
        verdicts.append(
            f"{label}: index {index_ms:.0f} ms < 1000 ms {'PASS' if index_ms < 1000 else 'FAIL'}; "
            f"resolve {resolve_ms:.1f} ms < 100 ms {'PASS' if resolve_ms < 100 else 'FAIL'}; "
            f"all keys applied: {'PASS' if report.ok else 'FAIL'}"
        )
    print(benchutil.noise_line())
    print(table(["key list", "phase", "median ms", "min ms"], rows))
    print()
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
