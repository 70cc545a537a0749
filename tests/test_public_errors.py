"""Every public entry point refuses a bad argument with one error family: a `LoraweaveError` subclass
defined in `loraweave/errors.py` and exported from `loraweave`, still an instance of the built-in it replaces
(callers that catch ValueError/TypeError/KeyError/RuntimeError keep working), whose message names the
argument; and the model is left exactly as it was (every tensor bit for bit, the same modules, hooks and
loraweave attributes).

Entry points: apply, plan, stream, load_adapter, the Handle methods, loraweave.diffusers' drop-in,
loraweave.comfy.load_lora_for_models (ComfyUI imported in place: those cases carry the `comfy` marker),
serve's parse_request and the tools bodies the CLI calls."""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.persample_adapters import adapter
from helpers.tiny_models import tiny_flux

import loraweave
from loraweave import AdapterSpec, errors

SRC = Path(loraweave.__file__).parent
NAN, INF = float("nan"), float("inf")


@dataclass
class World:
    """What a case calls into: a tiny Flux model, two LoRAs on it (`a`, `b`), and what its setup built."""

    tmp: Path
    model: torch.nn.Module | None = None
    a: dict | None = None
    b: dict | None = None
    handle: object = None
    pipe: object = None
    comfy: object = None

    def modules(self) -> list[torch.nn.Module]:
        if self.comfy is not None:
            return [self.comfy.patcher.model, self.comfy.clip.patcher.model]
        return [self.model] if self.model is not None else []


def flux_world(tmp: Path) -> World:
    model = tiny_flux()
    return World(tmp, model, adapter(model, "lora", 1), adapter(model, "lora", 2))


def with_handle(tmp: Path, mode: str = "runtime", removed: bool = False) -> World:
    w = flux_world(tmp)
    w.handle = loraweave.apply(w.model, [AdapterSpec(w.a, name="a"), AdapterSpec(w.b, name="b")], mode=mode)
    if removed:
        w.handle.remove()
    return w


def with_pipe(tmp: Path) -> World:
    import diffusers

    import loraweave.diffusers as lwd

    w = flux_world(tmp)
    keys = diffusers.FluxPipeline._get_signature_keys(diffusers.FluxPipeline)[0]
    w.pipe = diffusers.FluxPipeline(**dict.fromkeys(keys) | {"transformer": w.model})
    lwd.enable(w.pipe)
    lora = {f"transformer.{k.removeprefix('base_model.model.')}": v for k, v in w.a.items()}
    w.pipe.load_lora_weights(lora, adapter_name="a")
    return w


@pytest.fixture(scope="module")
def comfy_sd15():
    """A tiny ComfyUI SD1.5 MODEL and CLIP (ComfyUI imported in place), built once for the comfy cases."""
    from helpers.comfy_models import BUILDERS

    return BUILDERS["sd15"]()


def with_comfy(tmp: Path, m=None) -> World:
    """The comfy cases' world: `m` is the comfy_sd15 fixture (the test passes it in)."""
    from helpers.comfy_files import adapter_file, kohya, target_linears

    return World(tmp, comfy=m, a=adapter_file(target_linears(m.diffusers), "lora", kohya("lora_unet_")))


def snapshot(w: World) -> tuple:
    """Everything a refused call must leave alone: tensors (as bytes), module types, hooks, loraweave
    attributes, and for ComfyUI the patch lists."""
    seen = []
    for root in w.modules():
        tensors = {k: v.detach().clone().contiguous() for k, v in root.state_dict(keep_vars=True).items()}
        mods = [
            (
                name,
                type(m),
                tuple(m._forward_hooks),
                tuple(m._forward_pre_hooks),
                tuple(m._backward_hooks),
                sorted(k for k in vars(m) if "loraweave" in k),
            )
            for name, m in root.named_modules()
        ]
        seen.append((tensors, mods))
    patches = None
    if w.comfy is not None:
        p, c = w.comfy.patcher, w.comfy.clip.patcher
        patches = (p.patches_uuid, dict(p.patches), c.patches_uuid, dict(c.patches))
    return seen, patches


def assert_same(before: tuple, after: tuple) -> None:
    (seen0, patches0), (seen1, patches1) = before, after
    assert patches0 == patches1
    assert len(seen0) == len(seen1)
    for (t0, mods0), (t1, mods1) in zip(seen0, seen1, strict=True):
        assert mods0 == mods1
        assert t0.keys() == t1.keys()
        for key, x in t0.items():
            y = t1[key]
            assert x.dtype == y.dtype and x.shape == y.shape, key
            assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), key


@dataclass
class Case:
    id: str
    setup: Callable[[Path], World]
    call: Callable[[World], object]
    error: type[errors.LoraweaveError]
    builtin: type[Exception] | None  # the built-in it replaces (callers catch that); None: was typed already
    names: str  # regex the message must match: the argument's name (a word), or the value it names


def _apply(*adapters: str, **kw):
    """apply(model, the world's adapters by attribute (default `a`), **kw)."""
    return lambda w: loraweave.apply(w.model, [getattr(w, n) for n in adapters or "a"], **kw)


def _spec(**kw):
    return lambda w: loraweave.apply(w.model, [AdapterSpec(w.a, **kw)])


def _stream(**kw):
    return lambda w: loraweave.stream(w.model, **{"budget": 10**9, "device": "cpu", **kw})


def _handle(method: str, *args, enter: bool = False, **kw):
    """handle.<method>(*args, **kw), entered when it is a context manager (`batch`)."""

    def call(w):
        out = getattr(w.handle, method)(*args, **kw)
        return out.__enter__() if enter else out

    return call


def _switch(**kw):
    return lambda w: w.handle.switch(w.a, **kw)


def _pipe(method: str, *args, **kw):
    return lambda w: getattr(w.pipe, method)(*args, **kw)


def _request(body):
    def call(w):
        from loraweave.serve.engine import AdapterFolder, parse_request

        return parse_request(body, AdapterFolder(w.tmp))

    return call


def _comfy(lora=None, s_model=1.0, s_clip=1.0, **kw):
    def call(w):
        from loraweave.comfy import load_lora_for_models

        lora_ = w.a if lora is None else str(w.tmp / lora) if lora == "no.safetensors" else lora
        return load_lora_for_models(w.comfy.patcher, w.comfy.clip, lora_, s_model, s_clip, **kw)

    return call


def sd2_lora() -> dict[str, torch.Tensor]:
    """A kohya UNet LoRA whose cross-attention factor is 1024 wide: an SD2 file by its shapes."""
    stem = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k"
    return {f"{stem}.lora_down.weight": torch.zeros(4, 1024), f"{stem}.lora_up.weight": torch.zeros(320, 4)}


def _tool(name: str, **kw):
    """A tools body the CLI calls, on a file that does not exist (the argument is refused first)."""

    def call(w):
        from loraweave.tools.convert import convert
        from loraweave.tools.plot import block_grid

        body = {"convert": convert, "block_grid": block_grid}[name]
        return body(w.tmp / "a.safetensors", **kw)

    return call


def _removed(t: Path) -> World:
    return with_handle(t, removed=True)


def _merged(t: Path) -> World:
    return with_handle(t, "merge")


def _call_scale(w: World):
    """A denoiser call whose per-call scale is not a number (the drop-in's pre-hook reads it first)."""
    return w.pipe.transformer(torch.zeros(1), joint_attention_kwargs={"scale": "x"})


def _enable(w: World):
    import loraweave.diffusers as lwd

    return lwd.enable(object())


A, T, K, S = errors.ArgumentError, errors.ArgumentTypeError, errors.UnknownNameError, errors.StateError
B, G, D, Q = errors.BatchError, errors.RegionError, errors.DropInError, errors.ServeRequestError
F, H, R, P = flux_world, with_handle, _removed, with_pipe
V, TE, KE, RE = ValueError, TypeError, KeyError, RuntimeError
AF, W = errors.AdapterFileError, errors.WrongArchitectureError
OTHER = r"an SD2 LoRA on (a Flux|an SD1\.5) model\b.*\ballow_other_arch=True"
NO, NOFILE = "no.safetensors", r"no\.safetensors"
ONES = torch.ones(4, 4)
# fmt: off
CASES = [
    # apply: every option, the adapters argument, the target
    Case("apply-mode", F, _apply(mode="x"), A, V, r"\bmode\b"),
    Case("apply-strength-nan", F, _apply(strength=NAN), A, V, r"\bstrength\b"),
    Case("apply-strength-text", F, _apply(strength="0.5"), A, V, r"\bstrength\b"),
    Case("apply-stack", F, _apply(stack="bogus"), A, V, r"\bstack\b"),
    Case("apply-density-range", F, _apply("a", "b", stack="ties", density=2.0), A, V, r"\bdensity\b"),
    Case("apply-density-missing", F, _apply("a", "b", stack="ties"), A, V, r"\bdensity\b"),
    Case("apply-density-unused", F, _apply(density=0.5), A, V, r"\bdensity\b"),
    Case("apply-select-one-adapter", F, _apply(stack="klora", mode="runtime"), A, V, r"\bstack\b"),
    Case("apply-select-merge", F, _apply("a", "b", stack="klora", mode="merge"), A, V, r"\bmode\b"),
    Case("apply-quantized", F, _apply(quantized="x"), A, V, r"\bquantized\b"),
    Case("apply-host-rank", F, _apply(host_rank=-1), A, V, r"\bhost_rank\b"),
    Case("apply-undo", F, _apply(undo="x"), A, V, r"\bundo\b"),
    Case("apply-undo-source", F, _apply(undo_source="x"), A, V, r"\bundo_source\b"),
    Case("apply-compile-friendly", F, _apply(compile_friendly="yes"), T, TE, r"\bcompile_friendly\b"),
    Case("apply-rank-buckets", F, _apply(compile_friendly=True, rank_buckets=[0]), A, V, r"\brank_buckets\b"),
    Case("apply-rank-buckets-unused", F, _apply(rank_buckets=[8]), A, V, r"\brank_buckets\b"),
    Case("apply-adapters-int", F, lambda w: loraweave.apply(w.model, 42), A, V, r"\badapters\b"),
    Case("apply-adapters-item", F, lambda w: loraweave.apply(w.model, [42]), T, TE, r"\badapters\b"),
    Case("apply-adapters-none", F, lambda w: loraweave.apply(w.model, [None]), A, V, r"\badapter source\b"),
    Case("apply-block-weights", F, _spec(block_weights="nonsense"), A, V, r"\bblock_weights\b"),
    Case("apply-block-weights-len", F, _spec(block_weights=[1.0] * 3), A, V, r"\bblock_weights\b"),
    Case("apply-block-weights-nan", F, _spec(block_weights=[1, NAN, 1, 1, 1]), A, V, r"\bblock_weights\b"),
    Case("apply-missing-file", F, lambda w: loraweave.apply(w.model, w.tmp / NO), AF, None, NOFILE),
    Case("apply-target", F, lambda w: loraweave.apply(42, w.a), errors.TargetError, None, r"\btarget\b"),
    Case("apply-allow-other-arch", F, _apply(allow_other_arch="yes"), T, TE, r"\ballow_other_arch\b"),
    Case("apply-other-arch", F, lambda w: loraweave.apply(w.model, sd2_lora()), W, None, OTHER),
    # plan
    Case("plan-strength", F, lambda w: loraweave.plan(w.model, w.a, strength=INF), A, V, r"\bstrength\b"),
    Case("plan-adapters", F, lambda w: loraweave.plan(w.model, 42), A, V, r"\badapters\b"),
    Case("plan-target", F, lambda w: loraweave.plan(None, w.a), errors.TargetError, None, r"\btarget\b"),
    # stream
    Case("stream-budget-negative", F, _stream(budget=-1), A, V, r"\bbudget\b"),
    Case("stream-budget-text", F, _stream(budget="lots"), A, V, r"\bbudget\b"),
    Case("stream-budget-small", F, _stream(budget=10), errors.BudgetTooSmall, V, r"\bbudget\b"),
    Case("stream-margin", F, _stream(margin=-1), A, V, r"\bmargin\b"),
    Case("stream-placement", F, _stream(placement="x"), A, V, r"\bplacement\b"),
    Case("stream-device", F, _stream(device="nope"), A, V, r"\bdevice\b"),
    Case("stream-storage", F, _stream(storage="nope"), A, V, r"\bstorage\b"),
    Case("stream-blocks", F, _stream(blocks=["nope"]), A, V, r"\bblocks\b"),
    # load_adapter
    Case("load-missing", F, lambda w: loraweave.load_adapter(w.tmp / NO), AF, None, NOFILE),
    Case("load-int", F, lambda w: loraweave.load_adapter(42), T, TE, r"\bsource\b"),
    Case("load-none", F, lambda w: loraweave.load_adapter(None), T, TE, r"\bsource\b"),
    # Handle methods
    Case("set-strength-nan", H, _handle("set_strength", "a", NAN), A, V, r"\bstrength\b"),
    Case("set-strength-te", H, _handle("set_strength", "a", 1.0, te=INF), A, V, r"\bte\b"),
    Case("set-strength-name", H, _handle("set_strength", "zz", 1.0), K, KE, r"adapter named 'zz'"),
    Case("disable-name", H, _handle("disable", "zz"), K, KE, r"adapter named 'zz'"),
    Case("batch-name", H, _handle("batch", [["zz"]], enter=True), B, V, r"adapter named 'zz'"),
    Case("batch-kind", H, _handle("batch", "a", enter=True), B, V, r"\bassignments\b"),
    Case("batch-strength", H, _handle("batch", [["a"]], [[NAN]], enter=True), B, V, r"\bstrength\b"),
    Case("region-name", H, _handle("set_region", "zz", ONES), G, V, r"adapter named 'zz'"),
    Case("region-mask", H, _handle("set_region", "a", torch.ones(4)), G, V, r"\bmask\b"),
    Case("switch-strength", H, _switch(strength=NAN), A, V, r"\bstrength\b"),
    Case("switch-stack", H, _switch(stack="bogus"), A, V, r"\bstack\b"),
    Case("switch-adapters", H, lambda w: w.handle.switch(42), A, V, r"\badapters\b"),
    Case("step-schedule-steps", H, _handle("step_schedule", 0), A, V, r"\btotal_steps\b"),
    Case("step-schedule-windows", H, _handle("step_schedule", 10), A, V, r"\bsteps="),
    Case("select-schedule-stack", H, _handle("select_schedule", 10), S, RE, r"\bstack="),
    Case("layer-choice-stack", H, _handle("set_layer_choice", "x", 0), S, RE, r"\bstack="),
    Case("removed-set-strength", R, _handle("set_strength", "a", 1.0), S, RE, r"\bremoved\b"),
    Case("removed-disable", R, _handle("disable"), S, RE, r"\bremoved\b"),
    Case("removed-switch", R, _switch(), S, RE, r"\bremoved\b"),
    Case("removed-step-schedule", R, _handle("step_schedule", 10), S, RE, r"\bremoved\b"),
    Case("removed-batch", R, _handle("batch", [["a"]], enter=True), B, V, r"\bremoved\b"),
    Case("removed-region", R, _handle("set_region", "a", ONES), G, V, r"\bremoved\b"),
    Case("merged-batch", _merged, _handle("batch", [["a"]], enter=True), B, V, r"\bmode='runtime'"),
    # loraweave.diffusers drop-in
    Case("dropin-load-kind", P, _pipe("load_lora_weights", 42, adapter_name="b"), D, V, r"\bint\b"),
    Case("dropin-load-name", P, lambda w: w.pipe.load_lora_weights(dict(w.b), adapter_name="a"),
         D, V, r"Adapter name a\b"),
    Case("dropin-set-name", P, _pipe("set_adapters", ["zz"]), D, V, r"'zz'"),
    Case("dropin-set-names-kind", P, _pipe("set_adapters", 42), T, TE, r"\badapter_names\b"),
    Case("dropin-set-weights-len", P, _pipe("set_adapters", ["a"], [0.5, 0.5]), D, V, r"\bweights\b"),
    Case("dropin-set-weights-nan", P, _pipe("set_adapters", ["a"], [NAN]), D, V, r"\bweight\b"),
    Case("dropin-fuse-scale", P, _pipe("fuse_lora", lora_scale=NAN), A, V, r"\blora_scale\b"),
    Case("dropin-call-scale", P, _call_scale, T, V, r"\bscale\b"),
    Case("dropin-enable", F, _enable, errors.NotLoraPipelineError, None, r"\bpipeline\b"),
    # serve's request parser
    Case("serve-body", F, _request(None), Q, V, r"\bprompt\b"),
    Case("serve-steps", F, _request({"prompt": "x", "steps": "a"}), Q, V, r"\bsteps\b"),
    Case("serve-cfg", F, _request({"prompt": "x", "cfg": NAN}), Q, V, r"\bcfg\b"),
    Case("serve-adapters", F, _request({"prompt": "x", "adapters": "a"}), Q, V, r"\badapters\b"),
    Case("serve-adapter-name", F, _request({"prompt": "x", "adapters": [{"name": ".."}]}), Q, V, "'..'"),
    Case("serve-tag", F, _request({"prompt": "x <lora:nope:1>"}), Q, V, r"'nope'"),
    # tools bodies the CLI calls
    Case("convert-to", F, _tool("convert", to="x", output="out.safetensors"), A, V, r"--to\b"),
    Case("block-grid-metric", F, _tool("block_grid", metric="x"), A, V, r"\bmetric\b"),
]
COMFY_CASES = [
    Case("comfy-mode", with_comfy, _comfy(mode="fuse"), A, V, r"\bmode\b"),
    Case("comfy-strength-model", with_comfy, _comfy(s_model=NAN), A, V, r"\bstrength_model\b"),
    Case("comfy-strength-clip", with_comfy, _comfy(s_clip="1"), A, V, r"\bstrength_clip\b"),
    Case("comfy-lora-kind", with_comfy, _comfy(lora=42), T, TE, r"\blora\b"),
    Case("comfy-missing-file", with_comfy, _comfy(lora="no.safetensors"), AF, None, NOFILE),
    Case("comfy-allow-other-arch", with_comfy, _comfy(allow_other_arch=1), T, TE, r"\ballow_other_arch\b"),
    Case("comfy-other-arch", with_comfy, _comfy(lora=sd2_lora()), W, None, OTHER),
]
# fmt: on
PARAMS = [pytest.param(c, id=c.id) for c in CASES] + [
    pytest.param(c, id=c.id, marks=pytest.mark.comfy) for c in COMFY_CASES
]


@pytest.mark.parametrize("case", PARAMS)
def test_bad_argument_gets_a_typed_error_and_changes_nothing(case: Case, tmp_path, request):
    if case.setup is with_comfy:
        w = with_comfy(tmp_path, request.getfixturevalue("comfy_sd15"))
    else:
        w = case.setup(tmp_path)
    before = snapshot(w)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the type is checked below, exactly
        case.call(w)
    err = caught.value
    assert type(err) is case.error, f"{type(err).__mro__}: {err}"
    assert type(err).__module__ == "loraweave.errors"
    assert getattr(loraweave, type(err).__name__) is type(err) and type(err).__name__ in loraweave.__all__
    if case.builtin is not None:
        assert isinstance(err, case.builtin)
    assert re.search(case.names, str(err)), str(err)
    assert_same(before, snapshot(w))


def test_every_error_class_lives_in_errors_and_is_exported():
    defined = {
        name: cls
        for name, cls in vars(errors).items()
        if inspect.isclass(cls) and issubclass(cls, Exception) and cls.__module__ == errors.__name__
    }
    assert all(issubclass(cls, errors.LoraweaveError) for cls in defined.values())
    for name, cls in defined.items():
        assert getattr(loraweave, name) is cls and name in loraweave.__all__, name
    # No exception class is defined anywhere else in the package, but two internal ones that never leave their
    # module: families' PartRejected (caught where parts are planned, turned into report misses) and the merge
    # pass's CopySmaller (caught in merge_in_place, which then keeps a copy record).
    elsewhere = []
    for path in SRC.rglob("*.py"):
        if path.name == "errors.py" and path.parent == SRC:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            bases = [ast.unparse(b) for b in getattr(node, "bases", [])]
            if isinstance(node, ast.ClassDef) and any(
                b.endswith(("Error", "Exception", "Exceeded", "TooSmall")) for b in bases
            ):
                elsewhere.append(f"{path.relative_to(SRC)}:{node.name}")
    assert sorted(elsewhere) == ["families/base.py:PartRejected", "mechanisms/merge/inplace.py:CopySmaller"]


def test_the_replaced_builtins_stay_caught():
    assert issubclass(errors.BudgetTooSmall, ValueError) and issubclass(errors.BudgetExceeded, RuntimeError)
    assert issubclass(errors.ArgumentTypeError, TypeError) and issubclass(
        errors.ArgumentTypeError, ValueError
    )
    assert issubclass(errors.UnknownNameError, KeyError) and issubclass(errors.UnknownNameError, ValueError)
    assert issubclass(errors.StateError, RuntimeError)
    assert (
        str(errors.UnknownNameError("no adapter named 'x'")) == "no adapter named 'x'"
    )  # not KeyError's repr
