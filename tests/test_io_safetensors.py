"""SafetensorsFile (validating lazy reader) and the opt-in pickle reader."""

from __future__ import annotations

import gc
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loraweave.errors import AdapterFileError, AdapterFormatError, UnsafeFormatError
from loraweave.io.pickle_file import load_pickle_state_dict
from loraweave.io.safetensors_file import SafetensorsFile, read_safetensors_header

SHARED = Path(__file__).resolve().parents[2] / "shared"
LORA_DIR = SHARED / "realdata" / "lora"
TRUNCATED = (
    LORA_DIR
    / "broken"
    / ("Srikanth1408__Stable_Diffusion-Hackathon__pytorch_lora_weights__TRUNCATED.safetensors")
)
REAL_FILES = sorted(LORA_DIR.glob("*.safetensors"))


def _write(path: Path, header: object, data: bytes = b"", header_len: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------- round trip


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "f64": torch.randn(3, 4, generator=g, dtype=torch.float64),
        "f32": torch.randn(5, 7, generator=g),
        "f16": torch.randn(2, 3, 4, generator=g).half(),
        "bf16": torch.randn(9, generator=g).bfloat16(),
        "i64": torch.arange(-5, 5, dtype=torch.int64),
        "i32": torch.arange(-3, 3, dtype=torch.int32).reshape(2, 3),
        "i16": torch.tensor([-32768, 0, 32767], dtype=torch.int16),
        "i8": torch.tensor([-128, 1, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 7, 255], dtype=torch.uint8),
        "bool": torch.tensor([[True, False], [False, True]]),
        "scalar_f32": torch.tensor(3.5),
        "scalar_bool": torch.tensor(True),
        "empty_1d": torch.zeros(0),
        "empty_2d": torch.zeros(3, 0, dtype=torch.float16),
    }
    for name, attr in [("u16", "uint16"), ("u32", "uint32"), ("u64", "uint64")]:
        if hasattr(torch, attr):
            out[name] = torch.tensor([0, 1, 2], dtype=getattr(torch, attr))
    for name, attr in [("f8e4m3", "float8_e4m3fn"), ("f8e5m2", "float8_e5m2")]:
        if hasattr(torch, attr):
            out[name] = torch.tensor([0.5, -1.0, 2.0]).to(getattr(torch, attr))
    return out


def test_round_trip_against_safetensors(tmp_path):
    tensors = _sample_tensors()
    path = tmp_path / "rt.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "ünïcode"})
    with SafetensorsFile(path) as f:
        assert f.path == path
        assert f.metadata == {"format": "pt", "note": "ünïcode"}
        assert sorted(f.keys()) == sorted(tensors)
        assert len(f) == len(tensors)
        assert "f32" in f and "nope" not in f
        for key, want in tensors.items():
            assert f.shape(key) == tuple(want.shape), key
            assert f.dtype(key) == want.dtype, key
            got = f.get(key)
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(_raw(got), _raw(want)), key
        with pytest.raises(KeyError, match="nope"):
            f.get("nope")


def test_keys_follow_header_order_and_no_metadata(tmp_path):
    header = {
        "zeta": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "alpha": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
    }
    path = _write(tmp_path / "o.safetensors", header, struct.pack("<2f", 1.0, 2.0))
    f = SafetensorsFile(path)
    assert f.keys() == ["zeta", "alpha"]
    assert f.metadata == {}
    assert f.get("alpha").item() == 2.0


def test_unaligned_data_is_copied_to_aligned_memory(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}})
    header += " " * ((1 - 8 - len(header)) % 8)  # data starts at an odd byte
    path = _write(tmp_path / "u.safetensors", header.encode(), struct.pack("<3f", 1.0, 2.5, -3.0))
    with SafetensorsFile(path) as f:
        t = f.get("w")
    assert t.data_ptr() % 4 == 0
    assert t.tolist() == [1.0, 2.5, -3.0]


def test_tensors_outlive_close_and_inplace_edits_never_reach_file(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"w": torch.arange(8, dtype=torch.float32)}, str(path))
    before = path.read_bytes()
    f = SafetensorsFile(path)
    t = f.get("w")
    t.mul_(2)  # would segfault on a PROT_READ mapping
    f.close()
    del f
    gc.collect()
    assert torch.equal(t, torch.arange(8, dtype=torch.float32) * 2)
    assert path.read_bytes() == before
    with SafetensorsFile(path) as g:
        assert torch.equal(g.get("w"), torch.arange(8, dtype=torch.float32))
    with pytest.raises(ValueError, match="closed"):
        g.get("w")


def test_open_is_lazy_for_a_200mb_tensor(tmp_path):
    numel = 50 * 1024 * 1024  # 200 MiB of F32
    header = json.dumps({"big": {"dtype": "F32", "shape": [numel], "data_offsets": [0, numel * 4]}})
    header += " " * (-(8 + len(header)) % 8)  # keep the data 8-byte aligned so .get is zero-copy
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header.encode())
        fh.truncate(8 + len(header) + numel * 4)  # sparse: costs neither disk nor RAM
    gc.collect()
    rss0 = _rss_bytes()
    f = SafetensorsFile(path)
    assert f.keys() == ["big"] and f.shape("big") == (numel,)
    assert _rss_bytes() - rss0 < 20 * 2**20
    t = f.get("big")
    assert t.shape == (numel,) and t[12345].item() == 0.0
    assert _rss_bytes() - rss0 < 20 * 2**20
    del t
    f.close()


# ---------------------------------------------------------------- real files


def test_real_lora_files_are_present():
    assert len(REAL_FILES) >= 8, f"expected the real LoRA fixtures in {LORA_DIR}"
    assert TRUNCATED.is_file(), f"missing fixture {TRUNCATED}"


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.name[:48])
def test_real_file_matches_safe_open(path):
    with SafetensorsFile(path) as ours, safe_open(str(path), framework="pt") as ref:
        assert sorted(ours.keys()) == sorted(ref.keys())
        assert ours.metadata == (ref.metadata() or {})
        for key in ref.keys():
            want = ref.get_tensor(key)
            got = ours.get(key)
            assert ours.shape(key) == tuple(want.shape), key
            assert ours.dtype(key) == want.dtype, key
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(got, want), key


def test_real_truncated_file_is_rejected():
    assert TRUNCATED.is_file(), f"missing fixture {TRUNCATED}"
    with pytest.raises(AdapterFileError) as exc:
        SafetensorsFile(TRUNCATED)
    msg = str(exc.value)
    assert TRUNCATED.name in msg
    assert "truncated" in msg and "1310720" in msg and "23401064" in msg
    assert "tensor '" in msg


# ---------------------------------------------------------------- malformed files

_F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("header", "data", "header_len", "expect"),
    [
        pytest.param(b"{not json", b"", None, "not valid JSON", id="garbage-json"),
        pytest.param(
            b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}", b"", None, "not valid JSON", id="deep-json"
        ),
        pytest.param(b'{"a": \xff}', b"", None, "UTF-8", id="bad-utf8"),
        pytest.param(b"[1, 2]", b"", None, "expected an object", id="not-an-object"),
        pytest.param(b"{}", b"", 1000, "past the end", id="header-len-beyond-file"),
        pytest.param(b"{}", b"", 2**63, "outside", id="header-len-absurd"),
        pytest.param(b"{", b"", 1, "outside", id="header-len-too-small"),
        pytest.param({"x": _F32x2}, b"\0" * 4, None, "'x' data ends at byte", id="range-outside-file"),
        pytest.param(
            {"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}},
            b"\0" * 16,
            None,
            "needs 16",
            id="size-vs-shape",
        ),
        pytest.param(
            {"x": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "unknown dtype 'Q7'",
            id="unknown-dtype",
        ),
        pytest.param(
            {"x": _F32x2, "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
            b"\0" * 12,
            None,
            "overlaps",
            id="overlap",
        ),
        pytest.param(
            {"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "non-negative",
            id="negative-dim",
        ),
        pytest.param(
            {"x": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}},
            b"\0" * 4,
            None,
            "non-negative",
            id="bool-dim",
        ),
        pytest.param(
            {"x": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}},
            b"\0" * 8,
            None,
            "begin <= end",
            id="begin-after-end",
        ),
        pytest.param({"x": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "data_offsets", id="no-offsets"),
        pytest.param({"x": [1]}, b"", None, "expected an object", id="entry-not-object"),
        pytest.param({"__metadata__": {"a": 1}}, b"", None, "__metadata__", id="metadata-not-str"),
        pytest.param(
            b'{"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},'
            b' "x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
            b"\0",
            None,
            "duplicate key 'x'",
            id="duplicate-key",
        ),
    ],
)
def test_malformed_files_raise_typed_errors(tmp_path, header, data, header_len, expect):
    path = _write(tmp_path / "bad.safetensors", header, data, header_len)
    with pytest.raises(AdapterFileError, match=expect) as exc:
        SafetensorsFile(path)
    assert "bad.safetensors" in str(exc.value)
    with pytest.raises(AdapterFileError):
        read_safetensors_header(path)


def test_file_shorter_than_length_prefix(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x02\0\0")
    with pytest.raises(AdapterFileError, match="8-byte header length"):
        SafetensorsFile(path)


def test_bool_with_invalid_bytes_is_rejected_on_get(tmp_path):
    path = _write(
        tmp_path / "b.safetensors",
        {"m": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}},
        b"\x01\x07",
    )
    with SafetensorsFile(path) as f, pytest.raises(AdapterFileError, match="'m' is BOOL"):
        f.get("m")


# ---------------------------------------------------------------- pickles


def test_pickle_refused_without_opt_in(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"a": torch.ones(2)}, path)
    with pytest.raises(UnsafeFormatError) as exc:
        load_pickle_state_dict(path, allow_pickle=False)
    msg = str(exc.value)
    assert "w.pt" in msg and "allow_pickle=True" in msg and "safetensors" in msg and "code" in msg


def test_pickle_opt_in_reads_tensors(tmp_path):
    want = {"a.lora_down.weight": torch.randn(4, 8), "a.alpha": torch.tensor(4.0)}
    torch.save(want, tmp_path / "w.pt")
    got = load_pickle_state_dict(tmp_path / "w.pt", allow_pickle=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    torch.save({"state_dict": want, "epoch": 3, "optimizer": {"lr": 1e-4}}, tmp_path / "ckpt.ckpt")
    got = load_pickle_state_dict(tmp_path / "ckpt.ckpt", allow_pickle=True)
    assert got.keys() == want.keys()


def test_pickle_opt_in_rejects_non_state_dicts(tmp_path):
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(AdapterFormatError, match="list"):
        load_pickle_state_dict(tmp_path / "list.pt", allow_pickle=True)
    torch.save({"epoch": 3}, tmp_path / "none.pt")
    with pytest.raises(AdapterFormatError, match="no tensors"):
        load_pickle_state_dict(tmp_path / "none.pt", allow_pickle=True)
    (tmp_path / "junk.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(AdapterFileError, match="junk.bin"):
        load_pickle_state_dict(tmp_path / "junk.bin", allow_pickle=True)


class _Arbitrary:
    pass


def test_pickle_with_arbitrary_objects_is_refused_by_weights_only(tmp_path):
    torch.save({"a": torch.ones(1), "obj": _Arbitrary()}, tmp_path / "evil.pt")
    with pytest.raises(AdapterFileError, match="weights_only"):
        load_pickle_state_dict(tmp_path / "evil.pt", allow_pickle=True)
