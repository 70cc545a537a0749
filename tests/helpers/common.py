"""Helpers shared by the tests: relative error, seeded generators and inputs, per-layer outputs, LyCORIS
presets and references, real configs, and the fused Flux qkv check. Fixtures live in conftest.py."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from conftest import REALDATA
from safetensors.torch import load_file
from torch import nn

import loraweave

# The layer classes a LyCORIS preset targets unless a test names others.
CONV_CLASSES = ("Linear", "Conv1d", "Conv2d", "Conv3d")


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref|, in fp64."""
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn_inputs(shapes: dict[str, tuple[int, ...]], seed: int = 1) -> dict[str, torch.Tensor]:
    """{layer: standard normal input of that shape}, drawn from one generator in the dict's order."""
    g = gen(seed)
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


@torch.no_grad()
def outputs(model: nn.Module, xs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{layer: that submodule's output on xs[layer]}."""
    return {n: model.get_submodule(n)(x) for n, x in xs.items()}


def real_config(name: str) -> dict:
    """A diffusers/transformers config from the shared real data, without its `_`-prefixed bookkeeping
    keys."""
    return {
        k: v
        for k, v in json.loads((REALDATA / "configs" / name).read_text()).items()
        if not k.startswith("_")
    }


# ------------------------------------------------------------------------ LyCORIS references


def write_preset(path: Path, classes: tuple[str, ...] = CONV_CLASSES, module_algo: dict | None = None) -> str:
    """Write a LyCORIS preset (conv enabled, `classes` targeted, no names) and return its path as a string.

    module_algo: one config given to every class through `module_algo_map` (create_lycoris does not forward
    options such as rs_lora or train_on_input; per-class configs reach the module constructor)."""
    text = f"enable_conv = true\ntarget_module = {list(classes)!r}\ntarget_name = []\n".replace("'", '"')
    if module_algo is not None:
        entry = "".join(f"{k} = {json.dumps(v)}\n" for k, v in module_algo.items())
        text += "".join(f"[module_algo_map.{c}]\n{entry}" for c in classes)
    path.write_text(text)
    return str(path)


@torch.no_grad()
def randomise(params: Iterable[torch.Tensor], seed: int, scale: float) -> None:
    """Overwrite each tensor, in order, with standard normal noise times `scale` from one seeded generator."""
    g = gen(seed)
    for p in params:
        p.copy_(torch.randn(p.shape, generator=g) * scale)


def multiplier_outputs(net, wrapped: nn.Module, xs: dict[str, torch.Tensor], multipliers) -> dict:
    """{multiplier: outputs(wrapped, xs)} with the LyCORIS network `net` set to each multiplier in turn."""
    refs = {}
    for m in multipliers:
        net.set_multiplier(m)
        refs[m] = outputs(wrapped, xs)
    return refs


def save_lycoris(net, path: Path) -> dict[str, torch.Tensor]:
    """Save the LyCORIS network as fp32 .safetensors at `path` (no metadata) and return what the file
    holds."""
    net.save_weights(str(path), dtype=torch.float32, metadata=None)
    return load_file(str(path))


# ------------------------------------------------------------------------ fused Flux target (row chunks)


def check_fused_flux_qkv(
    pristine: nn.Module, sd: dict[str, torch.Tensor], s: float, full: torch.Tensor, tol: float
) -> None:
    """`sd` at strength `s` on the tiny Flux's fused `img_attn.qkv` (96 rows): to_q, to_k and to_v get rows
    [0, 32), [32, 64) and [64, 96) of the fp64 ΔW `full`. Merged weights <= 1e-6, layer outputs <= tol (merge
    and runtime), no other Linear moves, and the whole model's runtime output equals merge's within tol."""
    from helpers.tiny_models import flux_forward

    attn = "transformer_blocks.0.attn"
    targets = {f"{attn}.to_q": full[:32], f"{attn}.to_k": full[32:64], f"{attn}.to_v": full[64:]}
    x = torch.randn(3, 32, generator=gen(4))
    outs = {}
    for mode in ("merge", "runtime"):
        model = copy.deepcopy(pristine)
        handle = loraweave.apply(model, (sd, s), mode=mode, strict=True)
        assert handle.report.keys_applied == handle.report.keys_total == len(sd)
        for name, rows in targets.items():
            module, orig = model.get_submodule(name), pristine.get_submodule(name)
            ref_w = orig.weight.double() + rows
            if mode == "merge":
                assert rel_err(module.weight, ref_w) <= 1e-6, name
            with torch.no_grad():
                assert rel_err(module(x), F.linear(x.double(), ref_w, orig.bias.double())) <= tol, (
                    mode,
                    name,
                )
        for name, module in model.named_modules():  # nothing else moved
            if name not in targets and isinstance(module, nn.Linear):
                assert torch.equal(module.weight, pristine.get_submodule(name).weight), name
        with torch.no_grad():
            outs[mode] = flux_forward(model)
    assert rel_err(outs["runtime"], outs["merge"]) <= tol


def reason_prefixes(report) -> dict[str, int]:
    """Unmatched keys counted by the readable prefix of their reason ("shape mismatch", "bad tensor", ...)."""
    from collections import Counter

    return dict(Counter(u.reason.split(":", 1)[0] for u in report.unmatched))


def fail_on_call(n: int, exc: type[BaseException], real, after: bool = False):
    """`real` wrapped to raise `exc` on its n-th call (before it runs, or after with `after`): fault
    injection."""
    calls = {"n": 0}
    lock = threading.Lock()  # calls from several threads (the merge's shared blocks) count each once

    def wrapper(*args, **kwargs):
        with lock:
            calls["n"] += 1
            mine = calls["n"]
        if mine == n and not after:
            raise exc(f"injected failure on call {n}")
        out = real(*args, **kwargs)
        if mine == n and after:
            raise exc(f"injected failure after call {n}")
        return out

    wrapper.calls = calls
    return wrapper


def random_q4k_blocks(rows: int, cols: int, seed: int, d: float, dmin: float) -> np.ndarray:
    """Random but well-formed Q4_K super-blocks of a (rows, cols) weight (the gguf package cannot quantize
    K-quants): f16 `d` and `dmin`, random 6-bit scales/mins and 4-bit codes. The one random Q4_K builder
    of the tests; helpers/comfy_gguf.pack_k is the real quantizer."""
    n = rows * cols // 256
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full(n, d, dtype=np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = np.full(n, dmin, dtype=np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, cols // 256 * 144)
