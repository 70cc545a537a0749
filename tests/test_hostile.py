"""Issue 16's defects, one test each: hostile metadata and headers end in typed errors naming file and field,
finite factors never merge inf, the reader refuses what the safetensors reader refuses, switch agrees with
apply, and two threads on one model never leave an irreversible state. The model is unchanged after every
error."""

from __future__ import annotations

import copy
import json
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers.common import rel_err
from helpers.hostile_nets import Net, lora, no_hooks, same, state
from safetensors.torch import save_file
from torch import nn

import loraweave
from loraweave import LoraweaveError

SRC = str(Path(__file__).resolve().parents[1] / "src")


def refused_cleanly(path, match: str, mode: str = "merge") -> LoraweaveError:
    model = Net()
    before = state(model)
    with pytest.raises(LoraweaveError, match=match) as exc:
        loraweave.apply(model, str(path), mode=mode)
    assert str(path) in str(exc.value)
    assert same(model, before) and no_hooks(model)
    return exc.value


# ---------------------------------------------------------------- metadata: typed errors naming file and
# field


@pytest.mark.parametrize(
    "meta, field",
    [
        ({"r": 2, "lora_alpha": 2, "alpha_pattern": {"fc1(": 4}}, "alpha_pattern"),  # re.error on main
        ({"r": [4], "lora_alpha": 2}, "r"),  # TypeError
        ({"r": 2, "lora_alpha": [1]}, "lora_alpha"),  # TypeError
        ({"r": "1e400", "lora_alpha": 2}, "r"),
        ({"lora_alpha": 2, "r": None, "rank_pattern": {"fc1": 1e400}}, "rank_pattern"),
    ],
    ids=["bad_regex", "r_list", "alpha_list", "r_string", "rank_pattern_inf"],
)
def test_bad_peft_metadata_is_a_typed_error(tmp_path, meta, field):
    path = tmp_path / "peft.safetensors"
    save_file(lora(["fc1"], 1), str(path), metadata={"lora_adapter_metadata": json.dumps(meta)})
    err = refused_cleanly(path, field)
    assert isinstance(err, loraweave.AdapterMetadataError) and field in err.field


def test_peft_r_1e400_is_a_typed_error(tmp_path):
    """JSON 1e400 reads as inf: int(inf) raised OverflowError."""
    path = tmp_path / "peft.safetensors"
    save_file(
        lora(["fc1"], 1), str(path), metadata={"lora_adapter_metadata": '{"r": 1e400, "lora_alpha": 4}'}
    )
    refused_cleanly(path, "'lora_adapter_metadata: r'")


@pytest.mark.parametrize("value", ["7", '{"a": 1}', "[1, 2]", "not json"])
def test_bad_cloneofsimo_metadata_is_a_typed_error(tmp_path, value):
    sd = {
        "text_encoder:0:down": torch.randn(2, 8, generator=torch.Generator().manual_seed(9)),
        "text_encoder:0:up": torch.randn(8, 2),
    }
    path = tmp_path / "cos.safetensors"
    save_file(sd, str(path), metadata={"text_encoder": value})
    with pytest.raises(loraweave.AdapterMetadataError, match="'text_encoder'") as exc:
        loraweave.load_adapter(path)
    assert str(path) in str(exc.value)


def test_bad_kohya_alpha_is_a_typed_error(tmp_path):
    """A non-numeric ss_network_alpha was silently dropped (scale 1 instead of alpha/rank)."""
    path = tmp_path / "kohya.safetensors"
    save_file(lora(["fc1"], 1), str(path), metadata={"ss_network_alpha": "four"})
    refused_cleanly(path, "ss_network_alpha")


# ---------------------------------------------------------------- the reader


def raw_file(path: Path, header: dict, data: bytes, length_delta: int = 0, pad: int = 0) -> Path:
    text = json.dumps(header).encode() + b" " * pad
    path.write_bytes(struct.pack("<Q", len(text) + length_delta) + text + data)
    return path


def entry(dtype, shape, begin, end) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def lora_header(down_dtype="F32") -> tuple[dict, bytes]:
    down = torch.full((2, 8), 0.25)
    up = torch.full((8, 2), 0.5)
    data = down.numpy().tobytes() + up.numpy().tobytes()
    return {
        "fc1.lora_A.weight": entry(down_dtype, [2, 8], 0, 64),
        "fc1.lora_B.weight": entry("F32", [8, 2], 64, 128),
    }, data


def test_header_dtype_given_as_a_list(tmp_path):
    header, data = lora_header()
    header["fc1.lora_A.weight"]["dtype"] = ["F32"]
    refused_cleanly(raw_file(tmp_path / "f.safetensors", header, data), "unknown dtype")


def test_zero_size_tensor_with_a_huge_dimension(tmp_path):
    header, data = lora_header()
    header["x.alpha"] = entry("F32", [0, 10**30], 128, 128)
    refused_cleanly(raw_file(tmp_path / "f.safetensors", header, data), "too large")


def test_header_length_one_byte_short_is_refused(tmp_path):
    """Padding spaces keep the shortened header valid JSON; every tensor would be read one byte off."""
    header, data = lora_header()
    refused_cleanly(
        raw_file(tmp_path / "f.safetensors", header, data, length_delta=-1, pad=8), "trailing bytes"
    )


@pytest.mark.parametrize("case", ["gap", "trailing", "empty_inside", "overlap_start"])
def test_ranges_must_tile_the_data_exactly(tmp_path, case):
    header, data = lora_header()
    if case == "gap":
        header["fc1.lora_B.weight"]["data_offsets"] = [68, 132]
        data += b"\0" * 4
    elif case == "trailing":
        data += b"\0" * 8
    elif case == "empty_inside":  # a zero-size tensor inside another's bytes
        header["fc1.alpha"] = entry("F32", [0], 32, 32)
    else:  # the second tensor starts inside the first
        header["fc1.lora_A.weight"]["data_offsets"] = [0, 64]
        header["fc1.lora_B.weight"]["data_offsets"] = [60, 124]
        data = data[:124]
    refused_cleanly(
        raw_file(tmp_path / "f.safetensors", header, data), "belong to no tensor|trailing|overlaps"
    )


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2"])
@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_float8_factors_merge_like_their_fp32_values(tmp_path, dtype, mode):
    torch_dtype = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}[dtype]
    sd = {k: v.to(torch_dtype) for k, v in lora(["fc1"], 3).items()}
    path = tmp_path / "f8.safetensors"
    save_file(sd, str(path))
    model, ref = Net(), Net()
    handle = loraweave.apply(model, str(path), mode=mode, strict=True)
    loraweave.apply(ref, {k: v.float() for k, v in sd.items()}, mode=mode, strict=True)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert rel_err(model(x), ref(x)) <= 1e-6
    handle.remove()
    assert same(model, state(Net()))


def test_every_format_dtype_reads_or_is_refused_typed(tmp_path):
    """Every dtype the safetensors format names; sub-byte ones are sized in bits and refused on use."""
    for dtype, nbytes in [
        ("F8_E8M0", 16),
        ("C64", 128),
        ("U16", 32),
        ("U32", 64),
        ("U64", 128),
        ("I16", 32),
        ("F4", 8),
        ("F6_E2M3", 12),
        ("F6_E3M2", 12),
    ]:
        header = {"fc1.lora_A.weight": entry(dtype, [2, 8], 0, nbytes)}
        path = raw_file(tmp_path / f"{dtype}.safetensors", header, b"\x01" * nbytes)
        model, before = Net(), state(Net())
        try:
            handle = loraweave.apply(model, str(path), mode="merge")
        except loraweave.errors.NoKeysLandedError:
            # read, then reported as misses: nothing landed, so apply refuses (typed) and changes nothing
            pass
        except LoraweaveError as exc:
            assert str(path) in str(exc)
        else:
            assert handle.report.unmatched and handle.report.keys_applied == 0
        assert same(model, before)


# ---------------------------------------------------------------- no silent non-finite merge


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_finite_factors_whose_product_overflows_never_merge_inf(tmp_path, dtype):
    big = 3e2 if dtype == torch.float16 else 3e19  # 9e4 > fp16 max; 9e38 > fp32 max
    sd = {"fc2.lora_A.weight": torch.full((1, 8), big), "fc2.lora_B.weight": torch.full((8, 1), big)}
    sd |= lora(["fc1"], 4)  # a layer merged before the failing one: restored too
    model = Net(dtype)
    before = state(model)
    with pytest.raises(LoraweaveError, match="fc2") as exc:
        loraweave.apply(model, sd, mode="merge")
    assert type(exc.value).__name__ == "NonFiniteResultError" and same(model, before)


def test_set_strength_that_would_overflow_keeps_the_old_strength():
    sd = {"fc2.lora_A.weight": torch.full((1, 8), 200.0), "fc2.lora_B.weight": torch.full((8, 1), 200.0)}
    model = Net(torch.float16)
    handle = loraweave.apply(model, sd, mode="merge")
    merged = state(model)
    with pytest.raises(LoraweaveError, match="non-finite"):
        handle.set_strength(handle.report.adapters[0]["name"], 5.0)
    assert same(model, merged) and handle.strengths[handle.report.adapters[0]["name"]] == 1.0


# ---------------------------------------------------------------- switch agrees with apply


def test_switch_refuses_klora_on_a_merge_handle_like_apply():
    a, b = lora(["fc1", "fc2"], 1), lora(["fc1", "fc2"], 2)
    model = Net()
    with pytest.raises(ValueError, match="mode='runtime'"):
        loraweave.apply(copy.deepcopy(model), [a, b], mode="merge", stack="klora")
    handle = loraweave.apply(model, [a], mode="merge")
    merged = state(model)
    with pytest.raises(ValueError, match="mode='runtime'"):
        handle.switch([a, b], stack="klora")
    assert same(model, merged) and handle.active  # refused before anything changed
    handle.remove()


def test_switch_from_klora_to_sum_drops_the_layer_selection():
    a, b = lora(["fc1", "fc2"], 1), lora(["fc1", "fc2"], 2)
    model, fresh = Net(), Net()
    handle = loraweave.apply(model, [(a, 1.0), (b, 1.0)], mode="runtime", stack="klora")
    handle.set_layer_choice("transformer.fc1", 1)
    handle.switch([(a, 1.0), (b, 1.0)], stack="sum")
    loraweave.apply(fresh, [(a, 1.0), (b, 1.0)], mode="runtime", stack="sum")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert rel_err(model(x), fresh(x)) <= 1e-6
    with pytest.raises(RuntimeError, match="klora"):  # no selection is left to drive
        handle.set_layer_choice("transformer.fc1", 0)


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_switch_to_the_same_file_twice_sums_both_strengths(tmp_path, mode):
    path = tmp_path / "a.safetensors"
    save_file(lora(["fc1", "fc2"], 5), str(path))
    model, fresh = Net(), Net()
    handle = loraweave.apply(model, [(str(path), 0.5), (str(path), 0.3)], mode=mode)
    handle.switch([(str(path), 0.2), (str(path), 0.9)])
    loraweave.apply(fresh, [(str(path), 1.1)], mode=mode)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert rel_err(model(x), fresh(x)) <= 1e-6
    handle.switch([(str(path), 1.0)])  # and back to one copy
    loraweave.apply(fresh := Net(), [(str(path), 1.0)], mode=mode)
    with torch.no_grad():
        assert rel_err(model(x), fresh(x)) <= 1e-6
    handle.remove()
    assert same(model, state(Net()))


def dora(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fc2.lora_down.weight": torch.randn(2, 8, generator=g) * 0.3,
        "fc2.lora_up.weight": torch.randn(8, 2, generator=g) * 0.3,
        "fc2.dora_scale": torch.rand(8, 1, generator=g) + 0.5,
    }


@pytest.mark.parametrize("mode", ["runtime", "merge"])
def test_switch_dropping_a_dora_adapter_removes_it(mode):
    a = lora(["fc1", "fc2"], 1)
    model, fresh = Net(), Net()
    handle = loraweave.apply(model, [(a, 1.0), (dora(2), 1.0)], mode=mode, strict=True)
    handle.switch([(a, 1.0)])
    loraweave.apply(fresh, [(a, 1.0)], mode=mode)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert rel_err(model(x), fresh(x)) <= 1e-6
    handle.remove()
    assert same(model, state(Net())) and no_hooks(model)


# ---------------------------------------------------------------- threads


class Wide(nn.Module):
    """Layers large enough that two threads' merges overlap in time (torch releases the GIL in its
    kernels)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(384, 384) for _ in range(6))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def wide_lora(layers, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: v
        for i in layers
        for k, v in (
            (f"layers.{i}.lora_A.weight", torch.randn(32, 384, generator=g) * 0.1),
            (f"layers.{i}.lora_B.weight", torch.randn(384, 32, generator=g) * 0.1),
        )
    }


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_two_threads_on_overlapping_layers_stay_reversible(mode):
    """Ten rounds of two threads applying adapters to shared layers at once, then removing in any order."""
    pristine = state(Wide())
    a, b = wide_lora(range(0, 5), 1), wide_lora(range(1, 6), 2)
    for _ in range(10):
        model = Wide()
        handles, errors = [], []
        barrier = threading.Barrier(2)

        def run(sd, model=model, handles=handles, errors=errors, barrier=barrier):
            barrier.wait()
            try:
                handles.append(loraweave.apply(model, sd, mode=mode))
            except BaseException as exc:  # noqa: BLE001  reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(sd,)) for sd in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(handles) == 2
        try:
            handles[0].remove()  # may be the older merge: refused, then the newer goes first
        except RuntimeError:
            handles[1].remove()
            handles[0].remove()
        handles[1].remove()
        assert same(model, pristine) and no_hooks(model)


# ---------------------------------------------------------------- CLI: one line, valid JSON


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "loraweave.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli_bad_metadata_is_one_line_without_traceback(tmp_path):
    path = tmp_path / "peft.safetensors"
    save_file(lora(["fc1"], 1), str(path), metadata={"lora_adapter_metadata": '{"r": 2, "lora_alpha": [1]}'})
    res = run_cli("inspect", str(path))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "lora_alpha" in res.stderr


def test_cli_json_is_valid_for_keys_with_lone_surrogates(tmp_path):
    header = {"fc1\ud800.lora_A.weight": entry("F32", [2, 8], 0, 64)}
    path = raw_file(tmp_path / "s.safetensors", header, torch.zeros(2, 8).numpy().tobytes())
    res = run_cli("inspect", str(path), "--json")
    assert res.returncode == 0, res.stderr
    json.loads(res.stdout)
    assert "\\ud800" in res.stdout  # the key survives, escaped
    assert "Traceback" not in res.stderr


def test_dora_strength_zero_is_what_the_readme_says():
    """dora_scale: s = 0 gives W + γΔW; PEFT lora_magnitude_vector: s = 0 gives m ⊙ W / ‖W‖ (per row)."""
    sd = dora(7)
    up, down, m = (
        sd["fc2.lora_up.weight"].double(),
        sd["fc2.lora_down.weight"].double(),
        sd["fc2.dora_scale"].double(),
    )
    for mode in ("merge", "runtime"):
        model = Net()
        w = model.fc2.weight.detach().double().clone()
        handle = loraweave.apply(model, sd, mode=mode, strict=True)
        handle.set_strength(handle.report.adapters[0]["name"], 0.0)
        x = torch.randn(3, 8, dtype=torch.float64)
        with torch.no_grad():
            got = model.fc2.double()(x) if mode == "runtime" else None
        model.fc2.float()
        expect = w + up @ down  # γ = 1 (no alpha): W_c = W + ΔW
        if mode == "merge":
            assert rel_err(model.fc2.weight.double(), expect) <= 1e-6
        else:
            assert rel_err(got, x @ expect.t() + model.fc2.bias.double()) <= 1e-6
        handle.remove()
    peft = {
        "fc2.lora_A.weight": down.float(),
        "fc2.lora_B.weight": up.float(),
        "fc2.lora_magnitude_vector": m.flatten().float(),
    }
    model = Net()
    w = model.fc2.weight.detach().double().clone()
    handle = loraweave.apply(model, peft, mode="merge", strict=True)
    handle.set_strength(handle.report.adapters[0]["name"], 0.0)
    assert rel_err(model.fc2.weight.double(), m * w / w.norm(dim=1, keepdim=True)) <= 1e-6
    handle.remove()
