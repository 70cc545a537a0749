"""Validating, lazy, memory-mapped reader for .safetensors files."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, overload

from loraweave.errors import AdapterFileError

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype -> (torch attribute, item size): validated without importing torch (`inspect` start-up).
_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "U16": ("uint16", 2),
    "U32": ("uint32", 4),
    "U64": ("uint64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "C64": ("complex64", 8),
}
# Scalars read straight from the bytes (alphas), as struct formats; BF16 is widened to F32 by hand.
_SCALAR_FORMATS = {
    "F64": "<d",
    "F32": "<f",
    "F16": "<e",
    "I64": "<q",
    "I32": "<i",
    "I16": "<h",
    "I8": "<b",
    "U8": "<B",
    "U16": "<H",
    "U32": "<I",
    "U64": "<Q",
}


def torch_dtype(name: str) -> torch.dtype | str:
    """The torch dtype of a safetensors dtype name; a packed sub-byte dtype stays its name."""
    if name not in _DTYPES:
        return name
    import torch

    return getattr(torch, _DTYPES[name][0])


# Sub-byte dtypes of the format: sized in bits, no torch element type (F4 packs two values per byte).
_PACKED_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
_MAX_ELEMENTS = 2**63 - 1  # the format's sizes are 64-bit; larger claims cannot describe real data

Header = dict[str, tuple["torch.dtype | str", tuple[int, ...], int, int]]  # a packed dtype stays its name
NamedHeader = dict[str, tuple[str, tuple[int, ...], int, int]]  # every dtype as its safetensors name


def _is_int(value: Any) -> bool:
    # JSON true/false decode to bool, which is an int subclass in Python.
    return isinstance(value, int) and not isinstance(value, bool)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _entry_dtype(fail: Callable[[str], NoReturn], key: str, dtype_name: Any) -> str:
    if not isinstance(dtype_name, str) or (dtype_name not in _DTYPES and dtype_name not in _PACKED_BITS):
        fail(f"tensor {key!r}: unknown dtype {dtype_name!r} (known: {', '.join([*_DTYPES, *_PACKED_BITS])})")
    return dtype_name


def _entry_shape(fail: Callable[[str], NoReturn], key: str, shape: Any) -> list[int]:
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        fail(f"tensor {key!r}: shape {shape!r} is not a list of non-negative integers")
    if math.prod(d for d in shape if d) > _MAX_ELEMENTS:
        fail(f"tensor {key!r}: shape {shape} is too large for the format (over 2^63 elements)")
    return shape


def _entry_offsets(fail: Callable[[str], NoReturn], key: str, offsets: Any) -> tuple[int, int]:
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        fail(f"tensor {key!r}: data_offsets {offsets!r} is not a [begin, end] pair of integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        fail(f"tensor {key!r}: data_offsets [{begin}, {end}] need 0 <= begin <= end")
    return begin, end


def _parse_entry(
    fail: Callable[[str], NoReturn], key: str, entry: Any
) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(entry, dict):
        fail(f"tensor {key!r}: header entry is {type(entry).__name__}, expected an object")
    extra = sorted(set(entry) - {"dtype", "shape", "data_offsets"})
    if extra:
        fail(f"tensor {key!r}: unknown header fields {extra}")
    dtype_name = _entry_dtype(fail, key, entry.get("dtype"))
    shape = _entry_shape(fail, key, entry.get("shape"))
    begin, end = _entry_offsets(fail, key, entry.get("data_offsets"))
    bits = math.prod(shape) * (
        _PACKED_BITS[dtype_name] if dtype_name in _PACKED_BITS else 8 * _DTYPES[dtype_name][1]
    )
    if bits % 8:
        fail(f"tensor {key!r}: shape {shape} of {dtype_name} is not a whole number of bytes")
    expected = bits // 8
    if end - begin != expected:
        fail(
            f"tensor {key!r}: data_offsets [{begin}, {end}] span {end - begin} bytes but shape "
            f"{shape} of {dtype_name} needs {expected}"
        )
    return dtype_name, tuple(shape), begin, end


def _header_bytes(fail: Callable[[str], NoReturn], path: Path) -> tuple[bytes, int]:
    """(the JSON header's bytes, the file size), its length checked against the file before it is read."""
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        if file_size < 8:
            fail(f"file has {file_size} bytes; a safetensors file starts with an 8-byte header length")
        (n,) = struct.unpack("<Q", f.read(8))
        if n < 2 or n > MAX_HEADER_BYTES:
            fail(f"header length {n} is outside [2, {MAX_HEADER_BYTES}]: not a safetensors file?")
        if 8 + n > file_size:
            fail(f"header length {n} runs past the end of the file ({file_size} bytes): file truncated?")
        raw = f.read(n)
    if len(raw) != n:
        fail(f"read {len(raw)} of {n} header bytes: file changed while reading?")
    return raw, file_size


def _header_json(fail: Callable[[str], NoReturn], raw: bytes) -> dict:
    try:
        parsed = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except UnicodeDecodeError as e:
        fail(f"header is not valid UTF-8 ({e.reason} at byte {e.start})")
    except (ValueError, RecursionError) as e:
        fail(f"header is not valid JSON: {type(e).__name__}: {e}")
    if not isinstance(parsed, dict):
        fail(f"header is a JSON {type(parsed).__name__}, expected an object")
    return parsed


@overload
def read_safetensors_header(
    path: str | os.PathLike, names: Literal[False] = False
) -> tuple[Header, dict[str, str], int]: ...


@overload
def read_safetensors_header(
    path: str | os.PathLike, names: Literal[True]
) -> tuple[NamedHeader, dict[str, str], int]: ...


def read_safetensors_header(
    path: str | os.PathLike, names: bool = False
) -> tuple[Header | NamedHeader, dict[str, str], int]:
    """Validate the header of `path`; return ({key: (dtype, shape, begin, end)}, metadata, data_start).

    begin/end are relative to data_start. Nothing sized by the file's claims is allocated
    before those claims are checked against the real file size.
    """
    path = Path(path)

    def fail(why: str) -> NoReturn:
        raise AdapterFileError(f"{path}: {why}")

    raw, file_size = _header_bytes(fail, path)
    parsed = _header_json(fail, raw)
    n = len(raw)

    metadata = parsed.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        fail("__metadata__ must be an object mapping strings to strings")

    data_start = 8 + n
    data_size = file_size - data_start
    header: NamedHeader = {key: _parse_entry(fail, key, entry) for key, entry in parsed.items()}

    beyond = [(k, e[3]) for k, e in header.items() if e[3] > data_size]
    if beyond:
        key, end = max(beyond, key=lambda item: item[1])
        fail(
            f"tensor {key!r} data ends at byte {data_start + end} but the file has {file_size} bytes "
            f"({len(beyond)} of {len(header)} tensors lie past the end): file truncated?"
        )

    _check_coverage(fail, header, data_size)
    if not names:  # torch dtypes for callers that compute; names=True keeps torch unimported (inspect)
        typed: Header = {key: (torch_dtype(e[0]), *e[1:]) for key, e in header.items()}
        return typed, dict(metadata), data_start
    return header, dict(metadata), data_start


def _check_coverage(fail: Callable[[str], NoReturn], header: NamedHeader, data_size: int) -> None:
    """The tensors' byte ranges tile the data section exactly, as the safetensors reader requires: no gap, no
    overlap, no trailing byte. (A header length one byte off shows up here as a gap or a trailing byte.)"""
    prev_key, prev_end = None, 0
    for key, (_, _, begin, end) in sorted(header.items(), key=lambda item: item[1][2:]):
        if begin < prev_end:
            fail(f"tensor {key!r} data [{begin}, {end}] overlaps tensor {prev_key!r} ending at {prev_end}")
        if begin > prev_end:
            after = f"after tensor {prev_key!r}" if prev_key is not None else "at the start of the data"
            fail(
                f"{begin - prev_end} bytes {after} belong to no tensor (tensor {key!r} starts at {begin}): "
                "wrong header length or offsets?"
            )
        prev_key, prev_end = key, end
    if prev_end != data_size:
        fail(
            f"{data_size - prev_end} trailing bytes after the last tensor (data section {data_size} bytes, "
            f"tensors cover {prev_end}): wrong header length or offsets?"
        )


_FLOATS = ("F64", "F32", "F16", "BF16")  # what finite_keys proves in bulk (float8 has no aminmax here)


def _read_all(f, need: int) -> mmap.mmap | None:
    """The whole file (at least `need` bytes) read into anonymous memory of its own, its pages made in one
    call (MAP_POPULATE) rather than faulted one by one; None when shorter.

    Not a numpy array: numpy asks for transparent huge pages on arrays of 4 MiB and more, and filling a fresh
    12 MB one took 45-116 ms against 5-10 ms here on our CI VM, by the host's state
    (benchmarks/bench_thp.py)."""
    size = os.fstat(f.fileno()).st_size
    if size < need:
        return None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    buf = mmap.mmap(-1, max(size, 1), flags=flags)
    view, got = memoryview(buf), 0
    try:
        while got < size:
            n = f.readinto(view[got:size])
            if not n:
                return None
            got += n
    finally:
        view.release()
    return buf


# numpy has no bfloat16: BF16 is checked by its exponent bits.
_NUMPY_FLOATS = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}
_CHUNK = 1 << 16  # elements per step of the finite check (its scratch stays in cache, no fresh pages)


def _all_finite(buf, name: str, offset: int, count: int) -> bool:
    """Whether `count` values of dtype `name` at byte `offset` of `buf` are all finite, on this thread only
    (numpy; a torch reduction would wait for its other threads, a time slice each on a loaded machine)."""
    import numpy as np

    if name in _NUMPY_FLOATS:
        values = np.frombuffer(buf, dtype=_NUMPY_FLOATS[name], count=count, offset=offset)
        scratch = np.empty(min(count, _CHUNK), dtype=bool)
        chunks = (values[i : i + _CHUNK] for i in range(0, count, _CHUNK))
        return all(bool(np.isfinite(c, out=scratch[: len(c)]).all()) for c in chunks)
    # BF16: NaN or ±Inf exactly when the exponent bits are all ones
    values = np.frombuffer(buf, dtype="<u2", count=count, offset=offset)
    scratch = np.empty(min(count, _CHUNK), dtype=np.uint16)
    chunks = (values[i : i + _CHUNK] for i in range(0, count, _CHUNK))
    return not any(bool((np.bitwise_and(c, 0x7F80, out=scratch[: len(c)]) == 0x7F80).any()) for c in chunks)


def _runs(header: NamedHeader) -> list[tuple[list[str], str, int, int]]:
    """([keys], dtype name, begin, end) of each maximal run of non-empty floating-point tensors of one dtype
    lying back to back in the data section, its start aligned for the dtype (no other tensor inside a run)."""
    runs: list[tuple[list[str], str, int, int]] = []
    for key, (name, _, begin, end) in sorted(header.items(), key=lambda item: item[1][2:]):
        if name not in _FLOATS or begin == end:
            continue
        last = runs[-1] if runs else None
        if last is not None and last[1] == name and last[3] == begin:
            last[0].append(key)
            runs[-1] = (last[0], name, last[2], end)
        else:
            runs.append(([key], name, begin, end))
    return runs


class SafetensorsFile:
    """A validated .safetensors file; tensors are mapped from disk only when `.get` asks for them.

    `read=True` reads the whole file into memory of its own instead (one read, no mapping): the tensors `.get`
    returns are then views of memory no later write to the file can reach (a LoRA saved again under the same
    name while its factors are in use), so a holder may keep them as they are (`owned`)."""

    def __init__(self, path: str | os.PathLike, read: bool = False) -> None:
        self._path = Path(path)
        self._header, self._metadata, self._data_start = read_safetensors_header(self._path, names=True)
        self._mmap = None  # a mapping of the file, or anonymous memory holding it whole (`read`)
        self._owned = read
        self._lent = False
        self._finite: frozenset[str] | None = None
        need = self._data_start + max((e[3] for e in self._header.values()), default=0)
        with open(self._path, "rb") as f:
            if read:
                self._mmap = _read_all(f, need)
            else:
                # ACCESS_COPY maps privately: the file is never written, and an in-place edit of a
                # returned tensor lands in a private page instead of segfaulting on a PROT_READ page.
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if self._mmap is None or len(self._mmap) < need:
            self.close()
            raise AdapterFileError(f"{self._path}: file shrank while it was being opened")

    @property
    def owned(self) -> bool:
        """Whether the tensors live in memory of this object's own (`read=True`), not in a mapping of the
        file."""
        return self._mmap is not None and self._owned

    def finite_keys(self) -> frozenset[str] | None:
        """The floating-point tensors (F64/F32/F16/BF16) proven finite, each run of tensors of one dtype that
        lie back to back checked in one pass (a file of one dtype: one pass), as read (an in-place edit of a
        returned tensor is not seen). None for a mapped file (a pass there would read tensors no caller asked
        for); a tensor left out is checked on its own by its reader."""
        if not self.owned:
            return None
        if self._finite is None:
            self._finite = frozenset(
                k for run in _runs(self._header) if self._run_finite(run) for k in run[0]
            )
        return self._finite

    def _run_finite(self, run: tuple[list[str], str, int, int]) -> bool:
        _, name, begin, end = run
        start, size = self._data_start + begin, _DTYPES[name][1]
        if start % size:
            return False  # unaligned: `get` copies each of these, and its reader checks it
        return _all_finite(self._mmap, name, start, (end - begin) // size)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def keys(self) -> list[str]:
        return list(self._header)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key)[1]

    def dtype(self, key: str) -> torch.dtype | str:
        return torch_dtype(self._entry(key)[0])

    def dtype_name(self, key: str) -> str:
        """The dtype as torch names it ("float32", ...; a packed dtype: its safetensors name), without
        torch."""
        name = self._entry(key)[0]
        return _DTYPES[name][0] if name in _DTYPES else name

    def scalar(self, key: str) -> float | None:
        """The value of a one-element tensor (an alpha) read from its bytes without torch; None otherwise."""
        name, shape, begin, end = self._entry(key)
        if math.prod(shape) != 1 or self._mmap is None or (name not in _SCALAR_FORMATS and name != "BF16"):
            return None
        raw = bytes(self._mmap[self._data_start + begin : self._data_start + end])
        if name == "BF16":
            return struct.unpack("<f", b"\x00\x00" + raw)[0]
        return float(struct.unpack(_SCALAR_FORMATS[name], raw)[0])

    def __contains__(self, key: object) -> bool:
        return key in self._header

    def __len__(self) -> int:
        return len(self._header)

    def __iter__(self):
        return iter(self._header)

    def get(self, key: str) -> torch.Tensor:
        """The tensor stored under `key`.

        Zero-copy when the data is aligned for its dtype: the tensor then views a private
        copy-on-write mapping, so in-place edits never reach the file but are seen by a later
        `.get(key)` on this same object. `.clone()` before mutating if that matters.
        """
        import torch

        name, shape, begin, end = self._entry(key)
        dtype = torch_dtype(name)
        if self._mmap is None:
            raise ValueError(f"{self._path}: file is closed")
        if isinstance(dtype, str):
            raise AdapterFileError(
                f"{self._path}: tensor {key!r} is {dtype}, a packed sub-byte dtype loraweave "
                "cannot compute with"
            )
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        start = self._data_start + begin
        if start % dtype.itemsize == 0:
            flat = torch.frombuffer(self._mmap, dtype=dtype, count=math.prod(shape), offset=start)
            self._lent = True
        else:
            # Unaligned typed access is not safe for every kernel; copy into aligned memory.
            flat = torch.frombuffer(bytearray(self._mmap[start : self._data_start + end]), dtype=dtype)
        if dtype == torch.bool and bool((flat.view(torch.uint8) > 1).any()):
            raise AdapterFileError(f"{self._path}: tensor {key!r} is BOOL but holds bytes other than 0/1")
        return flat.reshape(shape)

    def close(self) -> None:
        """Release the mapping; tensors already returned stay valid."""
        mm, self._mmap = self._mmap, None
        if self._owned:
            return  # read whole: tensors already returned hold the memory
        # torch.frombuffer keeps a reference to the mmap but no buffer export, so mm.close()
        # would succeed and leave live tensors dangling. Once a zero-copy tensor exists we only
        # drop our reference and let refcounting unmap after the last tensor dies (no __del__).
        if mm is not None and not self._lent:
            mm.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self._path)!r}, {len(self)} tensors)"

    def _entry(self, key: str) -> tuple[str, tuple[int, ...], int, int]:
        try:
            return self._header[key]
        except KeyError:
            raise KeyError(f"{key!r} is not a tensor in {self._path}") from None
