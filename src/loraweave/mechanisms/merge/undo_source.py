"""undo="source": a merged weight comes back by re-reading its tensor from the safetensors file it was loaded
from.

Where the files are: a path the caller gives (a file, a directory, or {component: path}), else what the model
recorded at load: diffusers `from_pretrained` keeps its argument in `config._name_or_path` (not the subfolder:
`<path>` and `<path>/<component>` are both searched; `from_single_file` keeps nothing). A tensor name is the
module's path + ".weight"; it is used only if the file's tensor, cast to the weight's dtype, equals the weight
bit for bit at merge time (a converted or fused weight has no 1:1 source and gets another record).

At merge time the record keeps the file's size, mtime and a hash of the tensor's bytes; undo refuses
(UndoError, naming the file) when any of them changed."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import AdapterFileError, UndoError
from ...io.safetensors_file import read_safetensors_header
from .undo import DeltaFn, bits

# file, dtype (a name where torch has none), shape, absolute begin, end
Location = tuple[str, torch.dtype | str, tuple[int, ...], int, int]
StrPath = str | os.PathLike[str]
# undo="source": the model's safetensors file, a directory of them, or one of those per component
UndoSource = StrPath | dict[str, StrPath]


def _digest(data: torch.Tensor) -> str:
    # numpy arrays have the buffer protocol; numpy's stubs do not declare it
    return hashlib.blake2b(data.numpy(), digest_size=16).hexdigest()  # type: ignore[arg-type]


def _read(path: str, begin: int, end: int) -> torch.Tensor:
    out = torch.empty(end - begin, dtype=torch.uint8)
    with open(path, "rb") as f:
        f.seek(begin)
        got = f.readinto(out.numpy())  # type: ignore[arg-type]  # as _digest: an ndarray is a buffer
    if got != end - begin:
        raise UndoError(
            f"{path}: read {got} of {end - begin} bytes of a tensor: file truncated since the merge"
        )
    return out


def _stat(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError as e:
        raise UndoError(
            f"{path}: the model's source file is gone ({e.strerror}); cannot undo the merge"
        ) from e
    return st.st_size, st.st_mtime_ns


@dataclass(eq=False)
class SourceRecord:
    path: str
    name: str
    dtype: torch.dtype  # the file's dtype
    shape: tuple[int, ...]
    begin: int
    end: int
    size: int
    mtime_ns: int
    digest: str
    kind: str = "source"
    nbytes: int = 0

    def check(self) -> None:
        """Refuse before anything is touched when the file's size or mtime changed since the merge."""
        if _stat(self.path) != (self.size, self.mtime_ns):
            raise UndoError(
                f"{self.path}: the model's source file changed since the merge (size/mtime differ); "
                f"cannot restore {self.name!r} from it"
            )

    def restore(self, weight: torch.Tensor, delta_fn: DeltaFn) -> None:
        self.check()
        data = _read(self.path, self.begin, self.end)
        if _digest(data) != self.digest:
            raise UndoError(
                f"{self.path}: the bytes of tensor {self.name!r} changed since the merge; cannot restore it"
            )
        weight.copy_(data.view(self.dtype).view(weight.shape))


class SourceFiles:
    """Tensor name -> candidate files for each component, from headers only (read once per file)."""

    def __init__(self, components: dict[str, torch.nn.Module], given: UndoSource | None = None) -> None:
        self._components = components
        self._given = given
        self._index: dict[str, dict[str, list[Location]]] = {}

    def _paths(self, comp: str) -> list[Path]:
        given = self._given.get(comp) if isinstance(self._given, dict) else self._given
        if given is not None:
            roots = [Path(given)]
        else:
            root = self._components[comp]
            config = getattr(root, "config", None)
            name = getattr(config, "_name_or_path", None) or getattr(root, "name_or_path", None)
            roots = (
                [Path(name), Path(name) / comp] if isinstance(name, (str, os.PathLike)) and str(name) else []
            )
        files: list[Path] = []
        for r in roots:
            if r.is_file():
                files.append(r)
            elif r.is_dir():
                files += sorted(r.glob("*.safetensors"))
        return files

    def _tensors(self, comp: str) -> dict[str, list[Location]]:
        if comp not in self._index:
            index: dict[str, list[Location]] = {}
            for path in self._paths(comp):
                try:
                    header, _, start = read_safetensors_header(path)
                except AdapterFileError:
                    continue  # not a weights file we can read: other candidates may be
                for key, (dtype, shape, begin, end) in header.items():
                    index.setdefault(key, []).append((str(path), dtype, shape, start + begin, start + end))
            self._index[comp] = index
        return self._index[comp]

    def found_any(self) -> bool:
        return any(self._tensors(c) for c in self._components)

    def record(self, comp: str, path: str, weight: torch.Tensor) -> SourceRecord | None:
        """A verified source record of `weight` (the weight before the merge), or None when no file holds
        it."""
        for file, dtype, shape, begin, end in self._tensors(comp).get(f"{path}.weight", []):
            if isinstance(dtype, str) or not dtype.is_floating_point:
                continue  # a packed sub-byte dtype (a name) or an integer one holds no 1:1 copy of a weight
            if torch.Size(shape).numel() != weight.numel():
                continue
            size, mtime = _stat(file)
            data = _read(file, begin, end)
            same = torch.equal(
                bits(data.view(dtype).to(weight.dtype)).view(-1), bits(weight.detach().cpu()).reshape(-1)
            )
            if same:
                return SourceRecord(
                    file, f"{path}.weight", dtype, tuple(shape), begin, end, size, mtime, _digest(data)
                )
        return None
