"""Atomic .safetensors writing: a temp file (or folder) next to the target, fsync, then rename; never over an
input.

`StreamingWriter` writes tensors one at a time after a header computed up front, so a checkpoint can be
written while only one tensor is in memory. A failure at any point leaves no file at the target and no temp
behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ..errors import WriteError
from .output import check_output

log = logging.getLogger("loraweave")

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _attr, _name in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if hasattr(torch, _attr):
        DTYPE_NAMES[getattr(torch, _attr)] = _name
COPY_CHUNK = 64 * 1024 * 1024  # bytes per read/write when copying raw tensor data between files


def _umask() -> int:
    mask = os.umask(0o022)  # the only portable read of the umask is to set it and put it back
    os.umask(mask)
    return mask


def _honour_umask(path: Path, folder: bool) -> None:
    """mkstemp/mkdtemp create 0600/0700; an output gets what open()/mkdir() would give it under the umask."""
    os.chmod(path, (0o777 if folder else 0o666) & ~_umask())


def honour_umask_under(folder: Path) -> None:
    """Every file under `folder` gets the mode open() gives under the umask (safetensors writes 0600)."""
    mode = 0o666 & ~_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(
        OSError
    ):  # some filesystems cannot fsync a directory; the rename is still atomic
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _in_the_way(target: Path, rel: Path) -> Path | None:
    """What stops a file landing at target/rel: a file where one of its folders goes, or a folder at its
    name."""
    dest = target / rel
    for folder in reversed(dest.parents[: len(rel.parts) - 1]):  # target's subfolders on the way down
        if folder.exists() and not folder.is_dir():
            return folder
    return dest if dest.is_dir() else None


def _own_names(tmp: Path, target: Path) -> list[Path]:
    """The files written under `tmp`, relative to it; a WriteError (nothing moved yet) when one cannot
    land."""
    names = sorted(p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file())
    for rel in names:
        blocker = _in_the_way(target, rel)
        if blocker is not None:
            raise WriteError(f"output {target}: {blocker} is in the way of {rel} (nothing was replaced)")
    return names


def _move_into(tmp: Path, target: Path) -> None:
    """Rename each file written under `tmp` over its own name in `target` (each rename atomic); any other file
    of `target` stays."""
    for rel in _own_names(tmp, target):
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / rel, target / rel)
        _fsync_dir((target / rel).parent)
    shutil.rmtree(tmp)


def _temp_beside(target: Path, folder: bool, where: Path) -> Path:
    if folder:
        return Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=where))
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=where)
    os.close(fd)
    return Path(name)


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, folder: bool = False) -> Iterator[Path]:
    """Yield a temp path beside the target; on success it replaces the target, on failure it is removed.

    A folder output that already exists is never removed: the temp folder is made inside it and each file the
    command wrote is renamed over its own name there, so the folder's other files survive (`--force` replaces
    only what the command writes). The target's folder must exist; outputs get the permissions of the
    umask."""
    target = Path(target)
    if not target.parent.is_dir():
        raise WriteError(f"output {target}: its folder does not exist (create it first)")
    merge = folder and target.is_dir()
    try:
        tmp = _temp_beside(target, folder, target if merge else target.parent)
    except OSError as exc:  # name the output the user gave, not the temp name they never saw
        raise type(exc)(exc.errno, exc.strerror, str(target)) from None
    _honour_umask(tmp, folder)
    try:
        yield tmp
        if merge:
            _move_into(tmp, target)
        elif target.is_dir():  # os.replace would say '[Errno 21]' and name the temp file
            raise WriteError(f"output {target} is a folder; this command writes a file there (name a file)")
        else:
            os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def build_header(
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None
) -> bytes:
    """Header bytes (length prefix included) for tensors written back to back in `entries` order."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in DTYPE_NAMES:
            raise WriteError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
        size = dtype.itemsize
        for d in shape:
            size *= d
        header[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, so readers can view it in place
    return len(raw).to_bytes(8, "little") + raw


class StreamingWriter:
    """Write tensors in header order, one at a time; `close()` fsyncs. Use inside `atomic_path`."""

    def __init__(
        self,
        path: Path,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.entries = entries
        self._next = 0
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close(), which callers reach through `with`
        self._file.write(build_header(entries, metadata))
        self.bytes_written = 0

    def _expect(self, name: str) -> tuple[str, torch.dtype, tuple[int, ...]]:
        if self._next >= len(self.entries) or self.entries[self._next][0] != name:
            want = self.entries[self._next][0] if self._next < len(self.entries) else "nothing"
            raise WriteError(f"tensor {name!r} written out of order (expected {want})")
        self._next += 1
        return self.entries[self._next - 1]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        _, dtype, shape = self._expect(name)
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise WriteError(
                f"tensor {name!r}: got {tensor.dtype} {tuple(tensor.shape)}, header says {dtype} {shape}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(data.numpy().data)
        self.bytes_written += data.numel()

    def copy_raw(self, name: str, src_fd: int, offset: int, length: int) -> None:
        """Copy a tensor's bytes unchanged from another file (kernel-side where the OS allows)."""
        self._expect(name)
        self._file.flush()
        out_fd = self._file.fileno()
        done = 0
        while done < length:
            n = 0
            if hasattr(os, "copy_file_range"):
                try:
                    n = os.copy_file_range(src_fd, out_fd, min(COPY_CHUNK, length - done), offset + done)
                except OSError:
                    n = 0
            if n <= 0:  # no kernel copy here (or across these filesystems): read and write a chunk
                chunk = os.pread(src_fd, min(COPY_CHUNK, length - done), offset + done)
                if not chunk:
                    raise WriteError(f"tensor {name!r}: source ended early")
                os.write(out_fd, chunk)
                n = len(chunk)
            done += n
        self._file.seek(0, os.SEEK_END)
        self.bytes_written += length

    def close(self) -> None:
        if self._next != len(self.entries):
            raise WriteError(f"only {self._next} of {len(self.entries)} tensors were written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        self._file.close()


def data_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the bytes `save_file` writes after the header: the AddNet hash A1111 and kohya
    (`sshs_model_hash`) give the file, known before the header that may carry it is written."""
    digest = hashlib.sha256()
    for tensor in tensors.values():
        digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def save_file(
    tensors: dict[str, torch.Tensor],
    target: str | os.PathLike,
    metadata: dict[str, str] | None = None,
    inputs: Sequence[str | os.PathLike] = (),
    overwrite: bool = True,
) -> Path:
    """Write a small state dict atomically (adapters: convert, extract, resize)."""
    out = check_output(target, list(inputs), overwrite=overwrite)
    entries = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    with atomic_path(out) as tmp:
        writer = StreamingWriter(tmp, entries, metadata)
        try:
            for name, tensor in tensors.items():
                writer.write(name, tensor)
            writer.close()
        except BaseException:
            writer.abort()
            raise
    log.info("save_file path=%s tensors=%d", out, len(tensors))
    return out
