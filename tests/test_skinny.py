"""The runtime path's thin GEMMs on oneDNN (mechanisms/runtime/skinny.py): exact to fp32 rounding against
F.linear (the MKL kernel the path used before), taken where it applies, F.linear everywhere else (checked by a
spy on the op)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import loraweave
from loraweave.mechanisms.runtime import skinny


@pytest.fixture
def spy(monkeypatch):
    """Counts calls of the oneDNN op (probed for real first: this torch build has it)."""
    skinny._PROBED.clear()
    x = torch.randn(4, 8)
    skinny.skinny_linear(x, torch.randn(2, 8))
    assert (
        torch.backends.mkldnn.is_available() and skinny._PROBED[0] is not None
    )  # else the tests below prove nothing
    real, calls = skinny._PROBED[0], []

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(skinny, "_PROBED", [counted])
    return calls


class _Sub(torch.Tensor):
    pass


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("shape", [(4096, 384), (3, 7, 384), (1, 384)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(spy, shape, bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(16, shape[-1], generator=g)
    b = torch.randn(16, generator=g) if bias else None
    with torch.inference_mode():
        got = skinny.skinny_linear(x, w, b)
    assert spy == [x.shape]
    assert got.shape == (*shape[:-1], 16) and got.is_contiguous()
    assert _rel(got, F.linear(x, w, b)) < 1e-6


def test_falls_back_where_it_does_not_apply(spy):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 32, generator=g), torch.randn(8, 32, generator=g)
    cases = {
        "float64": (x.double(), w.double()),
        "bfloat16": (x.bfloat16(), w.bfloat16()),
        "strided input": (x.t().contiguous().t(), w),
        "strided weight": (x, w.t().contiguous().t()),
        "tensor subclass": (x.as_subclass(_Sub), w),
    }
    for name, (a, b) in cases.items():
        assert torch.equal(skinny.skinny_linear(a, b), F.linear(a, b)), name
    with pytest.raises(RuntimeError):  # mixed dtypes: F.linear's own error, not a silent oneDNN result
        skinny.skinny_linear(x, w, torch.zeros(8, dtype=torch.float64))
    wg = w.clone().requires_grad_(True)
    out = skinny.skinny_linear(x, wg)  # autograd needs F.linear: the op has no backward
    out.sum().backward()
    assert wg.grad is not None and torch.allclose(wg.grad, x.sum(0).expand(8, -1), rtol=1e-5, atol=1e-5)
    assert spy == []


def test_runtime_linear_uses_it_and_matches_the_mkl_formula(spy):
    """The fused nn.Linear forward: both thin GEMMs on oneDNN, equal to the former all-addmm path within
    1e-6."""
    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(384, 256)
    down, up = torch.randn(16, 384, generator=g) / 20, torch.randn(256, 16, generator=g) / 4
    sd = {
        "lora_unet_proj.lora_down.weight": down,
        "lora_unet_proj.lora_up.weight": up,
        "lora_unet_proj.alpha": torch.tensor(8.0),
    }
    model = torch.nn.Module()
    model.proj = copy.deepcopy(lin)
    loraweave.apply(model, sd, mode="runtime", strict=True)
    x = torch.randn(2, 300, 384, generator=g)
    with torch.inference_mode():
        got = model.proj(x)
        x2 = x.view(-1, 384)
        h = (x2 @ down.t()) * 0.5
        ref = torch.addmm(lin.bias, h, up.t()).addmm_(x2, lin.weight.t()).view(2, 300, 256)
    assert spy == [(600, 384), (600, 16)]
    assert _rel(got, ref) < 1e-6
    with torch.inference_mode():
        merged = F.linear(x, lin.weight + 0.5 * up @ down, lin.bias)
    assert _rel(got, merged) < 1e-5  # and the adapter really is in it
    assert _rel(F.linear(x, lin.weight, lin.bias), merged) > 1e-3


def _compiled_targets(fn, *args):
    """(output, every call target in the graph dynamo captured) of torch.compile(fn) on args."""
    import torch._dynamo

    torch._dynamo.reset()
    targets = []

    def record(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    with torch.inference_mode():
        out = torch.compile(fn, backend=record)(*args)
    torch._dynamo.reset()
    return out, targets


def _adapted_linear(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(96, 64)
    sd = {
        "lora_unet_proj.lora_down.weight": torch.randn(8, 96, generator=g) / 10,
        "lora_unet_proj.lora_up.weight": torch.randn(64, 8, generator=g) / 4,
        "lora_unet_proj.alpha": torch.tensor(4.0),
    }
    return model, sd, torch.randn(2, 50, 96, generator=g)


def test_compiled_runtime_linear_calls_the_onednn_custom_op():
    """Under torch.compile the thin GEMMs are `loraweave::onednn_linear` calls (inductor would lower F.linear
    to MKL's mm: benchmarks/bench_compile.py), probed at apply, not inside the trace; outputs equal eager."""
    skinny._PROBED.clear()
    model, sd, x = _adapted_linear()
    loraweave.apply(model, sd, mode="runtime", strict=True, compile_friendly=True, rank_buckets=(8,))
    assert skinny._PROBED and skinny._PROBED[0] is not None  # attach ran the probe
    got, targets = _compiled_targets(model.proj, x)
    assert targets.count(torch.ops.loraweave.onednn_linear.default) == 2, targets
    with torch.inference_mode():
        want = model.proj(x)
    assert _rel(got, want) <= 1e-6


def test_no_probe_inside_a_trace(monkeypatch):
    """Compiled before any probe: F.linear, and the probe does not run while tracing (its ops would be
    traced)."""
    monkeypatch.setattr(skinny, "_PROBED", [])
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(40, 32, generator=g), torch.randn(8, 32, generator=g)
    got, targets = _compiled_targets(skinny.skinny_linear, x, w)
    assert torch.ops.loraweave.onednn_linear.default not in targets and skinny._PROBED == []
    assert torch.equal(got, F.linear(x, w))
