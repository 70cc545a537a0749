"""Batched inputs for the tiny models (one row per sample) and how to take some of their rows: per-sample
tests."""

from __future__ import annotations

import torch

from helpers.arch_matrix import ARCHS as MATRIX
from helpers.tiny_configs import tiny_sd3, tiny_wan
from helpers.tiny_models import MODELS

ARCHS = {
    "flux": MODELS["flux"][0],
    "zimage": MODELS["zimage"][0],
    "sdxl_unet": MODELS["sdxl_unet"][0],
    "wan": lambda: tiny_wan(False),
}
# the rest of the support matrix (per-sample mapping checked on each; a longer run, see test_persample)
MORE = {
    "sd3": tiny_sd3,
    "chroma": MATRIX["chroma"],
    "qwen-image": MATRIX["qwen-image"],
    "flux2": MATRIX["flux2"],
    "krea2": MATRIX["krea2"],
    "wan-i2v": lambda: tiny_wan(True),
}
SHARED = {"img_ids", "txt_ids", "position_ids"}  # one per call, not per sample


def batch_inputs(arch: str, n: int, seed: int = 1) -> dict:
    """Keyword inputs for `n` samples; tensors (and lists) whose first axis is the sample."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if arch == "flux":
        return {
            "hidden_states": r(n, 16, 16),
            "encoder_hidden_states": r(n, 5, 32),
            "pooled_projections": r(n, 32),
            "timestep": torch.rand(n, generator=g),
            "guidance": torch.full((n,), 3.5),
        }
    if arch == "zimage":
        return {
            "x": [r(4, 1, 8, 8) for _ in range(n)],
            "t": torch.rand(n, generator=g),
            "cap_feats": [r(7, 32) for _ in range(n)],
        }
    if arch == "sdxl_unet":
        return {
            "sample": r(n, 4, 16, 16),
            "timestep": torch.randint(1, 999, (n,), generator=g),
            "encoder_hidden_states": r(n, 5, 32),
            "added_cond_kwargs": {"text_embeds": r(n, 32), "time_ids": r(n, 6)},
        }
    t = torch.rand(n, generator=g)
    if arch == "sd3":
        return {
            "hidden_states": r(n, 4, 8, 8),
            "encoder_hidden_states": r(n, 5, 32),
            "pooled_projections": r(n, 16),
            "timestep": t * 999,
        }
    if arch in ("chroma", "flux2"):
        ids = 3 if arch == "chroma" else 4
        return {
            "hidden_states": r(n, 16, 8 if arch == "chroma" else 4),
            "encoder_hidden_states": r(n, 5, 16),
            "timestep": t,
            "img_ids": torch.zeros(16, ids),
            "txt_ids": torch.zeros(5, ids),
        }
    if arch == "qwen-image":
        return {
            "hidden_states": r(n, 16, 8),
            "encoder_hidden_states": r(n, 5, 16),
            "encoder_hidden_states_mask": torch.ones(n, 5),
            "timestep": t,
            "img_shapes": [[(1, 4, 4)]] * n,
        }
    if arch == "krea2":
        return {
            "hidden_states": r(n, 16, 4),
            "encoder_hidden_states": r(n, 5, 3, 16),
            "timestep": t,
            "position_ids": torch.zeros(21, 3),
        }
    wan = {
        "hidden_states": r(n, 4, 2, 8, 8),
        "timestep": (t * 999).long(),
        "encoder_hidden_states": r(n, 6, 24),
    }
    return {**wan, "encoder_hidden_states_image": r(n, 4, 24)} if arch == "wan-i2v" else wan


def take(inputs: dict, rows: list[int]) -> dict:
    """The same inputs for a subset of samples, in the given order."""
    out = {}
    for k, v in inputs.items():
        if k in SHARED:
            out[k] = v
        elif isinstance(v, dict):
            out[k] = take(v, rows)
        elif isinstance(v, list):
            out[k] = [v[i] for i in rows]
        else:
            out[k] = v[rows]
    return out


def cat(a: dict, b: dict) -> dict:
    """Two input batches one after the other (the guidance layout `cat([uncond, cond])`)."""
    out = {}
    for k, v in a.items():
        if k in SHARED:
            out[k] = v
            continue
        out[k] = (
            cat(v, b[k])
            if isinstance(v, dict)
            else (v + b[k] if isinstance(v, list) else torch.cat([v, b[k]]))
        )
    return out


@torch.no_grad()
def run(arch: str, model, inputs: dict) -> torch.Tensor:
    """The model's output, samples on the first axis."""
    if arch == "flux":
        return model(**inputs, img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3), return_dict=False)[0]
    if arch == "zimage":
        return torch.stack(model(inputs["x"], inputs["t"], inputs["cap_feats"], return_dict=False)[0])
    return model(**inputs, return_dict=False)[0]
