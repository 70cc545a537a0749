"""What a handle keeps in memory beyond the model, counted in tensor storage (not RSS): a runtime path reads a
single LoRA's factors from the adapter's own tensors instead of holding a copy where the adapter owns them (a
file read whole), copies them once where it does not (a mapped file may be saved over while applied), and
merge-mode steps leave no buffer in a reference cycle (memory Python frees only when its cyclic collector
runs)."""

from __future__ import annotations

import gc

import torch
from safetensors.torch import load_file, save_file

import loraweave
from loraweave.formats.adapter import load_adapter

RANK = 4


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96),
        torch.nn.Linear(96, 64),
        torch.nn.Conv2d(64, 48, 3, padding=1),
        torch.nn.Conv2d(48, 32, 1),
    )


def _lora_file(model: torch.nn.Module, path, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            w = m.weight
            sd[f"{name}.lora_A.weight"] = torch.randn(RANK, *w.shape[1:], generator=g) * 0.1
            up_shape = (w.shape[0], RANK, *([1] * (w.dim() - 2)))
            sd[f"{name}.lora_B.weight"] = torch.randn(*up_shape, generator=g) * 0.1
    save_file(sd, str(path))
    return str(path)


def _spans(tensors) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


def _copied_bytes(handle) -> int:
    """Bytes of the tensors the runtime paths hold that are not views of the adapters' own tensors."""
    factors = [
        t for pp in handle.planned for t in (pp.factors.down, pp.factors.up) if isinstance(t, torch.Tensor)
    ]
    spans = _spans(factors)
    held = {id(t): t for rp in handle.runtime_paths for t in rp.held_tensors()}.values()
    return sum(
        t.numel() * t.element_size() for t in held if not any(lo <= t.data_ptr() < hi for lo, hi in spans)
    )


def _factor_bytes(handle) -> int:
    return sum(
        t.numel() * t.element_size() for pp in handle.planned for t in (pp.factors.down, pp.factors.up)
    )


def _merged_reference(
    model: torch.nn.Sequential, sd: dict[str, torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """fp64 forward of `model` with W + up·down on every layer (scale 1: the files carry no alpha)."""
    h = x.double()
    for i, m in model.named_children():  # a slice of a Sequential keeps its names
        down, up = sd[f"{i}.lora_A.weight"].double(), sd[f"{i}.lora_B.weight"].double()
        w = m.weight.double() + (up.flatten(1) @ down.flatten(1)).view(m.weight.shape)
        if isinstance(m, torch.nn.Linear):
            h = torch.nn.functional.linear(h, w, m.bias.double())
        else:
            h = torch.nn.functional.conv2d(h, w, m.bias.double(), padding=m.padding)
    return h


def test_runtime_single_lora_from_a_mapped_file_is_copied_once(tmp_path):
    model = _model()
    path = _lora_file(model, tmp_path / "a.safetensors", 1)
    handle = loraweave.apply(model, path, mode="runtime", strict=True)
    scales = sum(rp.scale.numel() * rp.scale.element_size() for rp in handle.runtime_paths)
    assert _copied_bytes(handle) == _factor_bytes(handle) + scales
    handle.remove()


def test_runtime_single_lora_holds_no_factor_copy(tmp_path):
    model = _model()
    path = _lora_file(model, tmp_path / "a.safetensors", 1)
    handle = loraweave.apply(model, load_adapter(path, read=True), mode="runtime", strict=True)
    assert len(handle.runtime_paths) == 4
    scales = sum(rp.scale.numel() * rp.scale.element_size() for rp in handle.runtime_paths)
    # the only tensors of their own: the per-rank scale vectors (the factors alone are 50x larger)
    assert _copied_bytes(handle) == scales < _factor_bytes(handle) // 50
    for rp in handle.runtime_paths:  # and the views read the adapter's tensors in place
        pp = rp.contributions[0][0]
        assert rp.down.data_ptr() == pp.factors.down.data_ptr()
        assert rp.up.data_ptr() == pp.factors.up.data_ptr()
    # the outputs are those of W + up·down (fp64 reference), for the Linear pair and the convs
    sd = load_file(path)
    with torch.no_grad():
        x, img = torch.randn(5, 64), torch.randn(2, 64, 6, 6)
        assert (model[:2](x).double() - _merged_reference(model[:2], sd, x)).abs().max() <= 1e-5
        out = model[2:](img).double()
        assert (out - _merged_reference(model[2:], sd, img)).abs().max() <= 1e-5
    handle.remove()


def test_runtime_two_loras_on_a_layer_still_concatenate(tmp_path):
    """Two adapters on one layer: one rank-concatenated pair of their own (the adapters' tensors
    untouched)."""
    model = _model()
    a, b = _lora_file(model, tmp_path / "a.safetensors", 1), _lora_file(model, tmp_path / "b.safetensors", 2)
    handle = loraweave.apply(model, [a, b], mode="runtime", strict=True)
    for rp in handle.runtime_paths:
        assert rp.down.shape[0] == 2 * RANK
    assert _copied_bytes(handle) >= _factor_bytes(handle)
    handle.remove()


def _cyclic_tensor_bytes(step) -> int:
    """Run `step` with the cyclic collector off, then count the storage bytes of tensors only a collection
    frees: memory that outlives its use until the collector happens to run (a merge's buffers, once per
    layer)."""
    gc.collect()
    gc.disable()
    try:
        step()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        storages = {
            o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
            for o in gc.garbage
            if isinstance(o, torch.Tensor)
        }
        return sum(storages.values())
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_merge_steps_leave_no_tensor_in_reference_cycles(tmp_path):
    """apply, set_strength, switch and remove in merge mode free every buffer when they return (no cycle holds
    one): the fused merge's progress kept a closure over itself and its block buffers."""
    model = _model()
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    a, b = _lora_file(model, tmp_path / "a.safetensors", 1), _lora_file(model, tmp_path / "b.safetensors", 2)
    held = {}
    steps = {
        "apply": lambda: held.setdefault("h", loraweave.apply(model, a, mode="merge")),
        "strength": lambda: held["h"].set_strength(next(iter(held["h"].strengths)), 0.5),
        "switch": lambda: held["h"].switch([b]),
        "remove": lambda: held["h"].remove(),
    }
    leaked = {name: _cyclic_tensor_bytes(step) for name, step in steps.items()}
    assert leaked == dict.fromkeys(steps, 0)
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
