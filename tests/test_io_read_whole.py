"""SafetensorsFile(read=True) (a file read whole into memory of its own, what the ComfyUI pack's loaders use)
and its bulk finite check (finite_keys, one pass per run of one dtype), against the mapped reader and
safetensors' own: the same tensors bit for bit; tensors no later write to the file reaches; a non-finite
tensor never proven finite, and the planner still rejects exactly the parts the mapped reader's per-tensor
checks reject."""

from __future__ import annotations

import pytest
import torch
from helpers.robust_nets import Net
from safetensors.torch import load_file, save_file

import loraweave
from loraweave.io.safetensors_file import SafetensorsFile


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(6, 8, generator=g),
        "b": torch.randn(3, generator=g).half(),
        "c": torch.randn(4, 4, generator=g).bfloat16(),
        "d": torch.randn(2, 5, generator=g).double(),
        "e": torch.arange(7),
        "f": torch.randn(5, 3, generator=g),
        "g": torch.zeros(0),
    }


def test_read_whole_equals_mapped_and_no_later_write_reaches_it(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file(tensors(), str(path))
    reference = {k: v.clone() for k, v in load_file(str(path)).items()}
    read, mapped = SafetensorsFile(path, read=True), SafetensorsFile(path)
    assert read.owned and not mapped.owned
    got = {k: read.get(k) for k in read.keys()}
    for key, value in reference.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        assert torch.equal(mapped.get(key), value), key
    size = path.stat().st_size
    with open(path, "r+b") as f:  # the same file overwritten in place (same inode), then cut short
        f.write(b"\xff" * size)
        f.truncate(size // 2)
    for key, value in reference.items():
        assert torch.equal(got[key], value) and torch.equal(read.get(key), value), key
    assert read.scalar("b") is None and read.finite_keys() is not None


def test_finite_keys_proves_only_finite_floats(tmp_path):
    clean = tmp_path / "clean.safetensors"
    save_file(tensors(), str(clean))
    floats = {"a", "b", "c", "d", "f"}  # not e (int), nor g (empty)
    assert SafetensorsFile(clean, read=True).finite_keys() == floats
    assert SafetensorsFile(clean).finite_keys() is None  # a mapped file is checked per tensor by its readers
    cases = (
        ("a", float("nan")),
        ("b", float("inf")),
        ("c", float("inf")),
        ("c", float("nan")),
        ("d", -float("inf")),
    )
    for bad, value in (*cases, ("f", float("nan"))):
        state = tensors()
        state[bad] = state[bad].clone()
        state[bad].view(-1)[-1] = value
        path = tmp_path / f"bad_{bad}_{value}.safetensors"
        save_file(state, str(path))
        found = SafetensorsFile(path, read=True).finite_keys()
        assert bad not in found, bad
        assert found <= {"a", "b", "c", "d", "f"} - {bad}


def good(prefix: str, out: int, inp: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"{prefix}.lora_down.weight": torch.randn(2, inp, generator=g) * 0.1,
        f"{prefix}.lora_up.weight": torch.randn(out, 2, generator=g) * 0.1,
        f"{prefix}.alpha": torch.tensor(1.0),
    }


@pytest.mark.parametrize("where", ["fc1.lora_down.weight", "fc2.lora_up.weight", "fc2.alpha"])
def test_a_non_finite_tensor_in_a_read_file_is_rejected_as_by_the_mapped_reader(tmp_path, where):
    """Good and bad parts in one fp32 file (one run: the bulk pass fails, each tensor is checked on its
    own)."""
    state = {**good("fc1", 6, 8, 1), **good("fc2", 6, 6, 2), **good("block.proj", 6, 6, 3)}
    state[where] = state[where].clone()
    state[where].view(-1)[0] = float("nan")
    path = tmp_path / "mixed.safetensors"
    save_file(state, str(path))
    reports = {}
    for read in (True, False):
        adapter = loraweave.load_adapter(path, read=read)
        handle = loraweave.apply(Net(), [adapter], mode="runtime", allow_empty=True)
        reports[read] = sorted((u["key"], u["reason"]) for u in handle.report.to_dict()["unmatched"])
        handle.remove()
    assert reports[True] == reports[False]
    part = where.rsplit(".", 2)[0] if where.endswith(".weight") else where.rsplit(".", 1)[0]
    assert {k for k, _ in reports[True]} == {k for k in state if k.startswith(f"{part}.")}
    assert all("NaN" in reason or "not finite" in reason for _, reason in reports[True])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("at", [0, (1 << 16) - 1, 1 << 16, 3 * (1 << 16) + 5, -1])
def test_finite_keys_sees_every_chunk_of_a_long_run(tmp_path, dtype, at):
    # The bulk check walks a run in chunks of 2^16 values: a bad value at either edge of any chunk is seen.
    n = 4 * (1 << 16) + 11
    state = {"x": torch.ones(n, dtype=dtype), "y": torch.ones(n, dtype=dtype)}
    save_file(state, str(tmp_path / "clean.safetensors"))
    assert SafetensorsFile(tmp_path / "clean.safetensors", read=True).finite_keys() == {"x", "y"}
    state["y"][at] = float("inf")
    save_file(state, str(tmp_path / "bad.safetensors"))
    assert "y" not in SafetensorsFile(tmp_path / "bad.safetensors", read=True).finite_keys()
