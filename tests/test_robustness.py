"""Robustness: bad input is a typed error or a reported miss, strict mode, transactional apply, exact undo.

Every test here checks that whatever did not land left the model bit-identical (torch.equal on every parameter
and buffer against a deepcopy taken before the call) and that `report.to_dict()` accounts for every key:
keys_applied + len(unmatched) == keys_total.
"""

from __future__ import annotations

import copy
import json
import random
import struct
from pathlib import Path

import pytest
import torch
from helpers.common import fail_on_call
from helpers.robust_nets import (
    N_MODULES,
    Net,
    _check_restored,
    _full_adapter,
    _snapshot,
    all_tensors,
    assert_no_hooks,
    assert_untouched,
    inputs,
)
from safetensors.torch import save_file
from torch import nn

import loraweave
import loraweave.engine.install
import loraweave.mechanisms.merge.layer
import loraweave.mechanisms.runtime.path
from loraweave import (
    AdapterFileError,
    AdapterFormatError,
    AdapterMetadataError,
    LoraweaveError,
    StrictApplyError,
    UnsafeFormatError,
)

TRUNCATED = (
    Path(__file__).resolve().parents[2]
    / "shared/realdata/lora/broken"
    / "Srikanth1408__Stable_Diffusion-Hackathon__pytorch_lora_weights__TRUNCATED.safetensors"
)
MODES = ("merge", "runtime", "auto")


# ----------------------------------------------------------------------------------------------- helpers


def lora(out: int, inp: int, rank: int = 2, seed: int = 0, dtype=torch.float32, kernel: int | None = None):
    g = torch.Generator().manual_seed(seed)
    down_shape = (rank, inp) if kernel is None else (rank, inp, kernel, kernel)
    up_shape = (out, rank) if kernel is None else (out, rank, 1, 1)
    return torch.randn(down_shape, generator=g).to(dtype), torch.randn(up_shape, generator=g).to(dtype)


def good_part(prefix: str = "fc1", out: int = 6, inp: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    d, u = lora(out, inp, seed=seed)
    return {
        f"{prefix}.lora_down.weight": d,
        f"{prefix}.lora_up.weight": u,
        f"{prefix}.alpha": torch.tensor(1.0),
    }


def check_report(report: loraweave.Report) -> dict:
    d = report.to_dict()
    json.dumps(d)  # must be JSON-serialisable as is
    for field in ("keys_total", "keys_applied", "unmatched"):
        assert field in d
    assert isinstance(d["unmatched"], list)
    for miss in d["unmatched"]:
        assert isinstance(miss, dict)
        assert isinstance(miss["key"], str) and isinstance(miss["reason"], str) and miss["reason"]
    assert d["keys_applied"] + len(d["unmatched"]) == d["keys_total"], d
    assert 0 <= d["keys_applied"] <= d["keys_total"]
    assert d["keys_total"] == sum(a["keys_total"] for a in d["adapters"])
    assert d["keys_applied"] == sum(a["keys_applied"] for a in d["adapters"])
    return d


def write_raw(path: Path, header: bytes | dict, data: bytes = b"", header_len: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


# ------------------------------------------------------------------------- A. files that cannot be read


def test_real_truncated_file_raises_adapter_file_error():
    assert TRUNCATED.is_file(), (
        f"missing real test file {TRUNCATED}"
    )  # a missing file is a failure, not a skip
    model = Net()
    before = copy.deepcopy(model)
    for mode in MODES:
        with pytest.raises(AdapterFileError, match="truncated"):
            loraweave.apply(model, TRUNCATED, mode=mode)
        assert_untouched(model, before)
    with pytest.raises(AdapterFileError):
        loraweave.plan(model, TRUNCATED)
    with pytest.raises(AdapterFileError):
        loraweave.load_adapter(TRUNCATED)


def _garbage_header(tmp_path):
    return write_raw(tmp_path / "garbage.safetensors", b"\xff\xfe not json at all {{{")


def _json_not_object(tmp_path):
    return write_raw(tmp_path / "list.safetensors", b"[1, 2, 3]")


def _header_len_past_end(tmp_path):
    header = {"fc1.lora_down.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    return write_raw(tmp_path / "longhdr.safetensors", header, b"\0\0\0\0", header_len=10_000)


def _huge_header_len(tmp_path):
    return write_raw(tmp_path / "huge.safetensors", b"{}", header_len=2**63)


def _data_past_end(tmp_path):
    header = {
        "fc1.lora_down.weight": {"dtype": "F32", "shape": [2, 8], "data_offsets": [0, 64]},
        "fc1.lora_up.weight": {"dtype": "F32", "shape": [6, 2], "data_offsets": [64, 112]},
    }
    return write_raw(tmp_path / "short.safetensors", header, b"\0" * 80)


def _offsets_disagree_with_shape(tmp_path):
    header = {"fc1.lora_down.weight": {"dtype": "F32", "shape": [2, 8], "data_offsets": [0, 4]}}
    return write_raw(tmp_path / "span.safetensors", header, b"\0" * 64)


def _unknown_dtype(tmp_path):
    header = {"fc1.lora_down.weight": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}
    return write_raw(tmp_path / "dtype.safetensors", header, b"\0")


def _tiny_file(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01\x02")
    return path


def _missing(tmp_path):
    return tmp_path / "does_not_exist.safetensors"


@pytest.mark.parametrize(
    "make",
    [
        _garbage_header,
        _json_not_object,
        _header_len_past_end,
        _huge_header_len,
        _data_past_end,
        _offsets_disagree_with_shape,
        _unknown_dtype,
        _tiny_file,
        _missing,
    ],
)
def test_malformed_file_raises_adapter_file_error(make, tmp_path):
    path = make(tmp_path)
    model = Net()
    before = copy.deepcopy(model)
    for mode in MODES:
        with pytest.raises(AdapterFileError):
            loraweave.apply(model, path, mode=mode)
        assert_untouched(model, before)
    with pytest.raises(AdapterFileError):
        loraweave.plan(model, path)
    # One bad file among good ones: nothing at all is applied.
    good = good_part()
    with pytest.raises(AdapterFileError):
        loraweave.apply(model, [good, path], mode="merge")
    assert_untouched(model, before)


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".ckpt", ".bin"])
def test_pickle_without_opt_in_is_refused(suffix, tmp_path):
    path = tmp_path / f"adapter{suffix}"
    torch.save(good_part(), path)
    model = Net()
    before = copy.deepcopy(model)
    for mode in MODES:
        with pytest.raises(UnsafeFormatError, match="allow_pickle"):
            loraweave.apply(model, path, mode=mode)
        assert_untouched(model, before)
    with pytest.raises(UnsafeFormatError):
        loraweave.load_adapter(path)
    # Explicit opt-in reads it with weights_only=True, and the result applies.
    adapter = loraweave.load_adapter(path, allow_pickle=True)
    handle = loraweave.apply(model, adapter, mode="merge", strict=True)
    check_report(handle.report)
    assert not torch.equal(model.fc1.weight, before.fc1.weight)
    handle.remove()
    assert_untouched(model, before)


def test_other_suffix_is_refused(tmp_path):
    path = tmp_path / "adapter.npz"
    path.write_bytes(b"PK\x03\x04 not an adapter")
    model = Net()
    before = copy.deepcopy(model)
    with pytest.raises(UnsafeFormatError):
        loraweave.apply(model, path)
    assert_untouched(model, before)


def test_pickle_opt_in_without_tensors_is_a_format_error(tmp_path):
    path = tmp_path / "notes.pt"
    torch.save({"step": 3, "lr": 1e-4}, path)
    with pytest.raises(AdapterFormatError):
        loraweave.load_adapter(path, allow_pickle=True)
    path2 = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], path2)
    with pytest.raises(AdapterFormatError):
        loraweave.load_adapter(path2, allow_pickle=True)


def test_pickle_opt_in_with_arbitrary_objects_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"fc1.lora_down.weight": torch.zeros(2, 8), "obj": Path("/")}, path)
    with pytest.raises(AdapterFileError):
        loraweave.load_adapter(path, allow_pickle=True)


# ------------------------------------------------------------------ A. readable files with bad parts


def _nan(t: torch.Tensor, where=(0, 0)) -> torch.Tensor:
    t = t.clone()
    t[where] = float("nan")
    return t


def _inf(t: torch.Tensor, where=(0, 0), sign: float = 1.0) -> torch.Tensor:
    t = t.clone()
    t[where] = sign * float("inf")
    return t


_D, _U = lora(6, 8, rank=2, seed=11)
_CD, _CU = lora(5, 3, rank=2, seed=12, kernel=3)

# (id, state dict, expected reason prefix). Every case carries only bad keys: nothing may land.
BAD_PARTS = [
    (
        "down_wrong_in",
        {"fc1.lora_down.weight": torch.randn(2, 7), "fc1.lora_up.weight": _U},
        "shape mismatch",
    ),
    ("up_wrong_out", {"fc1.lora_down.weight": _D, "fc1.lora_up.weight": torch.randn(5, 2)}, "shape mismatch"),
    (
        "conv_down_wrong_kernel",
        {"conv.lora_down.weight": torch.randn(2, 3, 1, 1), "conv.lora_up.weight": _CU},
        "shape mismatch",
    ),
    (
        "conv_on_linear",
        {"fc1.lora_down.weight": torch.randn(2, 8, 3, 3), "fc1.lora_up.weight": torch.randn(6, 2, 1, 1)},
        "shape mismatch",
    ),
    (
        "rank_mismatch",
        {"fc1.lora_down.weight": _D, "fc1.lora_up.weight": torch.randn(6, 3)},
        "shape mismatch",
    ),
    (
        "rank_mismatch_conv",
        {"conv.lora_down.weight": _CD, "conv.lora_up.weight": torch.randn(5, 4, 1, 1)},
        "shape mismatch",
    ),
    (
        "up_not_1x1",
        {"conv.lora_down.weight": _CD, "conv.lora_up.weight": torch.randn(5, 2, 3, 3)},
        "shape mismatch",
    ),
    (
        "tucker_bad_core",
        {
            "conv.lora_down.weight": torch.randn(2, 3, 1, 1),
            "conv.lora_mid.weight": torch.randn(3, 2, 3, 3),
            "conv.lora_up.weight": torch.randn(5, 2, 1, 1),
        },
        "shape mismatch",
    ),
    ("up_1d", {"fc1.lora_down.weight": _D, "fc1.lora_up.weight": torch.randn(6)}, "shape mismatch"),
    (
        "down_0d",
        {"fc1.lora_down.weight": torch.tensor(1.0), "fc1.lora_up.weight": torch.randn(6, 1)},
        "shape mismatch",
    ),
    (
        "bias_wrong_len",
        {"fc1.lora_A.weight": _D, "fc1.lora_B.weight": _U, "fc1.lora_B.bias": torch.randn(5)},
        "shape mismatch",
    ),
    ("diff_wrong_shape", {"fc1.diff": torch.randn(6, 7)}, "shape mismatch"),
    ("diff_wrong_rows", {"fc1.diff": torch.randn(4, 8)}, "shape mismatch"),
    ("nan_down", {"fc1.lora_down.weight": _nan(_D), "fc1.lora_up.weight": _U}, "bad tensor"),
    (
        "nan_up_fp16",
        {"fc1.lora_down.weight": _D.half(), "fc1.lora_up.weight": _nan(_U.half(), (5, 1))},
        "bad tensor",
    ),
    ("inf_up", {"fc1.lora_down.weight": _D, "fc1.lora_up.weight": _inf(_U)}, "bad tensor"),
    (
        "neg_inf_down_bf16",
        {"fc1.lora_down.weight": _inf(_D.bfloat16(), (1, 3), -1.0), "fc1.lora_up.weight": _U},
        "bad tensor",
    ),
    (
        "nan_mid",
        {
            "conv.lora_down.weight": torch.randn(2, 3, 1, 1),
            "conv.lora_mid.weight": _nan(torch.randn(2, 2, 3, 3), (0, 0, 1, 1)),
            "conv.lora_up.weight": torch.randn(5, 2, 1, 1),
        },
        "bad tensor",
    ),
    (
        "nan_bias",
        {"fc1.lora_A.weight": _D, "fc1.lora_B.weight": _U, "fc1.lora_B.bias": _nan(torch.randn(6), (2,))},
        "bad tensor",
    ),
    ("nan_diff", {"fc1.diff": _nan(torch.randn(6, 8))}, "bad tensor"),
    ("inf_diff_b", {"fc1.diff_b": _inf(torch.randn(6), (0,))}, "bad tensor"),
    (
        "nan_alpha",
        {"fc1.lora_down.weight": _D, "fc1.lora_up.weight": _U, "fc1.alpha": torch.tensor(float("nan"))},
        "bad tensor",
    ),
    (
        "inf_alpha",
        {"fc1.lora_down.weight": _D, "fc1.lora_up.weight": _U, "fc1.alpha": torch.tensor(float("inf"))},
        "bad tensor",
    ),
    (
        "nan_alpha_fp16",
        {
            "fc1.lora_down.weight": _D,
            "fc1.lora_up.weight": _U,
            "fc1.alpha": torch.tensor(float("nan")).half(),
        },
        "bad tensor",
    ),
    (
        "alpha_not_scalar",
        {"fc1.lora_down.weight": _D, "fc1.lora_up.weight": _U, "fc1.alpha": torch.ones(2)},
        "bad tensor",
    ),
    (
        "no_such_module",
        {"nosuch.lora_down.weight": _D, "nosuch.lora_up.weight": _U, "nosuch.alpha": torch.tensor(1.0)},
        "no such module",
    ),
    (
        "no_such_module_kohya",
        {"lora_unet_block_nope.lora_down.weight": _D, "lora_unet_block_nope.lora_up.weight": _U},
        "no such module",
    ),
    (
        "no_such_component",
        {
            "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": _D,
            "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": _U,
        },
        "no such component",
    ),
    (
        "no_such_component_te2",
        {"text_encoder_2.fc1.lora_A.weight": _D, "text_encoder_2.fc1.lora_B.weight": _U},
        "no such component",
    ),
    (
        "lokr_shape",
        {"fc1.lokr_w1": torch.randn(2, 2), "fc1.lokr_w2": torch.randn(3, 5), "fc1.alpha": torch.tensor(1.0)},
        "shape mismatch",
    ),
    (
        "loha_shape",
        {
            "fc1.hada_w1_a": torch.randn(6, 2),
            "fc1.hada_w1_b": torch.randn(2, 9),
            "fc1.hada_w2_a": torch.randn(6, 2),
            "fc1.hada_w2_b": torch.randn(2, 9),
        },
        "shape mismatch",
    ),
    # TLoRA's base comes from an SVD init that is never saved: not portable, always refused.
    (
        "tlora",
        {
            "fc1.q_layer": torch.randn(2, 8),
            "fc1.p_layer": torch.randn(6, 2),
            "fc1.lambda_layer": torch.randn(1, 2),
        },
        "unsupported family",
    ),
    (
        "lora_and_lokr_in_one_part",
        {"fc1.lora_down.weight": _D, "fc1.lora_up.weight": _U, "fc1.lokr_w1": torch.randn(2, 2)},
        "unsupported family",
    ),
    (
        "unknown_keys",
        {"fc1.something_else": torch.randn(3), "random_key": torch.randn(2), "fc1.weight": torch.randn(6, 8)},
        "not parsed",
    ),
    ("incomplete_lora", {"fc1.lora_down.weight": _D, "fc1.alpha": torch.tensor(2.0)}, "incomplete"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", BAD_PARTS, ids=[c[0] for c in BAD_PARTS])
def test_bad_part_is_a_reported_miss_and_touches_nothing(case, mode):
    _, sd, prefix = case
    model = Net()
    before = copy.deepcopy(model)
    handle = loraweave.apply(model, sd, mode=mode, allow_empty=True)
    d = check_report(handle.report)
    assert d["keys_applied"] == 0
    assert {m["key"] for m in d["unmatched"]} == set(sd)
    for miss in d["unmatched"]:
        assert miss["reason"].startswith(prefix), miss
    assert handle.report.applied == []
    assert_untouched(model, before)
    with torch.no_grad():
        assert torch.equal(model(*inputs()), before(*inputs()))
    handle.remove()
    assert_untouched(model, before)
    # plan() says the same thing without touching anything.
    planned = check_report(loraweave.plan(model, sd))
    assert [m["reason"] for m in planned["unmatched"]] == [m["reason"] for m in d["unmatched"]]


@pytest.mark.parametrize("mode", MODES)
def test_bad_parts_next_to_good_ones_only_the_good_land(mode):
    # Each bad case reuses fc1/conv: one adapter per case, so keys do not collide. down_0d is left out here:
    # it crashes the whole apply (see its own case), which would hide everything this test checks.
    cases = [c for c in BAD_PARTS if c[0] != "down_0d"]
    adapters = [loraweave.load_adapter(case, name=f"bad{i}") for i, (_, case, _) in enumerate(cases)]
    good = loraweave.load_adapter(good_part("block.proj", 6, 6, seed=5), name="good")
    model = Net()
    before = copy.deepcopy(model)
    handle = loraweave.apply(model, [*adapters, good], mode=mode, allow_empty=True)
    d = check_report(handle.report)
    assert d["keys_applied"] == 3
    assert len(d["unmatched"]) == sum(len(c) for _, c, _ in cases)
    by_adapter = {}
    for miss in d["unmatched"]:
        by_adapter.setdefault(miss["adapter"], []).append(miss["reason"])
    for i, (_, _, prefix) in enumerate(cases):
        assert by_adapter[f"bad{i}"] and all(r.startswith(prefix) for r in by_adapter[f"bad{i}"])
    assert [(m.module, m.adapters) for m in handle.report.applied] == [("block.proj", ["good"])]
    if mode == "runtime":
        assert all(torch.equal(t, all_tensors(before)[n]) for n, t in all_tensors(model).items())
    else:
        assert_untouched(model, before, except_modules=("block.proj",))
    with torch.no_grad():
        assert not torch.equal(model(*inputs()), before(*inputs()))
    handle.remove()
    assert_untouched(model, before)


def test_rank_zero_lora_is_a_reported_shape_mismatch():
    """A degenerate rank-0 LoRA (empty factors) with an alpha is reported, never a ZeroDivisionError."""
    sd = {
        "fc1.lora_down.weight": torch.zeros(0, 8),
        "fc1.lora_up.weight": torch.zeros(6, 0),
        "fc1.alpha": torch.tensor(4.0),
    }
    for mode in MODES:
        model = Net()
        before = copy.deepcopy(model)
        handle = loraweave.apply(model, sd, mode=mode, allow_empty=True)
        check_report(handle.report)
        assert {m["reason"].split(":")[0] for m in handle.report.unmatched} == {"shape mismatch"}
        assert len(handle.report.unmatched) == 3
        assert_untouched(model, before)


@pytest.mark.parametrize("mode", ["merge", "auto"])
@pytest.mark.parametrize(
    "sd",
    [
        {
            "fc2.lora_A.weight": torch.randn(2, 6),
            "fc2.lora_B.weight": torch.randn(6, 2),
            "fc2.lora_B.bias": torch.randn(6),
        },
        {"fc2.diff_b": torch.randn(6)},
    ],
    ids=["lora_B.bias", "diff_b"],
)
def test_bias_delta_for_a_module_without_bias_is_typed_or_reported(sd, mode):
    """fc2 has no bias: the bias delta cannot be merged. That must be a reported miss (or, in auto, a runtime
    path) or a LoraweaveError, never an untyped exception; the model stays as it was."""
    model = Net()
    before = copy.deepcopy(model)
    good = loraweave.load_adapter(good_part(), name="good")
    handle = loraweave.apply(
        model, [good, loraweave.load_adapter(sd, name="biased")], mode=mode, allow_empty=True
    )
    d = check_report(handle.report)
    missed = {m["key"] for m in d["unmatched"]}
    landed = [m for m in handle.report.applied if m.module == "fc2"]
    if mode == "merge":
        assert missed == set(sd) and not landed
        assert all(m["reason"].startswith("cannot merge") for m in d["unmatched"])
    else:  # auto: merging is impossible here, so fc2 gets a runtime path
        assert not missed and landed[0].mechanism == "runtime"
    assert torch.equal(model.fc2.weight, before.fc2.weight)
    handle.remove()
    assert_untouched(model, before)


def test_peft_metadata_with_non_finite_lora_alpha_never_poisons_weights(tmp_path):
    """JSON accepts NaN/Infinity: a PEFT `lora_alpha` of NaN is a typed metadata error naming file and field
    (it was a reported miss before metadata was validated); nothing is merged."""
    d, u = lora(6, 8, seed=3)
    for value in ("NaN", "Infinity", "-Infinity"):
        path = tmp_path / f"peft_{value}.safetensors"
        save_file(
            {"fc1.lora_A.weight": d, "fc1.lora_B.weight": u},
            str(path),
            metadata={"lora_adapter_metadata": f'{{"r": 2, "lora_alpha": {value}}}'},
        )
        for mode in MODES:
            model = Net()
            before = copy.deepcopy(model)
            with pytest.raises(AdapterMetadataError, match="lora_alpha") as exc:
                loraweave.apply(model, path, mode=mode)
            assert str(path) in str(exc.value) and exc.value.field == "lora_adapter_metadata: lora_alpha"
            assert_untouched(model, before)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_strength_is_refused(value):
    """A NaN/Inf strength (apply or set_strength) must be refused (ValueError or a LoraweaveError), never
    merged into the weights."""
    for mode in MODES:
        model = Net()
        before = copy.deepcopy(model)
        with pytest.raises((ValueError, LoraweaveError)):
            loraweave.apply(model, good_part(), mode=mode, strength=value)
        assert_untouched(model, before)
        with pytest.raises((ValueError, LoraweaveError)):
            loraweave.apply(model, (good_part(), value), mode=mode)
        assert_untouched(model, before)
        handle = loraweave.apply(model, loraweave.load_adapter(good_part(), name="g"), mode=mode)
        with torch.no_grad():
            out = model(*inputs())
        with pytest.raises((ValueError, LoraweaveError)):
            handle.set_strength("g", value)
        with torch.no_grad():
            assert torch.equal(model(*inputs()), out), "a refused set_strength changed the model"
        handle.remove()
        assert_untouched(model, before)


def test_same_adapter_object_twice_keeps_the_report_consistent():
    """Passing one Adapter object twice (e.g. at two strengths) must keep keys_applied <= keys_total."""
    adapter = loraweave.load_adapter(good_part(), name="x")
    model = Net()
    before = copy.deepcopy(model)
    handle = loraweave.apply(model, [(adapter, 1.0), (adapter, 0.5)], mode="merge")
    check_report(handle.report)
    handle.remove()
    assert_untouched(model, before)
    assert adapter.name == "x", "apply renamed the caller's Adapter object"


def test_report_of_a_real_lora_is_json_and_complete():
    """Every key of a real file on a model it does not fit is a reported miss; the report is JSON."""
    path = TRUNCATED.parents[1] / "leighwoods__public-loras__lora.safetensors"
    assert path.is_file(), f"missing real test file {path}"
    model = Net()
    before = copy.deepcopy(model)
    handle = loraweave.apply(model, path, mode="auto", allow_empty=True)
    d = check_report(handle.report)
    assert d["keys_total"] == 8 and d["keys_applied"] == 0
    assert all(m["reason"].startswith("no such module") for m in d["unmatched"])
    assert_untouched(model, before)


# ---------------------------------------------------------------------------------------------- B. strict


@pytest.mark.parametrize("mode", MODES)
def test_strict_raises_with_report_and_touches_nothing(mode):
    sd = {
        **good_part(),
        **good_part("block.proj", 6, 6, seed=1),
        "nosuch.lora_down.weight": _D,
        "nosuch.lora_up.weight": _U,
    }
    sd.update(
        {"fp16.lora_down.weight": torch.randn(2, 5), "fp16.lora_up.weight": torch.randn(4, 2)}
    )  # shape mismatch
    model = Net()
    before = copy.deepcopy(model)
    with pytest.raises(StrictApplyError) as info:
        loraweave.apply(model, sd, mode=mode, strict=True)
    err = info.value
    assert isinstance(err, LoraweaveError)
    d = check_report(err.report)
    reasons = {m["key"]: m["reason"] for m in d["unmatched"]}
    assert reasons.keys() == {
        "nosuch.lora_down.weight",
        "nosuch.lora_up.weight",
        "fp16.lora_down.weight",
        "fp16.lora_up.weight",
    }
    assert reasons["nosuch.lora_down.weight"].startswith("no such module")
    assert reasons["fp16.lora_down.weight"].startswith("shape mismatch")
    assert_untouched(model, before)
    with torch.no_grad():
        assert torch.equal(model(*inputs()), before(*inputs()))


def test_strict_raises_when_a_module_cannot_take_the_mechanism():
    model = Net(quant=True)
    before = copy.deepcopy(model)
    sd = {**good_part(), "q.lora_down.weight": torch.randn(2, 6), "q.lora_up.weight": torch.randn(6, 2)}
    with pytest.raises(StrictApplyError) as info:
        loraweave.apply(model, sd, mode="merge", strict=True)
    d = check_report(info.value.report)
    assert {m["key"] for m in d["unmatched"]} == {"q.lora_down.weight", "q.lora_up.weight"}
    assert all(m["reason"].startswith("cannot merge") for m in d["unmatched"])
    assert_untouched(model, before)
    # auto finds a mechanism for everything: strict passes.
    handle = loraweave.apply(model, sd, mode="auto", strict=True)
    assert check_report(handle.report)["keys_applied"] == 5
    handle.remove()
    assert_untouched(model, before)


def test_strict_passes_when_everything_lands():
    model = Net()
    before = copy.deepcopy(model)
    for mode in MODES:
        with loraweave.apply(model, good_part(), mode=mode, strict=True) as handle:
            d = check_report(handle.report)
            assert d["keys_applied"] == d["keys_total"] == 3 and d["unmatched"] == []
        assert_untouched(model, before)


# ------------------------------------------------------------------------------------ C. transactional


def _still_works(model, before, quant, mode):
    """After a failed apply, a normal apply + remove still works and restores exactly."""
    handle = loraweave.apply(model, _full_adapter(quant), mode=mode)
    assert len(handle.report.applied) == N_MODULES + quant
    handle.remove()
    assert_untouched(model, before)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("nth", [1, 2, 3, N_MODULES])
@pytest.mark.parametrize("mode", ["merge", "auto"])
@pytest.mark.parametrize("after", [False, True], ids=["before_write", "after_write"])
def test_merge_write_failing_midway_restores_everything(monkeypatch, mode, nth, exc, after):
    quant = mode == "auto"
    model = Net(quant=quant)
    before, out_before, conv_before = _snapshot(model)
    real = loraweave.mechanisms.merge.layer.MergedModule.write
    wrapper = fail_on_call(nth, exc, real, after=after)
    monkeypatch.setattr(loraweave.mechanisms.merge.layer.MergedModule, "write", wrapper)
    with pytest.raises(exc, match="injected"):
        loraweave.apply(model, _full_adapter(quant), mode=mode)
    assert wrapper.calls["n"] == nth
    _check_restored(model, before, out_before, conv_before)
    monkeypatch.undo()
    _still_works(model, before, quant, mode)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("nth", [1, 3, N_MODULES])
@pytest.mark.parametrize("mode", ["merge", "auto"])
def test_merge_module_failing_midway_restores_everything(monkeypatch, mode, nth, exc):
    quant = mode == "auto"
    model = Net(quant=quant)
    before, out_before, conv_before = _snapshot(model)
    wrapper = fail_on_call(nth, exc, loraweave.engine.install.merge_module)
    monkeypatch.setattr(loraweave.engine.install, "merge_module", wrapper)
    with pytest.raises(exc, match="injected"):
        loraweave.apply(model, _full_adapter(quant), mode=mode)
    _check_restored(model, before, out_before, conv_before)
    monkeypatch.undo()
    _still_works(model, before, quant, mode)


@pytest.mark.parametrize("target", ["add_delta", "set_delta", "_write_bias"])
def test_failure_inside_the_weight_update_restores_weight_and_bias(monkeypatch, target):
    """The failure lands after the weight (or bias) was partly rewritten in place. A LoRA's ΔW of a block is
    written by set_delta (its first term) and added by add_delta (the others; every term with set_delta
    off)."""
    model = Net()
    before, out_before, conv_before = _snapshot(model)
    fam = loraweave.families.FAMILIES["lora"]
    if target == "add_delta":
        monkeypatch.setattr(fam, "set_delta", None)
        monkeypatch.setattr(fam, "add_delta", fail_on_call(3, RuntimeError, fam.add_delta, after=True))
    elif target == "set_delta":
        monkeypatch.setattr(fam, "set_delta", fail_on_call(3, RuntimeError, fam.set_delta, after=True))
    else:
        cls = loraweave.mechanisms.merge.layer.MergedModule
        monkeypatch.setattr(cls, "_write_bias", fail_on_call(2, RuntimeError, cls._write_bias, after=True))
    with pytest.raises(RuntimeError, match="injected"):
        loraweave.apply(model, _full_adapter(False), mode="merge")
    _check_restored(model, before, out_before, conv_before)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("nth", [1, 2, N_MODULES])
@pytest.mark.parametrize("mode", ["runtime", "auto"])
def test_runtime_attach_failing_midway_leaves_no_hook(monkeypatch, mode, nth, exc):
    quant = True
    model = Net(quant=quant)
    before, out_before, conv_before = _snapshot(model)
    real = loraweave.mechanisms.runtime.path.RuntimePath.attach
    n_runtime = N_MODULES + 1 if mode == "runtime" else 1
    wrapper = fail_on_call(min(nth, n_runtime), exc, real)
    monkeypatch.setattr(loraweave.mechanisms.runtime.path.RuntimePath, "attach", wrapper)
    with pytest.raises(exc, match="injected"):
        loraweave.apply(model, _full_adapter(quant), mode=mode)
    _check_restored(model, before, out_before, conv_before)
    monkeypatch.undo()
    _still_works(model, before, quant, mode)


@pytest.mark.parametrize("mode", ["runtime", "auto"])
def test_runtime_constructor_failing_midway_leaves_no_hook(monkeypatch, mode):
    model = Net(quant=True)
    before, out_before, conv_before = _snapshot(model)
    import loraweave.engine.install as applying  # where apply builds runtime paths (the planner builds none)

    real = applying.RuntimePath
    monkeypatch.setattr(
        applying, "RuntimePath", fail_on_call(3 if mode == "runtime" else 1, RuntimeError, real)
    )
    with pytest.raises(RuntimeError, match="injected"):
        loraweave.apply(model, _full_adapter(True), mode=mode)
    _check_restored(model, before, out_before, conv_before)


def test_auto_failure_after_merges_and_hooks_restores_both(monkeypatch):
    """Work is in module order: fc1, fc2, fp16, conv, block.proj merge and q is a runtime path. Fail at the
    end (building the report) after both kinds were applied."""
    model = Net(quant=True)
    before, out_before, conv_before = _snapshot(model)
    monkeypatch.setattr(
        loraweave.engine.install,
        "AppliedModule",
        fail_on_call(N_MODULES + 1, KeyboardInterrupt, loraweave.engine.install.AppliedModule),
    )
    with pytest.raises(KeyboardInterrupt):
        loraweave.apply(model, _full_adapter(True), mode="auto")
    _check_restored(model, before, out_before, conv_before)


@pytest.mark.parametrize("mode", ["runtime", "auto"])
def test_interrupt_landing_right_after_a_hook_is_registered_leaves_no_hook(monkeypatch, mode):
    """A KeyboardInterrupt delivered after RuntimePath.attach registered its hook (but before apply recorded
    the path) must still leave no hook: apply promises all-or-nothing for any exception."""
    model = Net(quant=True)
    before, out_before, conv_before = _snapshot(model)
    real = loraweave.mechanisms.runtime.path.RuntimePath.attach
    monkeypatch.setattr(
        loraweave.mechanisms.runtime.path.RuntimePath,
        "attach",
        fail_on_call(1, KeyboardInterrupt, real, after=True),
    )
    with pytest.raises(KeyboardInterrupt):
        loraweave.apply(model, _full_adapter(True), mode=mode)
    _check_restored(model, before, out_before, conv_before)


def test_interrupt_landing_right_after_a_merge_is_written_restores_it(monkeypatch):
    """Same window for merge: merge_module returned (weights written) but apply had not recorded it yet."""
    model = Net()
    before, out_before, conv_before = _snapshot(model)
    monkeypatch.setattr(
        loraweave.engine.install,
        "merge_module",
        fail_on_call(2, KeyboardInterrupt, loraweave.engine.install.merge_module, after=True),
    )
    with pytest.raises(KeyboardInterrupt):
        loraweave.apply(model, _full_adapter(False), mode="merge")
    _check_restored(model, before, out_before, conv_before)


@pytest.mark.parametrize("same_adapter", [False, True], ids=["other_adapter", "same_adapter"])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_nested_apply_failing_midway_keeps_the_outer_merge(monkeypatch, same_adapter, exc):
    """An outer handle is merged; a second apply on the same layers fails on its 3rd module. The model must be
    exactly as the outer apply left it, the original exception must come out, and the outer remove()
    restores."""
    model = Net()
    before, out_before, conv_before = _snapshot(model)
    outer_adapter = loraweave.load_adapter(_full_adapter(False), name="outer")
    outer = loraweave.apply(model, outer_adapter, mode="merge")
    merged_state = {k: v.clone() for k, v in model.state_dict().items()}
    inner_adapter = (
        outer_adapter if same_adapter else loraweave.load_adapter(_full_adapter(False), name="inner")
    )
    cls = loraweave.mechanisms.merge.layer.MergedModule
    with monkeypatch.context() as mp:
        mp.setattr(cls, "write", fail_on_call(3, exc, cls.write))
        with pytest.raises(exc, match="injected"):
            loraweave.apply(model, (inner_adapter, 0.5), mode="merge")
    for k, v in model.state_dict().items():
        assert torch.equal(v, merged_state[k]), f"{k} differs from the outer merge"
    assert_no_hooks(model)
    outer.remove()
    _check_restored(model, before, out_before, conv_before)


@pytest.mark.parametrize("same_adapter", [False, True], ids=["other_adapter", "same_adapter"])
def test_nested_merges_removed_in_any_order_end_exact(same_adapter):
    """Removing the outer handle first must either refuse (and change nothing) or be exact; either way,
    once both are removed the weights are the originals."""
    model = Net()
    before, out_before, conv_before = _snapshot(model)
    outer_adapter = loraweave.load_adapter(_full_adapter(False), name="outer")
    outer = loraweave.apply(model, outer_adapter, mode="merge")
    inner_adapter = (
        outer_adapter if same_adapter else loraweave.load_adapter(_full_adapter(False), name="inner")
    )
    inner = loraweave.apply(model, (inner_adapter, -0.5), mode="merge")
    both = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        outer.remove()
    except RuntimeError:
        for k, v in model.state_dict().items():
            assert torch.equal(v, both[k]), f"a refused remove() changed {k}"
        inner.remove()
        outer.remove()
    else:
        inner.remove()
    _check_restored(model, before, out_before, conv_before)


def test_fused_flux_part_failing_on_its_second_module_restores_the_first(monkeypatch):
    """A fused original key (img_attn.qkv) splits over to_q/to_k/to_v: a failure on to_k undoes to_q."""
    from helpers.tiny_models import flux_forward, tiny_flux

    model = tiny_flux()
    before = copy.deepcopy(model)
    with torch.no_grad():
        out_before = flux_forward(model)
    g = torch.Generator().manual_seed(0)
    sd = {
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight": torch.randn(4, 32, generator=g),
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight": torch.randn(96, 4, generator=g),
        "diffusion_model.double_blocks.0.img_attn.qkv.alpha": torch.tensor(4.0),
    }
    plan = check_report(loraweave.plan(model, sd))
    assert plan["keys_applied"] == 3
    for mode, cls, attr in [
        ("merge", loraweave.mechanisms.merge.layer.MergedModule, "write"),
        ("runtime", loraweave.mechanisms.runtime.path.RuntimePath, "attach"),
    ]:
        with monkeypatch.context() as mp:
            mp.setattr(cls, attr, fail_on_call(2, RuntimeError, getattr(cls, attr)))
            with pytest.raises(RuntimeError, match="injected"):
                loraweave.apply(model, sd, mode=mode)
        assert_untouched(model, before)
        with torch.no_grad():
            assert torch.equal(flux_forward(model), out_before)


# ------------------------------------------------------------------------ D. random apply/remove cycles


class MixedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(123)
        self.f32 = nn.Linear(12, 10)
        self.f16 = nn.Linear(12, 10).half()
        self.bf16 = nn.Linear(10, 8).bfloat16()
        self.nobias = nn.Linear(10, 10, bias=False)
        self.conv = nn.Conv2d(4, 6, 3, padding=1)
        self.conv16 = nn.Conv2d(6, 4, 3, padding=1).half()
        self.register_buffer("steps", torch.arange(5))


def _random_lora(rng: random.Random, idx: int, model: nn.Module) -> loraweave.Adapter:
    g = torch.Generator().manual_seed(1000 + idx)
    sd: dict[str, torch.Tensor] = {}
    layers = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    chosen = rng.sample(layers, rng.randint(1, len(layers)))
    fdtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    for name in chosen:
        module = model.get_submodule(name)
        rank = rng.choice([1, 2, 3, 4, 8])
        out, inp = module.weight.shape[:2]
        kind = rng.random()
        if isinstance(module, nn.Conv2d):
            if kind < 0.3:  # Tucker
                sd[f"{name}.lora_down.weight"] = torch.randn(rank, inp, 1, 1, generator=g).to(fdtype)
                sd[f"{name}.lora_mid.weight"] = torch.randn(rank, rank, 3, 3, generator=g).to(fdtype)
            else:  # LoCon: 3x3 down, 1x1 up
                sd[f"{name}.lora_down.weight"] = torch.randn(rank, inp, 3, 3, generator=g).to(fdtype)
            sd[f"{name}.lora_up.weight"] = torch.randn(out, rank, 1, 1, generator=g).to(fdtype)
        elif kind < 0.15:
            sd[f"{name}.diff"] = (torch.randn(out, inp, generator=g) * 0.1).to(fdtype)
            if module.bias is not None:
                sd[f"{name}.diff_b"] = torch.randn(out, generator=g).to(fdtype)
        else:
            sd[f"{name}.lora_A.weight"] = torch.randn(rank, inp, generator=g).to(fdtype)
            sd[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=g).to(fdtype)
            if module.bias is not None and rng.random() < 0.3:
                sd[f"{name}.lora_B.bias"] = torch.randn(out, generator=g).to(fdtype)
        if rng.random() < 0.5 and f"{name}.diff" not in sd:
            sd[f"{name}.alpha"] = torch.tensor(float(rng.choice([1, 2, 4, 0.5, 16]))).to(
                rng.choice([torch.float32, torch.float16])
            )
    return loraweave.load_adapter(sd, name=f"lora{idx}")


def test_200_random_merge_cycles_restore_bit_exactly():
    rng = random.Random(20240611)
    model = MixedNet()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    pool = [_random_lora(rng, i, model) for i in range(6)]
    changed_cycles = 0
    nested_cycles = 0

    def check_original(where: str) -> None:
        for k, v in model.state_dict().items():
            assert v.dtype == original[k].dtype and torch.equal(v, original[k]), f"{where}: {k}"

    for cycle in range(200):
        chosen = rng.sample(pool, rng.randint(1, 4))
        spec = [(a, rng.uniform(-2.0, 2.0)) for a in chosen]
        handle = loraweave.apply(model, spec, mode="merge", strict=True)
        d = handle.report.to_dict()
        assert d["keys_applied"] == d["keys_total"]
        if any(not torch.equal(v, original[k]) for k, v in model.state_dict().items()):
            changed_cycles += 1
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
        if rng.random() < 0.3:
            handle.set_strength(rng.choice(chosen).name, rng.uniform(-2.0, 2.0))
        if rng.random() < 0.25:
            nested_cycles += 1
            inner_before = {k: v.clone() for k, v in model.state_dict().items()}
            inner = loraweave.apply(
                model, [(a, rng.uniform(-1, 1)) for a in rng.sample(pool, rng.randint(1, 3))], mode="merge"
            )
            inner.remove()
            for k, v in model.state_dict().items():
                assert torch.equal(v, inner_before[k]), f"cycle {cycle}: inner remove {k}"
            inner2 = loraweave.apply(model, [(rng.choice(pool), rng.uniform(-1, 1))], mode="merge")
            inner2.remove()
        handle.remove()
        handle.remove()  # idempotent
        check_original(f"cycle {cycle}")
    assert changed_cycles >= 190
    assert nested_cycles >= 20
