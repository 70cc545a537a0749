"""Undo records of merged layers (mechanisms/merge/undo.py): every kind restores the weight bit for bit.

Compared bitwise (integer views: -0.0 vs 0.0 and fp8 count), across dtypes, strengths, families, fused-row
targets and a grown input; strength changes and switches reuse the records without drift; `undo="source"`
re-reads the model's safetensors file and refuses a file that changed."""

from __future__ import annotations

import copy
import json
import os
import random
import struct

import pytest
import torch
from helpers.common import fail_on_call, gen, rel_err
from helpers.family_models import dora_sd, lin_model, lokr_sd, oft_sd
from helpers.undo_models import assert_same_bits, kinds_of, lora_sd, net, state_bits
from safetensors.torch import save_file
from torch import nn

import loraweave
from loraweave.errors import UndoError
from loraweave.io.safetensors_file import read_safetensors_header
from loraweave.mechanisms.merge import inplace as inplace_mod
from loraweave.mechanisms.merge import undo as undo_mod
from loraweave.mechanisms.merge.undo import bits

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STRENGTHS = [0.1, 1.0, 4.0, -1.0]
KINDS = ["compact", "copy", "auto", "source"]


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(v, b[k]) for k, v in a.items())


def source_of(model: nn.Module, tmp_path, name: str = "model.safetensors") -> str:
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)


def apply(model, sd, kind, tmp_path, strength=1.0, **kw):
    extra = {"undo_source": source_of(model, tmp_path)} if kind == "source" else {}
    return loraweave.apply(model, (sd, strength), mode="merge", undo=kind, **extra, **kw)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strength", STRENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_kind_restores_bit_for_bit(tmp_path, kind, strength, dtype):
    model = net(dtype)
    before = state_bits(model)
    sd = lora_sd(model)
    ref = copy.deepcopy(model)
    handle = apply(model, sd, kind, tmp_path, strength)
    if kind != "auto":
        assert kinds_of(handle) == {kind}
    else:
        assert kinds_of(handle) <= {"compact", "copy"}
    loraweave.apply(ref, (sd, strength), mode="merge", undo="copy")
    assert_same_bits(model, state_bits(ref))  # the record kind never changes the merged weights
    w = ref.a.weight.double()
    expect = (
        net(dtype).a.weight.double() + strength * (sd["a.lora_B.weight"] @ sd["a.lora_A.weight"]).double()
    )
    assert rel_err(w, expect) <= (1e-2 if dtype != torch.float32 else 1e-6)
    handle.remove()
    assert_same_bits(model, before)


def test_compact_is_small_at_typical_strength(tmp_path):
    """At ‖ΔW‖ ≈ 2% of ‖W‖ a compact fp16 record is a few percent of a copy; report and summary show it."""
    model = net(torch.float16)
    handle = apply(model, lora_sd(model), "auto", tmp_path)
    assert kinds_of(handle) == {"compact"}
    weight_bytes = sum(m.weight.numel() * 2 for m in (model.a, model.b))
    assert 0 < handle.report.undo_bytes() <= 0.15 * weight_bytes
    assert f"undo_bytes={handle.report.undo_bytes()}" in handle.report.summary()
    assert handle.report.to_dict()["undo_bytes"] == handle.report.undo_bytes()
    assert all(m.undo_bytes > 0 for m in handle.report.applied)
    copy_handle = apply(net(torch.float16), lora_sd(model), "copy", tmp_path)
    assert copy_handle.report.undo_bytes() >= weight_bytes


def test_fp8_storage_layer(tmp_path):
    model = net(torch.float32)
    with torch.no_grad():
        model.b.weight.data = model.b.weight.data.to(torch.float8_e4m3fn)
    before = state_bits(model)
    sd = lora_sd(net(torch.float32), rel=0.2)
    for kind in KINDS:
        for s in STRENGTHS:
            handle = apply(model, sd, kind, tmp_path, s)
            assert model.b.weight.dtype == torch.float8_e4m3fn
            assert not torch.equal(bits(model.b.weight), before["b.weight"])
            handle.remove()
            assert_same_bits(model, before)


def _family_cases():
    model = lin_model()  # fc Linear(20, 24), cv Conv2d(8, 16, 3)
    g = gen(9)
    stacked_b = {
        "fc.lora_down.weight": torch.randn(3, 20, generator=g) * 0.1,
        "fc.lora_up.weight": torch.randn(24, 3, generator=g) * 0.1,
        "cv.lora_down.weight": torch.randn(2, 8, 3, 3, generator=g) * 0.1,
        "cv.lora_up.weight": torch.randn(16, 2, 1, 1, generator=g) * 0.1,
    }
    stacked_a = {
        "fc.lora_down.weight": torch.randn(2, 20, generator=g) * 0.2,
        "fc.lora_up.weight": torch.randn(24, 2, generator=g) * 0.2,
    }
    return {
        "lokr": (model, [lokr_sd("fc", 3, alpha=None, w1=(4, 4), w2=(6, 5))]),
        "dora": (nn.ModuleDict({"lin": nn.Linear(24, 32)}), [dora_sd(True)]),
        "oft": (model, [oft_sd(2, alpha=None)]),
        "stacked": (model, [stacked_a, stacked_b]),
    }


@pytest.mark.parametrize("kind", ["compact", "copy", "auto", "source"])
@pytest.mark.parametrize("family", ["lokr", "dora", "oft", "stacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_families_restore_bit_for_bit(tmp_path, family, kind, dtype):
    pristine, sds = _family_cases()[family]
    model = copy.deepcopy(pristine).to(dtype)
    before = state_bits(model)
    for s in STRENGTHS:
        items = [loraweave.load_adapter(sd, name=f"{family}{i}") for i, sd in enumerate(sds)]
        extra = {"undo_source": source_of(model, tmp_path)} if kind == "source" else {}
        handle = loraweave.apply(
            model, [(a, s) for a in items], mode="merge", undo=kind, strict=True, **extra
        )
        assert len(handle.report.applied) >= 1
        if kind != "auto":
            assert kinds_of(handle) == {kind}
        assert differs(state_bits(model), before)
        handle.set_strength(items[0].name, -s / 2)  # rewritten from the record
        handle.remove()
        assert_same_bits(model, before)


@pytest.mark.parametrize("kind", ["compact", "auto"])
def test_chunked_delta_rows_restore(monkeypatch, tmp_path, kind):
    """ΔW computed in blocks of a few rows (the big-layer path), fused-row pieces crossing block edges."""
    from helpers.tiny_models import flux_forward, tiny_flux

    monkeypatch.setattr(undo_mod, "CHUNK_ELEMENTS", 100)
    import loraweave.mechanisms.merge.layer as merge_mod

    monkeypatch.setattr(merge_mod, "CHUNK_ELEMENTS", 100)
    model = tiny_flux()
    before = state_bits(model)
    with torch.no_grad():
        out_before = flux_forward(model)
    g = gen(0)
    stem = "diffusion_model.double_blocks.0.img_attn.qkv"
    sd = {
        f"{stem}.lora_down.weight": torch.randn(4, 32, generator=g) * 0.05,
        f"{stem}.lora_up.weight": torch.randn(96, 4, generator=g) * 0.05,
        f"{stem}.alpha": torch.tensor(4.0),
    }
    fresh = copy.deepcopy(model)
    monkeypatch.setattr(merge_mod, "CHUNK_ELEMENTS", 1 << 18)
    loraweave.apply(fresh, sd, mode="merge", undo="copy")
    monkeypatch.setattr(merge_mod, "CHUNK_ELEMENTS", 100)
    handle = loraweave.apply(model, sd, mode="merge", undo=kind, strict=True)
    assert len(handle.report.applied) == 3  # to_q, to_k, to_v: row pieces of one fused key
    for name in ("to_q", "to_k", "to_v"):
        path = f"transformer_blocks.0.attn.{name}.weight"
        assert rel_err(model.state_dict()[path], fresh.state_dict()[path]) <= 1e-6
    for s in (0.1, 4.0, -1.0):
        handle.set_strength(handle.report.adapters[0]["name"], s)
    handle.remove()
    assert_same_bits(model, before)
    with torch.no_grad():
        assert torch.equal(flux_forward(model), out_before)


@pytest.mark.parametrize("kind", ["compact", "auto", "copy"])
def test_grown_input_restores(kind):
    from helpers.family_models import _control_lora
    from helpers.tiny_models import tiny_flux

    model = tiny_flux()
    before = state_bits(model)
    weight_obj = model.x_embedder.weight
    handle = loraweave.apply(model, _control_lora(model, False), mode="merge", undo=kind, strict=True)
    grown = [m for m in handle.report.applied if m.module == "x_embedder"]
    assert grown and model.x_embedder.weight.shape[1] == 2 * weight_obj.shape[1]
    if kind != "auto":
        assert grown[0].undo == kind
    handle.set_strength(handle.report.adapters[0]["name"], 4.0)
    handle.remove()
    assert model.x_embedder.weight is weight_obj
    assert_same_bits(model, before)


def test_thousand_strength_changes_do_not_drift():
    """1,000 random strength changes on two stacked adapters, then: merged bits equal a fresh merge at the
    last strengths, and remove() gives back the original bits."""
    n = int(os.environ.get("LORAWEAVE_UNDO_CHANGES", "1000"))
    model = nn.ModuleDict(
        {"f32": net(torch.float32), "bf16": net(torch.bfloat16, 1), "f16": net(torch.float16, 2)}
    )
    before = state_bits(model)
    a = loraweave.load_adapter(lora_sd(model, seed=3), name="a")
    b = loraweave.load_adapter(lora_sd(model, rel=0.1, seed=4), name="b")
    handle = loraweave.apply(model, [a, b], mode="merge", undo="auto")
    rng = random.Random(5)
    last = {"a": 1.0, "b": 1.0}
    for _ in range(n):
        name = rng.choice("ab")
        last[name] = rng.uniform(-4, 4)
        handle.set_strength(name, last[name])
    fresh = nn.ModuleDict(
        {"f32": net(torch.float32), "bf16": net(torch.bfloat16, 1), "f16": net(torch.float16, 2)}
    )
    loraweave.apply(fresh, [(a, last["a"]), (b, last["b"])], mode="merge", undo="copy")
    assert_same_bits(model, state_bits(fresh))
    handle.remove()
    assert_same_bits(model, before)


def test_switch_in_merge_mode_uses_the_records():
    model = net(torch.bfloat16)
    before = state_bits(model)
    a = loraweave.load_adapter(lora_sd(model, seed=3), name="a")
    b = loraweave.load_adapter(lora_sd(model, seed=4), name="b")
    handle = loraweave.apply(model, a, mode="merge", undo="compact")
    handle.switch([(a, 0.5)])  # same structure, new strength: rewritten from the compact record
    assert handle.last_switch["kept"] == 2 and kinds_of(handle) == {"compact"}
    handle.switch([b])  # rebuilt: a undone from its record, b merged with a new one
    assert kinds_of(handle) == {"compact"}
    fresh = net(torch.bfloat16)
    loraweave.apply(fresh, b, mode="merge")
    assert_same_bits(model, state_bits(fresh))
    handle.remove()
    assert_same_bits(model, before)


# ----------------------------------------------------------------------------------------- undo="source"


def _saved_unet(tmp_path):
    from diffusers import UNet2DConditionModel
    from helpers.tiny_models import tiny_sdxl_unet

    tiny_sdxl_unet().save_pretrained(tmp_path / "unet")
    return UNet2DConditionModel.from_pretrained(str(tmp_path / "unet")), tmp_path / "unet"


def _saved_state(before: dict[str, torch.Tensor], unet) -> dict[str, torch.Tensor]:
    """The state as saved (before the merge), from its bits."""
    return {k: b.view(unet.state_dict()[k].dtype).contiguous() for k, b in before.items()}


def _unet_lora(unet) -> dict[str, torch.Tensor]:
    g = gen(2)
    sd = {}
    for name, m in unet.named_modules():
        if isinstance(m, nn.Linear) and ".attn1." in name:
            sd[f"{name}.lora_A.weight"] = torch.randn(2, m.in_features, generator=g) * 0.1
            sd[f"{name}.lora_B.weight"] = torch.randn(m.out_features, 2, generator=g) * 0.1
    return sd


def test_source_found_from_from_pretrained(tmp_path):
    unet, _ = _saved_unet(tmp_path)
    before = state_bits(unet)
    handle = loraweave.apply(unet, _unet_lora(unet), mode="merge", undo="source", strict=True)
    assert kinds_of(handle) == {"source"} and handle.report.undo_bytes() == 0
    handle.remove()
    assert_same_bits(unet, before)


@pytest.mark.parametrize("change", ["rewritten", "same_size_and_mtime"])
def test_source_refuses_a_changed_file(tmp_path, change):
    unet, folder = _saved_unet(tmp_path)
    before = state_bits(unet)
    handle = loraweave.apply(unet, _unet_lora(unet), mode="merge", undo="source", strict=True)
    merged = state_bits(unet)
    (path,) = folder.glob("*.safetensors")
    st = os.stat(path)
    if change == "rewritten":  # one weight fine-tuned and saved again: the one undone last, so the stat check
        first = handle.merged_layers[0].record.name  # must refuse before the others are restored
        sd = {k: v + 1 if k == first else v for k, v in unet.state_dict().items()}
        sd.update({k: v for k, v in _saved_state(before, unet).items() if k != first})
        save_file(sd, str(path), metadata={"format": "pt"})  # same header size: only that tensor's bytes move
        with pytest.raises(UndoError, match="changed since the merge"):
            handle.remove()
        assert_same_bits(unet, merged)  # refused before anything was touched
        assert handle.active
    else:  # bytes of a merged tensor edited in place, size and mtime put back: the tensor hash catches it
        header, _, start = read_safetensors_header(path)
        key = next(k for k in sorted(header) if ".attn1.to_q.weight" in k)
        begin = start + header[key][2]
        data = bytearray(path.read_bytes())
        data[begin : begin + 8] = bytes(x ^ 0xFF for x in data[begin : begin + 8])
        path.write_bytes(bytes(data))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        with pytest.raises(UndoError, match=f"{key}.*changed since the merge"):
            handle.remove()
    assert differs(before, merged)


def test_source_without_files_is_refused_before_touching():
    model = net(torch.float16)
    before = state_bits(model)
    with pytest.raises(UndoError, match="undo='source' found no safetensors file"):
        loraweave.apply(model, lora_sd(model), mode="merge", undo="source")
    assert_same_bits(model, before)


def test_source_falls_back_where_the_file_holds_another_weight(tmp_path):
    """A layer whose file tensor is not its weight (edited after load) gets the smallest other record."""
    model = net(torch.float16)
    path = source_of(model, tmp_path)
    with torch.no_grad():
        model.b.weight.mul_(2)
    before = state_bits(model)
    handle = loraweave.apply(model, lora_sd(model), mode="merge", undo="source", undo_source=path)
    kinds = {m.module: m.undo for m in handle.report.applied}
    assert kinds["a"] == "source" and kinds["b"] in ("compact", "copy")
    handle.remove()
    assert_same_bits(model, before)


def _packed_source(model: nn.Module, tmp_path, packed: str) -> str:
    """The model's file with `packed` (a sub-byte dtype, two F4 values a byte) as b.weight's dtype, its shape
    the weight's: a header the reader accepts, whose dtype torch has no element type for."""
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    header, blobs, at = {}, [], 0
    for key, t in tensors.items():
        if key == "b.weight":
            entry, blob = {"dtype": packed, "shape": list(t.shape)}, bytes(t.numel() // 2)
        else:
            entry, blob = {"dtype": "F16", "shape": list(t.shape)}, t.view(torch.uint8).numpy().tobytes()
        header[key] = {**entry, "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    raw = json.dumps(header).encode()
    path = tmp_path / "packed.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return str(path)


def test_source_falls_back_where_the_file_tensor_is_packed(tmp_path):
    """A file tensor of a packed dtype (a name, no torch dtype) with the weight's element count is no 1:1
    source: the layer gets another record (it was an AttributeError on the name)."""
    model = net(torch.float16)
    path = _packed_source(model, tmp_path, "F4")
    assert read_safetensors_header(path)[0]["b.weight"][0] == "F4"
    before = state_bits(model)
    handle = loraweave.apply(model, lora_sd(model), mode="merge", undo="source", undo_source=path)
    kinds = {m.module: m.undo for m in handle.report.applied}
    assert kinds["a"] == "source" and kinds["b"] in ("compact", "copy")
    handle.remove()
    assert_same_bits(model, before)


# ------------------------------------------------------------------------------------------- undo="none"


def test_none_is_a_permanent_fuse():
    model = net(torch.float16)
    before = state_bits(model)
    handle = loraweave.apply(model, lora_sd(model), mode="merge", undo="none")
    fused = state_bits(model)
    assert differs(fused, before)
    assert kinds_of(handle) == {"none"} and handle.report.undo_bytes() == 0
    with pytest.raises(UndoError, match="fused permanently"):
        handle.set_strength(handle.report.adapters[0]["name"], 0.5)
    assert_same_bits(model, fused)
    handle.remove()
    assert_same_bits(model, fused)  # the merge stays


def test_bad_undo_arguments():
    model = net(torch.float32)
    with pytest.raises(ValueError, match="undo must be one of"):
        loraweave.apply(model, lora_sd(model), mode="merge", undo="maybe")
    with pytest.raises(ValueError, match="undo_source is read only with undo='source'"):
        loraweave.apply(model, lora_sd(model), mode="merge", undo="auto", undo_source="x.safetensors")


# ------------------------------------------------------------------------------ negative controls: records


def test_compact_record_detects_a_different_delta():
    """Negative control: restoring with another ΔW than the merge used is caught by the witnesses."""
    model = net(torch.float16)
    handle = loraweave.apply(model, lora_sd(model, rel=0.3), mode="merge", undo="compact")
    rec = handle.merged_layers[0]
    rec.terms = [(pp, piece, strength * 1.5, scale) for pp, piece, strength, scale in rec.terms]
    with pytest.raises(UndoError, match="did not reproduce the original weight"):
        rec.restore()


def test_compact_record_refuses_a_weight_edited_outside():
    model = net(torch.float16)
    handle = loraweave.apply(model, lora_sd(model, rel=0.3), mode="merge", undo="compact")
    with torch.no_grad():
        model.a.weight.add_(1)
    with pytest.raises(UndoError, match="changed outside loraweave"):
        handle.remove()


# --------------------------------------------------------------------------------- transactional apply

from helpers.robust_nets import N_MODULES, Net, _check_restored, _full_adapter, _snapshot  # noqa: E402


def _net_source(model, tmp_path):
    return {"undo_source": source_of(model, tmp_path)}


@pytest.mark.parametrize("after", [False, True], ids=["before_write", "after_write"])
@pytest.mark.parametrize("nth", [1, 3, N_MODULES])
@pytest.mark.parametrize("kind", ["compact", "copy", "auto", "source", "none"])
def test_fault_at_any_layer_restores_every_record_kind(monkeypatch, tmp_path, kind, nth, after):
    model = Net()
    before, out_before, conv_before = _snapshot(model)
    extra = _net_source(model, tmp_path) if kind == "source" else {}
    cls = loraweave.mechanisms.merge.layer.MergedModule
    monkeypatch.setattr(cls, "write", fail_on_call(nth, RuntimeError, cls.write, after=after))
    with pytest.raises(RuntimeError, match="injected"):
        loraweave.apply(model, _full_adapter(False), mode="merge", undo=kind, **extra)
    _check_restored(model, before, out_before, conv_before)


@pytest.mark.parametrize("kind", ["compact", "auto", "none"])
@pytest.mark.parametrize("nth", [1, 2, 4])
def test_fault_while_building_a_compact_record(monkeypatch, kind, nth):
    """The failure lands while the record is being encoded (the fused path has written the weight by then).
    The torch path, which encodes every record (the native kernel writes its own; test_merge_native)."""
    monkeypatch.setattr(inplace_mod, "kernel_for", lambda dtype: None)
    if kind == "none":  # the checked path (a bounded undo="none" merge keeps no record: test_merge_direct)
        monkeypatch.setattr(loraweave.mechanisms.merge.layer.MergedModule, "_overflow_free", lambda *a: False)
    model = Net()
    before, out_before, conv_before = _snapshot(model)
    monkeypatch.setattr(
        inplace_mod, "compact_record", fail_on_call(nth, KeyboardInterrupt, undo_mod.compact_record)
    )
    monkeypatch.setattr(
        undo_mod, "compact_record", fail_on_call(nth, KeyboardInterrupt, undo_mod.compact_record)
    )
    with pytest.raises(KeyboardInterrupt):
        loraweave.apply(model, _full_adapter(False), mode="merge", undo=kind)
    _check_restored(model, before, out_before, conv_before)


def test_fault_on_the_fusing_step_restores(monkeypatch):
    """undo="none" drops the records only after every layer landed; a failure before that restores."""
    model = Net()
    before, out_before, conv_before = _snapshot(model)
    cls = loraweave.mechanisms.merge.layer.MergedModule
    monkeypatch.setattr(cls, "fuse", fail_on_call(1, RuntimeError, cls.fuse))
    with pytest.raises(RuntimeError, match="injected"):
        loraweave.apply(model, _full_adapter(False), mode="merge", undo="none")
    _check_restored(model, before, out_before, conv_before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_block_scan_finds_every_miss(dtype):
    """The compact merge's scan of a block must find exactly the element-wise bit differences (signed zeros,
    NaN payloads), at any length and any block offset."""
    g = gen(3)
    rows = torch.randn(7, 45, generator=g).to(dtype)
    blocks = undo_mod._Blocks(rows, 7, compact=True)
    for start, length in ((0, 315), (1, 100), (2, 37), (4, 64), (3, 1), (0, 0)):
        b = rows.clone().view(-1)[start : start + length]
        a = b.clone()
        flip = torch.randperm(length, generator=g)[: length // 5]
        bits(a)[flip] ^= 1  # one-ulp changes
        if length > 8:
            a[5], b[5] = -0.0, 0.0  # signed zeros differ bitwise
            a[6] = float("nan")
            a[7] = -b[7]  # the sign bit only
        expect = (bits(a) != bits(b)).nonzero().squeeze(1)
        assert torch.equal(blocks._differ(a, b), expect), (start, length)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_odd_widths_in_blocks_restore(monkeypatch, dtype):
    """Blocks whose first element is not on a word boundary (odd widths, a few rows per block) restore
    exactly."""
    monkeypatch.setattr(undo_mod, "CHUNK_ELEMENTS", 150)
    import loraweave.mechanisms.merge.layer as merge_mod

    monkeypatch.setattr(merge_mod, "CHUNK_ELEMENTS", 150)
    torch.manual_seed(5)
    model = nn.ModuleDict({"a": nn.Linear(37, 83), "b": nn.Linear(83, 29, bias=False)}).to(dtype)
    before = state_bits(model)
    sd = lora_sd(model, rel=0.3)
    handle = loraweave.apply(model, (sd, 4.0), mode="merge", undo="compact")
    assert kinds_of(handle) == {"compact"}
    assert any(m.record.positions.numel() for m in handle.merged_layers)  # there were misses to restore
    handle.set_strength(handle.report.adapters[0]["name"], -1.0)
    handle.remove()
    assert_same_bits(model, before)


def _reachable_tensor_bytes(root, skip: set[int]) -> int:
    """Bytes of the distinct tensor storages reachable from `root` through plain objects (modules' and
    functions' globals not followed), storages in `skip` (data pointers) left out."""
    import gc
    import types

    seen, storages, todo = set(), {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(
            obj, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
        ):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            if st.data_ptr() not in skip and obj.device.type != "meta":
                storages[st.data_ptr()] = st.nbytes()
            continue
        todo.extend(gc.get_referents(obj))
    return sum(storages.values())


def test_merge_keeps_only_its_records():
    """After apply(undo="auto"): the handle holds the records and the adapter's factors, nothing layer-sized
    besides (no scratch buffer, no copy beside a compact record); reused buffers are released."""
    torch.manual_seed(0)
    model = nn.ModuleDict({f"l{i}": nn.Linear(512, 512, bias=False) for i in range(4)}).half()
    with torch.no_grad():
        sd = lora_sd(model)
    factor_bytes = sum(v.numel() * v.element_size() for v in sd.values())
    model_ptrs = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    layer = 512 * 512 * 2
    handle = loraweave.apply(model, sd, mode="merge", undo="auto")
    for _ in ("after apply", "after a strength change"):
        assert kinds_of(handle) == {"compact"}
        assert undo_mod._POOL.get() is None
        record = handle.report.undo_bytes()
        assert record <= 0.1 * 4 * layer
        held = _reachable_tensor_bytes(handle, model_ptrs)
        assert held <= record + 2 * factor_bytes + 64 * 1024, (held, record, factor_bytes)
        assert held < record + layer / 2  # any layer-sized buffer kept breaks this
        handle.set_strength(handle.report.adapters[0]["name"], 1.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sign", [1, -1])
def test_half_combine_has_the_bits_of_one_mixed_add(monkeypatch, dtype, sign):
    """combine_into without the native one-pass kernel runs fp16/bf16 weights as upcast, add, round (three
    vectorized passes): the same bits as one mixed-dtype torch.add rounded once, specials included (signed
    zeros, subnormals, inf, NaN with its payload, overflow). The native pass: test_merge_native."""
    monkeypatch.setattr(undo_mod, "combine_for", lambda dtype: None)
    g = gen(11)
    w = (torch.randn(64, 96, generator=g) * 0.05).to(dtype)
    delta = torch.randn(64, 96, generator=g) * 0.002
    w.view(-1)[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 6e-8]).to(dtype)
    delta.view(-1)[6:9] = torch.tensor([0.0, -0.0, 1e6])  # 1e6: overflows fp16 to inf
    expect = torch.add(w, delta, alpha=sign).to(dtype)
    got, acc = torch.empty_like(w), torch.empty_like(delta)
    undo_mod.combine_into(got, w, delta, sign, acc)
    assert torch.equal(bits(got), bits(expect))


def test_witness_positions_are_exact_above_2_to_24_elements():
    # float32 linspace rounded the last index to numel (IndexError on a 3072x15360 Flux proj_out)
    from loraweave.mechanisms.merge.undo import WITNESSES, witness_positions

    for numel in (2**24 + 1, 3072 * 15360, 1280 * 2560 * 9, 2**31 + 7, 2**40 + 3):
        positions = witness_positions(numel)
        assert positions.dtype == torch.long
        assert len(positions) == WITNESSES
        assert positions[0] == 0 and positions[-1] == numel - 1
        assert bool((positions[1:] > positions[:-1]).all())
    assert witness_positions(1).tolist() == [0]
    assert witness_positions(3).tolist() == [0, 1, 2]
