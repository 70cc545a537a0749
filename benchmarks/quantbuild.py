"""Quantized copies of a float `nn.Sequential` of Linear layers, built with each backend's own API (as
tests/test_quant_backends.py and tests/test_quant_sdnq.py do), and why a (backend, kind) cannot run here.

`build(backend, kind, model)` quantizes every Linear of `model` in place and returns it; `blocker(backend,
kind)` is the reason loraweave's backend gives for not running that kind on this machine, or None."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")

# backend (loraweave's name) -> the kinds the benchmark builds, 8-bit first
KINDS = {
    "sdnq": ("int8", "uint4"),
    "bitsandbytes": ("int8", "nf4", "fp4"),
    "torchao": ("int8", "float8", "intx-int4", "int4"),
    "quanto": ("qint8", "qint4"),
    "gguf": ("Q8_0", "Q4_0", "Q4_K"),
}


def _linears(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_children() if isinstance(m, nn.Linear)]


def _sdnq(kind: str, model: nn.Module) -> nn.Module:
    from sdnq import sdnq_post_load_quant

    with torch.random.fork_rng():
        torch.manual_seed(1)
        sdnq_post_load_quant(model, add_skip_keys=False, weights_dtype=kind)
    return model


def _bnb(kind: str, model: nn.Module) -> nn.Module:
    import bitsandbytes as bnb

    for name in _linears(model):
        lin = model.get_submodule(name)
        if kind == "int8":
            q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, has_fp16_weights=False, threshold=0.0)
        else:
            q = bnb.nn.Linear4bit(
                lin.in_features, lin.out_features, quant_type=kind, compute_dtype=torch.float32
            )
        q.load_state_dict(lin.state_dict())
        model._modules[name] = q.to("cpu")  # bitsandbytes quantizes on the device move
    return model.eval()


def _torchao(kind: str, model: nn.Module) -> nn.Module:
    from torchao.quantization import quantize_

    from loraweave.quant.torchao import _configs

    quantize_(model, _configs()[kind])
    return model


def _quanto(kind: str, model: nn.Module) -> nn.Module:
    from optimum import quanto

    quanto.quantize(model, weights=getattr(quanto, kind))
    quanto.freeze(model)
    return model


def _q4k_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random but well-formed Q4_K super-blocks (the gguf package cannot quantize K-quants)."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full(n, 2e-5, dtype=np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = np.full(n, 1e-5, dtype=np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, cols // 256 * 144)


def _gguf(kind: str, model: nn.Module) -> nn.Module:
    import gguf
    from diffusers.models.model_loading_utils import load_gguf_checkpoint
    from diffusers.quantizers.gguf.utils import _replace_with_gguf_linear

    qtype = gguf.GGMLQuantizationType[kind]
    with tempfile.TemporaryDirectory() as tmp:  # a real .gguf file, read back by diffusers' GGUF reader
        path = str(Path(tmp) / "model.gguf")
        writer = gguf.GGUFWriter(path, arch="loraweave-bench")
        for i, name in enumerate(_linears(model)):
            lin = model.get_submodule(name)
            if kind == "Q4_K":
                blocks = _q4k_blocks(lin.out_features, lin.in_features, seed=10 + i)
            else:
                blocks = gguf.quants.quantize(lin.weight.detach().numpy(), qtype)
            writer.add_tensor(f"{name}.weight", blocks, raw_dtype=qtype)
            writer.add_tensor(f"{name}.bias", lin.bias.detach().numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        sd = load_gguf_checkpoint(path, return_tensors=True)
    # diffusers' own loader steps: swap in GGUFLinear (on meta), then set each loaded tensor on it
    _replace_with_gguf_linear(model, torch.float32, sd)
    for key, value in sd.items():
        owner, attr = key.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, value if attr == "weight" else nn.Parameter(value, False))
    return model


_BUILDERS = {"sdnq": _sdnq, "bitsandbytes": _bnb, "torchao": _torchao, "quanto": _quanto, "gguf": _gguf}


def build(backend: str, kind: str, model: nn.Module) -> nn.Module:
    return _BUILDERS[backend](kind, model)


def blocker(backend: str, kind: str) -> str | None:
    """Why `kind` of `backend` cannot run here: the backend module's import failure, `unavailable()`, or its
    `kind_unavailable(kind)` (bitsandbytes, torchao, quanto probe each kind on a tiny layer)."""
    from loraweave.quant import BACKENDS, broken

    module = {"bitsandbytes": "bnb"}.get(backend, backend)
    if module in broken():
        return broken()[module]
    b = BACKENDS.get(backend)
    if b is None:
        return f"loraweave has no {backend} backend in this build"
    kind_check = getattr(b, "kind_unavailable", None)
    return kind_check(kind) if kind_check is not None else b.unavailable()
