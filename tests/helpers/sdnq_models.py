"""SDNQ-quantized tiny models, their adapters and restore checks, shared by the SDNQ, stacking, routing and
factor-cache tests."""

from __future__ import annotations

import copy

import torch
from sdnq import sdnq_post_load_quant  # noqa: E402
from sdnq.utils import get_sdnq_params  # noqa: E402
from torch import nn

from helpers.common import gen

IN, OUT_A, OUT_B = 256, 256, 384


LAYOUTS = {
    "int8": dict(weights_dtype="int8"),
    "uint4": dict(weights_dtype="uint4"),
    "uint4_hadamard": dict(weights_dtype="uint4", use_hadamard=True),
    "uint4_hadamard_qmatmul": dict(weights_dtype="uint4", use_hadamard=True, use_quantized_matmul=True),
    "int8_hadamard_qmatmul_svd": dict(
        weights_dtype="int8", use_hadamard=True, use_quantized_matmul=True, use_svd=True, svd_rank=16
    ),
    "uint4_svd": dict(weights_dtype="uint4", use_svd=True, svd_rank=16),
    "uint4_codebook": dict(weights_dtype="uint4", use_codebook=True),
    "int8_qmatmul": dict(weights_dtype="int8", use_quantized_matmul=True),
}


def float_model(seed: int = 0) -> nn.Module:
    root = nn.Module()
    root.a, root.b = nn.Linear(IN, OUT_A), nn.Linear(IN, OUT_B)
    g = gen(seed)
    with torch.no_grad():
        for m in (root.a, root.b):
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.05)
            m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.01)
    return root


def quantized(model: nn.Module, layout: str) -> nn.Module:
    q = copy.deepcopy(model)
    with torch.random.fork_rng():
        torch.manual_seed(1)  # svd_lowrank in SVDQuant draws
        sdnq_post_load_quant(q, add_skip_keys=False, **LAYOUTS[layout])
    assert type(q.a).__name__ == type(q.b).__name__ == "SDNQLinear", (
        "tiny layers must be large enough to quantize"
    )
    return q


def lora(name: str, out: int, rank: int, seed: int, scale: float = 0.05) -> tuple[dict, torch.Tensor]:
    g = gen(seed)
    down, up = torch.randn(rank, IN, generator=g) * scale, torch.randn(out, rank, generator=g) * scale
    alpha = rank / 2
    sd = {
        f"{name}.lora_down.weight": down,
        f"{name}.lora_up.weight": up,
        f"{name}.alpha": torch.tensor(alpha),
    }
    return sd, (alpha / rank) * up.double() @ down.double()


def lokr(name: str, out: int, seed: int, scale: float = 0.1) -> tuple[dict, torch.Tensor]:
    """kron(w1 (16, 16), w2_a @ w2_b (out/16, 16)), alpha = rank: γ = 1."""
    g = gen(seed)
    w1 = torch.randn(16, 16, generator=g) * scale
    w2a, w2b = torch.randn(out // 16, 4, generator=g) * scale, torch.randn(4, IN // 16, generator=g) * scale
    sd = {
        f"{name}.lokr_w1": w1,
        f"{name}.lokr_w2_a": w2a,
        f"{name}.lokr_w2_b": w2b,
        f"{name}.alpha": torch.tensor(4.0),
    }
    return sd, torch.kron(w1.double(), w2a.double() @ w2b.double())


def snapshot(model: nn.Module) -> dict:
    """Every tensor and attribute object sdnq keeps per layer, plus the class: removal must put back the
    same."""
    out = {}
    for name in ("a", "b"):
        m = model.get_submodule(name)
        params = {k: v for k, v in get_sdnq_params(m).items()}
        out[name] = (
            type(m),
            m.sdnq_dequantizer,
            {k: (v, None if v is None else v.clone()) for k, v in params.items()},
            set(m._parameters),
            m.bias.clone(),
        )
    return out


def assert_restored(model: nn.Module, snap: dict) -> None:
    for name, (cls, deq, params, pnames, bias) in snap.items():
        m = model.get_submodule(name)
        assert type(m) is cls and m.sdnq_dequantizer is deq, name
        assert set(m._parameters) == pnames, name
        for k, (obj, value) in params.items():
            now = getattr(m, k, None)
            assert now is obj, f"{name}.{k} is not the original object"
            assert value is None or torch.equal(now, value), f"{name}.{k} changed"
        assert torch.equal(m.bias, bias)
        assert not m._forward_hooks and "forward" not in m.__dict__, name


@torch.no_grad()
def layer_outputs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {n: model.get_submodule(n)(x) for n in ("a", "b")}


X = torch.randn(64, IN, generator=gen(99))
