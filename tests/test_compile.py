"""torch.compile with runtime adapters (compile_friendly=True): compiled outputs equal eager ones, and
strength changes, disable/enable and switches within a rank bucket compile nothing new (a backend that counts
compilations).

Compiles run on CPU. The counting tests use dynamo + AOT autograd without inductor codegen ("aot_eager": every
graph dynamo captures still goes through the counting backend); the agreement tests run inductor on one
adapted block per model (before and after a strength change) and on each whole tiny model (about a minute of
codegen each on 2 cores)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from helpers.common import gen, rel_err
from helpers.tiny_models import flux_forward, tiny_flux, tiny_sdxl_unet, unet_forward
from torch._dynamo.testing import CompileCounter

import loraweave
from loraweave.request.spec import AdapterSpec

TOL = 1e-5
MODELS = {
    "flux": (tiny_flux, flux_forward, "transformer_blocks.0"),
    "sdxl_unet": (tiny_sdxl_unet, unet_forward, "down_blocks.1.attentions.0"),
}


def _layers(model: torch.nn.Module, every: int = 2, start: int = 0) -> list[str]:
    names = [n for n, m in model.named_modules() if type(m) in (torch.nn.Linear, torch.nn.Conv2d)]
    return names[start::every]


def _lora(model: torch.nn.Module, layers: list[str], rank: int, seed: int) -> dict[str, torch.Tensor]:
    g, sd = gen(seed), {}
    for path in layers:
        w = model.get_submodule(path).weight
        sd[f"{path}.lora_A.weight"] = torch.randn(rank, *w.shape[1:], generator=g) * 0.1
        sd[f"{path}.lora_B.weight"] = torch.randn(w.shape[0], rank, *([1] * (w.dim() - 2)), generator=g) * 0.1
    return sd


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # every test counts its own compilations (the model classes share code objects)
    yield
    torch._dynamo.reset()


def _run(fn, model):
    with torch.no_grad():
        return fn(model)


@pytest.mark.parametrize("name", MODELS)
def test_no_recompile_on_strength_disable_and_switch_within_a_bucket(name):
    make, forward, _ = MODELS[name]
    base = make()
    layers = _layers(base)
    a, b = _lora(base, layers, 8, seed=1), _lora(base, layers, 16, seed=2)
    model = copy.deepcopy(base)
    handle = loraweave.apply(
        model,
        AdapterSpec(a, 1.0, name="a"),
        mode="runtime",
        strict=True,
        compile_friendly=True,
        rank_buckets=(16, 64),
    )
    assert {m.mechanism for m in handle.report.applied} == {"runtime"}
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    plain = _run(forward, base)

    def agree() -> torch.Tensor:
        out = _run(forward, compiled)
        assert rel_err(out, _run(forward, model)) <= TOL
        return out

    first = agree()
    assert counter.frame_count == 1  # one graph: no break inside adapted layers (or anywhere else)
    assert rel_err(first, plain) > 1e-2  # the adapters do change the output
    for i in range(10):
        handle.set_strength("a", 0.1 * (i + 1) - 0.3)
        agree()
    for _ in range(3):
        handle.disable("a")
        assert rel_err(agree(), plain) <= TOL
        handle.enable("a")
        assert rel_err(agree(), first) > 0 and handle.strengths["a"] == pytest.approx(0.7)
    handle.switch(AdapterSpec(b, 0.8, name="b"))  # rank 16: same bucket as rank 8
    assert handle.last_switch["rebuilt"] == len(layers)
    switched = agree()
    handle.switch(AdapterSpec(a, 1.0, name="a"))
    assert rel_err(agree(), first) <= TOL
    assert counter.frame_count == 1, f"{counter.frame_count - 1} recompilations"
    assert rel_err(switched, plain) > 1e-2
    handle.remove()
    if name == "flux":  # removal recompiles (hooks gone; traced once more, so only on the smaller model)
        assert rel_err(_run(forward, compiled), plain) <= TOL


@pytest.mark.parametrize("setting", ["buckets_8_16", "not_compile_friendly"])
def test_negative_control_a_bucket_change_recompiles(setting):
    base = tiny_flux()
    layers = _layers(base)
    a, b = _lora(base, layers, 8, seed=1), _lora(base, layers, 16, seed=2)
    model = copy.deepcopy(base)
    kw = {"compile_friendly": True, "rank_buckets": (8, 16)} if setting == "buckets_8_16" else {}
    handle = loraweave.apply(model, AdapterSpec(a, 1.0, name="a"), mode="runtime", **kw)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    _run(flux_forward, compiled)
    handle.set_strength("a", 0.5)
    _run(flux_forward, compiled)
    assert counter.frame_count == 1
    handle.switch(AdapterSpec(b, 1.0, name="b"))  # rank 8 -> 16 crosses a bucket: new shapes
    assert rel_err(_run(flux_forward, compiled), _run(flux_forward, model)) <= TOL
    assert counter.frame_count == 2


def test_bucket_never_shrinks_on_a_switch_down():
    base = tiny_flux()
    layers = _layers(base)
    a, b = _lora(base, layers, 8, seed=1), _lora(base, layers, 16, seed=2)
    model = copy.deepcopy(base)
    handle = loraweave.apply(
        model, AdapterSpec(b, 1.0, name="b"), mode="runtime", compile_friendly=True, rank_buckets=(8, 16)
    )
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    _run(flux_forward, compiled)
    handle.switch(AdapterSpec(a, 1.0, name="a"))  # rank 16 -> 8: keeps the layer's bucket 16
    assert {rp.down.shape[0] for rp in handle.runtime_paths} == {16}
    assert rel_err(_run(flux_forward, compiled), _run(flux_forward, model)) <= TOL
    assert counter.frame_count == 1


def test_select_mode_layer_choices_do_not_recompile():
    base = tiny_flux()
    layers = _layers(base, every=3)
    subject, style = _lora(base, layers, 8, seed=3), _lora(base, layers, 8, seed=4)
    model = copy.deepcopy(base)
    handle = loraweave.apply(
        model,
        [AdapterSpec(subject, 1.0, name="subject"), AdapterSpec(style, 1.0, name="style")],
        stack="klora",
        compile_friendly=True,
    )
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    _run(flux_forward, compiled)
    for i, key in enumerate(sorted(f"{c}.{n}" for c, n in handle.runtime_layers())):
        handle.set_layer_choice(key, i % 2)
    assert rel_err(_run(flux_forward, compiled), _run(flux_forward, model)) <= TOL
    assert counter.frame_count == 1


@pytest.mark.parametrize("stack", ["ties", "dare_linear", "magnitude_prune"])
def test_stack_modes_that_break_the_graph_are_refused(stack):
    base = tiny_flux()
    layers = _layers(base, every=4)
    model = copy.deepcopy(base)
    sets = [AdapterSpec(_lora(base, layers, 4, seed=s), 1.0, name=f"x{s}") for s in (5, 6)]
    with pytest.raises(ValueError, match=f"stack='{stack}' rebuilds"):
        loraweave.apply(model, sets, mode="runtime", stack=stack, density=0.5, compile_friendly=True)
    assert all(not m._forward_hooks and "forward" not in m.__dict__ for m in model.modules())
    handle = loraweave.apply(model, sets, mode="runtime", compile_friendly=True)
    with pytest.raises(ValueError, match="rebuilds"):
        handle.switch(sets, stack=stack, density=0.5)
    assert handle.active  # refused before anything changed


@pytest.mark.parametrize("bad", [(), (16, 8), (0, 8), (8, 8), (8.0,), "16", 16])
def test_bad_rank_buckets(bad):
    model = tiny_flux()
    sd = _lora(model, _layers(model, every=8), 4, seed=7)
    with pytest.raises(ValueError, match="rank_buckets"):
        loraweave.apply(model, sd, mode="runtime", compile_friendly=True, rank_buckets=bad)
    with pytest.raises(ValueError, match="compile_friendly"):
        loraweave.apply(model, sd, mode="runtime", rank_buckets=(8,))
    assert all(not m._forward_hooks and "forward" not in m.__dict__ for m in model.modules())


def _block_call(model, forward, block_path: str):
    """(block, args, kwargs) of one adapted block as the model calls it."""
    block, seen = model.get_submodule(block_path), {}

    def grab(_module, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    hook = block.register_forward_pre_hook(grab, with_kwargs=True)
    _run(forward, model)
    hook.remove()
    return block, *seen["call"]


@pytest.mark.parametrize("name", MODELS)
def test_inductor_block_agrees_with_eager(name):
    make, forward, block_path = MODELS[name]
    base = make()
    model = copy.deepcopy(base)
    prefix = block_path + "."
    layers = [n for n in _layers(base, every=1) if n.startswith(prefix)]
    handle = loraweave.apply(
        model,
        AdapterSpec(_lora(base, layers, 8, seed=8), 1.0, name="a"),
        mode="runtime",
        strict=True,
        compile_friendly=True,
        rank_buckets=(16,),
    )
    block, args, kwargs = _block_call(model, forward, block_path)
    compiled = torch.compile(block, backend="inductor")
    with torch.no_grad():
        outs = [(compiled(*args, **kwargs), block(*args, **kwargs))]
        handle.set_strength("a", -0.6)
        outs.append((compiled(*args, **kwargs), block(*args, **kwargs)))
    for got, want in outs:
        got, want = (got, want) if isinstance(got, torch.Tensor) else (got[0], want[0])
        assert rel_err(got, want) <= TOL


@pytest.mark.parametrize("name", MODELS)
def test_inductor_whole_model_agrees_with_eager(name):
    make, forward, _ = MODELS[name]
    base = make()
    model = copy.deepcopy(base)
    loraweave.apply(
        model,
        AdapterSpec(_lora(base, _layers(base), 8, seed=9), 1.0),
        mode="runtime",
        compile_friendly=True,
        rank_buckets=(16,),
    )
    assert rel_err(_run(forward, torch.compile(model, backend="inductor")), _run(forward, model)) <= TOL


@pytest.mark.parametrize("mode", ["runtime", "merge"])
def test_disable_enable(mode):
    base = tiny_flux()
    layers = _layers(base, every=4)
    model = copy.deepcopy(base)
    handle = loraweave.apply(
        model,
        [
            AdapterSpec(_lora(base, layers, 4, seed=10), 0.6, name="a"),
            AdapterSpec(_lora(base, layers, 4, seed=11), 0.9, name="b"),
        ],
        mode=mode,
    )
    both, plain = _run(flux_forward, model), _run(flux_forward, base)
    handle.disable()
    assert rel_err(_run(flux_forward, model), plain) <= TOL and handle.strengths == {"a": 0.0, "b": 0.0}
    handle.enable("a")
    handle.enable("a")  # already on: nothing to do
    only_a = copy.deepcopy(base)
    loraweave.apply(only_a, AdapterSpec(_lora(base, layers, 4, seed=10), 0.6, name="a"), mode=mode)
    assert rel_err(_run(flux_forward, model), _run(flux_forward, only_a)) <= TOL
    handle.set_strength("b", 0.9)  # an explicit strength ends b's disable
    handle.enable()
    assert rel_err(_run(flux_forward, model), both) <= TOL and handle.strengths == {"a": 0.6, "b": 0.9}
    with pytest.raises(KeyError, match="no adapter named 'c'"):
        handle.disable("c")
    handle.remove()
    with pytest.raises(RuntimeError, match="removed"):
        handle.disable()
