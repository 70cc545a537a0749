"""Quantized bases and streaming slots at real layer sizes.

| test                    | shapes                                              | backends / modes           |
|-------------------------|-----------------------------------------------------|----------------------------|
| SDNQ                    | Flux single proj_out 3072x15360 (47.2M), fp32 math  | int8, uint4 x auto (factor |
|                         |                                                     |   channel), runtime, merge |
|                         |                                                     |   (requantize/hosted)      |
| other backends, runtime | Flux ff.net.0.proj 12288x3072 + ff.net.2 3072x12288 | bnb int8 and nf4, torchao  |
|                         |   (37.7M each)                                      |   int8, quanto qint8, GGUF |
|                         |                                                     |   Q8_0                     |
| streaming slots         | the Flux ff pair + ff.net.0.proj as 3 blocks, bf16  | runtime LoRA, strength     |
|                         |                                                     |   change                   |

References: a layer's output change equals x·(s·B·A)ᵀ in fp64 (relative error ≤ 1e-4, the peers' float-layer
tolerance in test_quant_backends / test_quant_sdnq); merges into quantized storage report their retention;
`remove()` gives back every storage tensor and the exact outputs. Streamed forwards are bit-equal to the same
model unstreamed."""

from __future__ import annotations

import pytest
import torch
from helpers.common import rel_err
from helpers.quant_backends import CASES
from helpers.realsize import (
    RealLayer,
    assert_seeded,
    holder,
    layer_input,
    lora_for,
    lora_term64,
    materialized,
)
from torch import nn

import loraweave
from loraweave.streaming import stream

FLUX_PROJ_OUT = RealLayer("flux", "single_transformer_blocks.0.proj_out", (3072, 15360))
FLUX_FF = (
    RealLayer("flux", "transformer_blocks.0.ff.net.0.proj", (12288, 3072)),
    RealLayer("flux", "transformer_blocks.0.ff.net.2", (3072, 12288)),
)
TOL = 1e-4
# 2 threads on 2 shared cores spin in OpenMP barriers: ~10x a merge's CPU time (and wall time) under load
pytestmark = pytest.mark.usefixtures("one_thread")
SEED = 9


def _flat(name: str, t: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """A tensor subclass (torchao, quanto) by its inner plain tensors; anything else as itself, cloned."""
    if hasattr(t, "__tensor_flatten__"):
        for inner in t.__tensor_flatten__()[0]:
            _flat(f"{name}.{inner}", getattr(t, inner), out)
    else:
        out[name] = t.as_subclass(torch.Tensor).detach().clone()  # bnb's Int8Params/Params4bit: no detach


def storage(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a quantized layer holds (parameters and buffers, subclasses flattened), cloned."""
    out: dict[str, torch.Tensor] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        _flat(name, t, out)
    return out


def assert_same_storage(module: nn.Module, before: dict[str, torch.Tensor], what: str) -> None:
    now = storage(module)
    assert now.keys() == before.keys(), what
    for k, v in now.items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), f"{what}: {k} changed"


@pytest.mark.parametrize("weights_dtype", ["int8", "uint4"])
def test_sdnq_layer_at_real_size(weights_dtype):
    from sdnq import sdnq_post_load_quant

    root = holder(FLUX_PROJ_OUT)
    lora = lora_for(FLUX_PROJ_OUT)
    x = layer_input(FLUX_PROJ_OUT, torch.float32, seed=4)
    with materialized(root, ["layer"], torch.float32, SEED), torch.no_grad():
        sdnq_post_load_quant(
            root, add_skip_keys=False, weights_dtype=weights_dtype, torch_dtype=torch.float32
        )
        assert type(root.layer).__name__ == "SDNQLinear"
        base, before = root(x), storage(root.layer)
        term = 0.8 * lora_term64(FLUX_PROJ_OUT, x, lora)
        for mode, expect in (("auto", {"factor"}), ("runtime", {"runtime"})):
            handle = loraweave.apply(root, (lora.state_dict("layer"), 0.8), mode=mode, strict=True)
            assert {m.mechanism for m in handle.report.applied} == expect
            assert rel_err(root(x).double() - base.double(), term) <= TOL, (weights_dtype, mode)
            handle.remove()
            assert_same_storage(root.layer, before, f"{weights_dtype} {mode}")
            assert torch.equal(root(x), base)
        handle = loraweave.apply(root, (lora.state_dict("layer"), 0.8), mode="merge", quantized="requantize")
        (applied,) = handle.report.applied
        assert applied.mechanism == "requantize" and applied.retention is not None
        # int8 keeps a 5% ΔW to within 5%; uint4's grid step is larger than most of it (the routing would host
        # it)
        low, high = (0.95, 1.05) if weights_dtype == "int8" else (0.0, 1.0)
        assert low <= applied.retention <= high, applied.retention
        handle.remove()
        assert_same_storage(root.layer, before, f"{weights_dtype} requantize")
        assert torch.equal(root(x), base)


class FfPair(nn.Sequential):
    """Flux's FFN pair at its real shapes, as the quant-backend builders name layers ("0", "1")."""

    def __init__(self) -> None:
        super().__init__(*(nn.Linear(layer.shape[1], layer.shape[0], device="meta") for layer in FLUX_FF))


def ff_lora() -> dict[str, torch.Tensor]:
    sd = {}
    for i, layer in enumerate(FLUX_FF):
        sd |= lora_for(layer, seed=20 + i).state_dict(str(i))
    return sd


def ff_inputs() -> dict[str, torch.Tensor]:
    return {str(i): layer_input(layer, torch.float32, seed=30 + i) for i, layer in enumerate(FLUX_FF)}


@pytest.mark.parametrize(
    "case",
    [
        ("bitsandbytes", "int8"),
        ("bitsandbytes", "nf4"),
        ("torchao", "int8"),
        ("quanto", "qint8"),
        ("gguf", "Q8_0"),
    ],
    ids="-".join,
)
def test_other_backends_runtime_at_real_size(case):
    model = FfPair()
    with materialized(model, ["0", "1"], torch.float32, SEED), torch.no_grad():
        model = CASES[case][0](model).eval()
        xs = ff_inputs()
        base = {n: model.get_submodule(n)(x) for n, x in xs.items()}  # also the layers' first-forward work
        base = {n: model.get_submodule(n)(x) for n, x in xs.items()}
        before = {n: storage(model.get_submodule(n)) for n in xs}
        sd = ff_lora()
        handle = loraweave.apply(model, sd, mode="runtime", strict=True)
        for i, layer in enumerate(FLUX_FF):
            n = str(i)
            factors = lora_for(layer, seed=20 + i)
            got = model.get_submodule(n)(xs[n]).double() - base[n].double()
            assert rel_err(got, lora_term64(layer, xs[n], factors)) <= TOL, (case, n)
        handle.remove()
        for n, x in xs.items():
            assert_same_storage(model.get_submodule(n), before[n], f"{case} {n}")
            assert torch.equal(model.get_submodule(n)(x), base[n])
        for i, layer in enumerate(
            FLUX_FF
        ):  # drop the quantized layers (bnb's cannot move to meta) for meta ones
            model._modules[str(i)] = nn.Linear(layer.shape[1], layer.shape[0], device="meta")


class Streamed(nn.Module):
    """Three real-size blocks (Flux's ff pair, then its first layer again), streamed by path."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = FfPair()
        self.blocks.append(nn.Linear(FLUX_FF[0].shape[1], FLUX_FF[0].shape[0], device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def test_streaming_slots_at_real_size():
    model = Streamed()
    plain = Streamed()
    x = layer_input(FLUX_FF[0], torch.bfloat16, seed=40)
    paths = ["blocks.0", "blocks.1", "blocks.2"]
    with (
        materialized(model, paths, torch.bfloat16, SEED),
        materialized(plain, paths, torch.bfloat16, SEED),
        torch.no_grad(),
    ):
        sd = {f"blocks.{k}": v for k, v in ff_lora().items()}
        sd |= lora_for(FLUX_FF[0], seed=22).state_dict("blocks.2")
        ref = loraweave.apply(plain, sd, mode="runtime")
        block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
        # two slots of a block and its factors, and no room for a resident one besides: all three stream
        s = stream(model, budget=int(block_bytes * 2.1), device="cpu", blocks=paths, trace=True)
        try:
            handle = loraweave.apply(model, sd, mode="runtime")
            assert len(s.plan.streamed) == 3
            for strength in (1.0, -0.5):
                ref.set_strength(name_of(ref), strength)
                handle.set_strength(name_of(handle), strength)
                want = plain(x)
                assert torch.equal(model(x), want)
                assert torch.equal(model(x), want)
            handle.remove()
        finally:
            s.close()
        ref.remove()
        assert torch.equal(model(x), plain(x))
        for i, p in enumerate(paths):
            assert_seeded(model.get_submodule(p).weight, SEED + i, f"{p} after streaming")


def name_of(handle) -> str:
    (name,) = handle.strengths
    return name
