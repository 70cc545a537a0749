"""The fused merge kernels of fused_record.c, built with the machine's C compiler at first use and loaded by
ctypes.

One pass per block writes W' and finds the compact record's misses; the torch/numpy path (inplace.py) needs
six (copy, add, subtract, compare, scan, gather). The shared object is cached per source, compiler and CPU (it
is built for the CPU it runs on) under $LORAWEAVE_CACHE/native or ~/.cache/loraweave/native. Where no compiler
works, or LORAWEAVE_NATIVE=0, `kernel_for` returns None and the torch/numpy path runs: the same bits,
slower."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("loraweave")
SOURCE = Path(__file__).with_name("fused_record.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
NATIVE_ENV = "LORAWEAVE_NATIVE"  # "0": never build or load the kernels
NATIVE_BLOCKS = 4  # blocks of 4x undo.CHUNK_ELEMENTS (ΔW fp32: 4 MiB, in the last-level cache): -12% time
_P = ctypes.c_void_p
_ARGS = [_P, _P, ctypes.c_int64, ctypes.c_int64, _P, _P, _P, _P, _P, _P]
_NAMES = {torch.float32: "lw_merge_f32", torch.bfloat16: "lw_merge_bf16", torch.float16: "lw_merge_f16"}


@dataclass(frozen=True)
class Kernel:
    """One dtype's kernel: kernel(w, d, n, base, pos, vals, guard, guard_w, guard_m, state) -> misses."""

    dtype: torch.dtype
    fn: Callable[..., int]  # a ctypes function of the compiled library


def _cache_dir() -> Path:
    value = os.environ.get("LORAWEAVE_CACHE")
    if value and value != "0":
        return Path(value) / "native"
    return Path.home() / ".cache" / "loraweave" / "native"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return "".join(line for line in fh if line.startswith(("model name", "flags")))[:8192]
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str, flags: tuple[str, ...], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *flags, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True, timeout=120
        )
        os.replace(tmp, out)  # atomic: a process building beside this one sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(NATIVE_ENV) == "0":
        return None
    return load(FLAGS)


def load(flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernels built with `flags` (cached on disk), or None (logged) where no compiler builds them."""
    cc = _compiler()
    if cc is None:
        log.info("native_merge=off reason=no_c_compiler")
        return None
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags).encode(), cc.encode(), _cpu_signature().encode()):
        key.update(part)
    name = f"fused_record-{platform.machine()}-{key.hexdigest()[:16]}.so"
    path = _cache_dir() / name
    try:
        if not path.exists():
            try:
                _build(cc, flags, path)
            except OSError:  # no writable cache folder (a read-only home): this user's folder in the temp dir
                user = os.getuid() if hasattr(os, "getuid") else os.getlogin()  # no getuid on Windows
                path = Path(tempfile.gettempdir()) / f"loraweave-native-{user}" / name
                if not path.exists():
                    _build(cc, flags, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("native_merge=off reason=build_failed compiler=%s detail=%r", cc, detail[-300:])
        return None


def bind(lib: ctypes.CDLL, dtype: torch.dtype) -> Kernel | None:
    """One dtype's kernel from a loaded library (fp16 only where the compiler has _Float16)."""
    name = _NAMES.get(dtype)
    if name is None or (dtype == torch.float16 and not lib.lw_has_f16()):
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = _ARGS, ctypes.c_int64
    return Kernel(dtype, fn)


_COMBINE = {torch.bfloat16: "lw_combine_bf16", torch.float16: "lw_combine_f16"}
Combine = Callable[[int, int, int, int, int], None]  # (w, d, dst, n, sign): dst = round(w + sign·d)


@functools.cache
def combine_for(dtype: torch.dtype) -> Combine | None:
    """dst = round(w + sign·ΔW) in one pass for a 16-bit weight dtype (fp16 only where the compiler has
    _Float16), or None: torch's three passes then (undo.combine_into), the same bits."""
    lib = _library()
    name = _COMBINE.get(dtype)
    if lib is None or name is None or (dtype == torch.float16 and not lib.lw_has_f16()):
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = [_P, _P, _P, ctypes.c_int64, ctypes.c_int32], None
    one_pass: Combine = fn
    return one_pass


_DECODE = {(torch.uint8, 255): "lw_decode_gaps8", (torch.uint16, 65535): "lw_decode_gaps16"}
Decode = Callable[[int, int, int], int]  # (entries, n, out int64[n]) -> positions written


@functools.cache
def decoder_for(dtype: torch.dtype, most: int) -> Decode | None:
    """A record's gap entries of `dtype` (fillers worth `most`) decoded to positions in one pass, or None."""
    lib = _library()
    name = _DECODE.get((dtype, most))
    if lib is None or name is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = [_P, ctypes.c_int64, _P], ctypes.c_int64
    decode: Decode = fn
    return decode


@functools.cache
def kernel_for(dtype: torch.dtype) -> Kernel | None:
    """The fused kernel for a weight dtype (fp32, bf16, fp16 where the compiler has _Float16), or None."""
    lib = _library()
    return None if lib is None else bind(lib, dtype)
