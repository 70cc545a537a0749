"""Runtime mode inside ComfyUI: every tensor a runtime path reads is one ComfyUI's model management counts and
moves (loraweave.comfy.holder.FactorHolder), for every adapter family with a runtime path on Linear layers.

The tensors a forward reads are found independently of the paths' own declarations: a TorchDispatchMode
records, while a layer that carries a path runs, the storage of every tensor an aten op reads. A read is
accounted for when its storage is the layer's own parameter or buffer, the layer's input, a tensor made during
that call, or a parameter of the factor holder (the additional model ComfyUI loads with the MODEL), or the
cast of one such parameter to the compute dtype that the holder's caches keep between calls (dropped on every
move of the holder: test_a_move_drops_every_cast). Anything else (a factor, a rotation, a cached dense ΔW, a
gain or a scale vector held privately by a closure) is memory ComfyUI neither counts nor moves.
Then the holder is moved the ways model management moves it (Module.to: a dtype; ModelPatcher.load onto
another device, `meta` on a CPU box) and the paths must read the moved tensors: the sampled LATENT after the
fp64 move equals the one before within 1e-5 (fp32 compute either way), and after the meta move the forward can
no longer compute from its adapters."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_sampling import (  # noqa: F401  (pytest fixtures)
    flux_fixture,
    nothing_loaded_fixture,
    sample,
    unload_all,
)
from torch.utils._python_dispatch import TorchDispatchMode

from loraweave.comfy.api import read_lora
from loraweave.comfy.runtime import KEY, apply_runtime

pytestmark = pytest.mark.usefixtures("one_thread", "nothing_loaded")
STEPS = 2
TARGETS = ("double_blocks.0.img_attn.proj", "double_blocks.0.txt_mlp.0")  # 128x128 and 512x128 Linear layers


def _family_parts(family: str, rows: int, cols: int, first: bool, g: torch.Generator) -> dict:
    """One layer's tensors (role -> tensor) of `family`; `first` picks the variant (output / input side)."""
    r = 4
    rnd = lambda *shape, s=0.1: torch.randn(*shape, generator=g) * s  # noqa: E731
    alpha = {"alpha": torch.tensor(2.0)}
    if family == "lora":
        return {"lora_down.weight": rnd(r, cols), "lora_up.weight": rnd(rows, r), **alpha}
    if family == "dora":  # magnitude on the output rows, then on the input columns
        scale = torch.rand(rows, 1, generator=g) + 0.5 if first else torch.rand(1, cols, generator=g) + 0.5
        return {
            "lora_down.weight": rnd(r, cols),
            "lora_up.weight": rnd(rows, r),
            "dora_scale": scale,
            **alpha,
        }
    if family == "loha":
        return {"hada_w1_a": rnd(rows, r), "hada_w1_b": rnd(r, cols), "hada_w2_a": rnd(rows, r),
                "hada_w2_b": rnd(r, cols), **alpha}  # fmt: skip
    if family == "lokr":
        return {"lokr_w1": rnd(2, 2, s=1.0), "lokr_w2": rnd(rows // 2, cols // 2)}
    if family == "oft":  # plain, then with LyCORIS's rescale (not linear in strength)
        extra = {} if first else {"rescale": 1 + rnd(rows, 1)}
        return {"oft_blocks": rnd(rows // 4, 4, 4, s=0.2), "alpha": torch.tensor(0.0), **extra}
    if family == "boft":
        return {"oft_blocks": rnd(2, rows // 4, 4, 4, s=0.2), "alpha": torch.tensor(0.0)}
    if family == "ia3":  # output scale, then input scale (one extra product with W)
        n = rows if first else cols
        return {"weight": 1 + rnd(n), "on_input": torch.tensor(not first)}
    if family == "glora":
        return {"a1.weight": rnd(r, cols), "a2.weight": rnd(cols, r), "b1.weight": rnd(r, cols),
                "b2.weight": rnd(rows, r), **alpha}  # fmt: skip
    if family == "full":
        return {"diff": rnd(rows, cols, s=0.01), "diff_b": rnd(rows, s=0.01)}
    raise ValueError(family)


FAMILIES = ("lora", "dora", "loha", "lokr", "oft", "boft", "ia3", "glora", "full")


def family_lora(patcher, family: str, seed: int = 7) -> dict[str, torch.Tensor]:
    """A LyCORIS-named state dict of `family` on TARGETS of the tiny Flux in `patcher`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, target in enumerate(TARGETS):
        rows, cols = patcher.model.diffusion_model.get_submodule(target).weight.shape
        stem = "lora_unet_" + target.replace(".", "_")
        out |= {f"{stem}.{role}": t for role, t in _family_parts(family, rows, cols, i == 0, g).items()}
    return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class ReadRecorder(TorchDispatchMode):
    """Records, while `inside` is set (a path-carrying layer is running), every tensor an op reads whose
    storage is neither allowed (the layer's own tensors, its inputs), nor made by an op during that call, nor
    held by `holder` at that moment (held_storages)."""

    def __init__(self, holder) -> None:
        super().__init__()
        self.holder = holder
        self.inside: str | None = None
        self.allowed: set[int] = set()
        self.made: set[int] = set()
        self.foreign: dict[int, tuple[str, str, tuple, torch.dtype]] = {}

    def begin(self, name: str, module: torch.nn.Module, args) -> None:
        self.inside, self.made = name, set()
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        self.allowed = {_storage(t) for t in (*own, *args) if isinstance(t, torch.Tensor)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside is not None:
            flat = torch.utils._pytree.tree_leaves((args, kwargs))
            for t in flat:
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel():
                    ptr = _storage(t)
                    if (
                        ptr not in self.allowed
                        and ptr not in self.made
                        and ptr not in held_storages(self.holder)
                    ):
                        self.foreign.setdefault(ptr, (self.inside, str(func), tuple(t.shape), t.dtype))
        out = func(*args, **kwargs)
        if self.inside is not None:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self.made.add(_storage(t))
        return out


def reads_outside_holder(model, steps: int = 1) -> tuple[list[tuple], torch.Tensor]:
    """(reads no holder parameter accounts for, the LATENT) of sampling `model` with the recorder on."""
    state = model.get_attachment(KEY)
    recorder = ReadRecorder(state.holder)
    handles = []
    for rp in state.paths:
        name = next(n for n, m in model.model.named_modules() if m is rp.module)
        handles.append(
            rp.module.register_forward_pre_hook(
                lambda m, args, name=name: recorder.begin(name, m, args), prepend=True
            )
        )
        handles.append(rp.module.register_forward_hook(lambda *_: setattr(recorder, "inside", None)))
    try:
        with recorder:
            latent = sample(model, steps)["samples"]
    finally:
        for h in handles:
            h.remove()
    return list(recorder.foreign.values()), latent


def held_storages(holder) -> set[int]:
    """Storages of the holder's parameters, and of the (device, dtype) casts made from them that each cache
    keeps between calls (a workspace: dropped on every move of the holder, see
    test_a_move_drops_every_cast)."""
    casts = [t for cache, _ in getattr(holder, "slots", ()) for t in cache._cast]
    return {_storage(t) for t in (*holder.parameters(), *casts) if t.numel()}


def runtime(flux, family: str, strength: float = 0.8):
    lora = family_lora(flux, family)
    model, _, report = apply_runtime(flux, None, read_lora(lora), strength, 0.0)
    assert report.keys_applied == report.keys_total == len(lora), report.summary()
    assert {rp.module for rp in model.get_attachment(KEY).paths} == {
        flux.model.diffusion_model.get_submodule(t) for t in TARGETS
    }
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_a_path_reads_is_held_and_moved(flux, family):
    model = runtime(flux, family)
    state = model.get_attachment(KEY)
    sample(model, STEPS)  # every lazy cache a term keeps is built now, and read again below
    foreign, before = reads_outside_holder(model, STEPS)
    assert not foreign, f"{family}: the forward reads tensors model management does not hold: {foreign}"
    base = sample(flux, STEPS)["samples"]
    assert not torch.allclose(base, before, rtol=0, atol=1e-5), f"{family}: the adapter changed nothing"
    (holder,) = model.get_additional_models_with_key(KEY)
    assert holder.model_size() == state.factor_bytes() > 0
    unload_all(flux, model)

    holder.model.to(torch.float64)  # Module.to, as ModelPatcher.load / unpatch_model run it on the holder
    assert all(p.dtype == torch.float64 for p in holder.model.parameters())
    foreign, after = reads_outside_holder(model, STEPS)
    assert not foreign, f"{family}: after the move the forward reads unmoved tensors: {foreign}"
    assert torch.allclose(before, after, rtol=0, atol=1e-5), f"{family}: a stale or wrong read after the move"
    unload_all(flux, model)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_patcher_load_moves_every_tensor_read(flux, family):
    """ModelPatcher.load onto another device (meta on a CPU box) moves every held tensor, and the paths read
    them there: each layer's forward can no longer compute its adapter terms from real memory."""
    model = runtime(flux, family)
    state = model.get_attachment(KEY)
    sample(model, STEPS)  # lazy caches built
    unload_all(flux, model)
    (holder,) = model.get_additional_models_with_key(KEY)
    holder.load(device_to=torch.device("meta"), full_load=True)
    assert all(p.device.type == "meta" for p in holder.model.parameters())
    assert all(t.device.type == "meta" for rp in state.paths for t in rp.held_tensors())
    for (
        rp
    ) in state.paths:  # attached one at a time: a pair's attach casts it (warm), the others cast in forward
        x = torch.randn(2, 3, rp.module.in_features)
        try:
            with pytest.raises((NotImplementedError, RuntimeError), match="meta"):
                rp.attach()
                rp.module(x)
        finally:
            rp.detach()
    unload_all(flux, model)


@pytest.mark.parametrize("family", ["lora", "oft"])
def test_a_move_drops_every_cast(flux, family):
    """The casts a cache keeps between calls (a master read in another dtype: here fp64 masters read by fp32
    layers) never outlive a move of the holder: after Module.to each cache reads the moved parameters anew."""
    model = runtime(flux, family)
    (holder,) = model.get_additional_models_with_key(KEY)
    state = model.get_attachment(KEY)
    holder.model.to(torch.float64)
    caches = [cache for cache, _ in holder.model.slots]
    try:
        for rp in state.paths:
            rp.attach()
            rp.module(torch.randn(2, 3, rp.module.in_features))
        assert sum(bool(cache._cast) for cache in caches) >= len(state.paths), "too few casts to check"
        holder.model.to(torch.float32)
        assert not any(cache._cast for cache in caches), "a cast survived the move"
        params = {id(p) for p in holder.model.parameters()}
        assert all(id(t) in params and t.dtype == torch.float32 for cache in caches for t in cache.tensors)
    finally:
        for rp in state.paths:
            rp.detach()
    unload_all(flux, model)
