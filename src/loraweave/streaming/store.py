"""One unit's tensors (a block, or the rest of the model): host storage, device residency, slot views,
restore."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mechanisms.runtime.path import RuntimePath
from . import factors, hostmem
from .planner import aligned, module_tensors, tensor_bytes, typed_view


@dataclass(eq=False)
class Entry:
    owner: torch.nn.Module
    kind: str  # "param" | "buffer"
    name: str
    orig: (
        torch.Tensor | None
    )  # the tensor the model held before streaming, kept when it costs no device memory
    orig_device: torch.device
    host: torch.Tensor | None  # the values on the storage device (packed, pinned for CUDA); None after close
    offset: int  # byte offset in a slot (plain tensors only)
    plain: bool  # a dense torch.Tensor: it can live as a view of a slot's flat buffer
    obj: torch.Tensor | None = None  # the Parameter / buffer object streaming took over

    @property
    def tensor(self) -> torch.Tensor:
        """The Parameter / buffer object streaming took over (never replaced by us: only its .data is swapped;
        one the user put in its place is left alone)."""
        return self.obj

    def point(self, data: torch.Tensor) -> None:
        self.tensor.data = data


def _plain(t: torch.Tensor) -> bool:
    return type(t.data) is torch.Tensor and t.layout == torch.strided and not t.is_quantized


def _entries(module: torch.nn.Module, seen: set[int], skip: frozenset[int]) -> tuple[list[Entry], int]:
    """(an Entry per tensor of `module` not yet seen, bytes of the slot layout of the plain ones)."""
    entries: list[Entry] = []
    offset = 0
    for owner, kind, tname in module_tensors(module, seen, skip):
        t = (owner._parameters if kind == "param" else owner._buffers)[tname]
        data, plain = t.data, _plain(t)
        entries.append(Entry(owner, kind, tname, None, data.device, data, offset if plain else -1, plain, t))
        if plain:
            offset += aligned(tensor_bytes(data))
    return entries, offset


class Unit:
    """A block (or the rest): its tensors, where they live now ("host" | "device" | "slot" | "orig" after
    close), its slot layout, and the runtime adapter factors that travel with it.

    Host copies: a model already on the storage device, unpinned, is used in place (no copy). Otherwise
    (pinned for CUDA, or held elsewhere) the plain tensors are packed at their slot offsets into a few runs
    (hostmem)."""

    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        seen: set[int],
        storage: torch.device,
        pin: bool,
        skip: frozenset[int] = frozenset(),
    ) -> None:
        self.name, self.module = name, module
        self.storage, self.pin = storage, pin
        self.entries, self.weight_layout_bytes = _entries(module, seen, skip)
        self.runs: list[hostmem.Run] = self._host_copies()
        self.side_bytes = sum(aligned(tensor_bytes(e.host)) for e in self.entries if not e.plain)
        self.factors: list[tuple[RuntimePath, torch.dtype, torch.Tensor, int, torch.Tensor, int]] = []
        self.factor_runs: list[hostmem.Run] = []
        self.factor_version = 0  # bumped whenever the set of travelling adapter factors changes
        self.set_factors([])
        self._device: list[torch.Tensor] | None = None
        for e in self.entries:
            e.point(e.host)
        self.place = "host"

    def _host_copies(self) -> list[hostmem.Run]:
        """Point each entry's `host` at its copy on the storage device; the packed runs, if the plain tensors
        were packed (pinned, or held elsewhere)."""
        plain = [e for e in self.entries if e.plain]
        runs: list[hostmem.Run] = []
        packed = self.pin or any(e.host.device != self.storage for e in plain)
        if packed:
            # Packed copies replace the originals (no second host copy); close() restores unpinned tensors.
            runs, views = hostmem.pack([(e.offset, e.host) for e in plain], self.storage, self.pin)
            for e, v in zip(plain, views, strict=True):
                e.host = v
        for e in self.entries:
            if e.plain and packed:
                continue
            if e.host.device == self.storage:
                e.orig = e.host  # used in place: restored as the same tensor
            else:
                e.host = e.host.to(self.storage)  # tensor subclasses are copied as they are (never pinned)
        return runs

    def set_factors(self, paths: list[RuntimePath]) -> None:
        """Runtime adapter paths on this block's layers: their factors join the slot layout (host copies
        already in the compute dtype, packed and pinned like the weights, so a copy is a plain transfer)."""
        offset = self.weight_layout_bytes
        for path, *_ in self.factors:
            factors.unbind(path)  # a path leaving (adapter removed) must not keep a slot view
        layout, casts = [], []
        for path in paths:
            factors.unbind(
                path
            )  # a cast made before (e.g. warmed on the device at apply) is not ours to keep
            dtype = factors.travel_dtype(path)
            down, up = (t.detach().to(dtype) for t in (path.down, path.up))
            layout.append((path, dtype, offset, offset + aligned(tensor_bytes(down))))
            casts += [(offset, down), (offset + aligned(tensor_bytes(down)), up)]
            offset += aligned(tensor_bytes(down)) + aligned(tensor_bytes(up))
        self.factor_runs, views = hostmem.pack(casts, self.storage, self.pin) if casts else ([], [])
        self.factors = [
            (path, dtype, views[2 * k], d_off, views[2 * k + 1], u_off)
            for k, (path, dtype, d_off, u_off) in enumerate(layout)
        ]
        self.slot_layout_bytes = offset
        self.nbytes = offset + self.side_bytes  # what it takes on the device, as a slot or resident
        self.factor_version += 1

    # -- copies ----------------------------------------------------------------------------------------------
    def copy_pairs(
        self, buf: torch.Tensor, with_factors: bool = True
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination in `buf`, host source) per transfer filling `buf` with this unit's slot layout (its
        weights, then its travelling factors): one per packed run, else one per tensor."""
        if self.runs:
            pairs = [(buf[r.start : r.end], r.host) for r in self.runs]
        else:
            pairs = [(typed_view(buf, e.offset, e.host), e.host) for e in self.entries if e.plain]
        return pairs + ([(buf[r.start : r.end], r.host) for r in self.factor_runs] if with_factors else [])

    # -- residency -------------------------------------------------------------------------------------------
    def to_device(self, device: torch.device) -> None:
        """Resident: the host tensors themselves when storage is the device, else one device buffer (its
        weights copied run by run) with every plain tensor a view of it; tensor subclasses get their own
        copy."""
        if self.storage == device:
            self._device = [e.host for e in self.entries]
        else:
            buf = torch.empty(max(self.weight_layout_bytes, 1), dtype=torch.uint8, device=device)
            for dst, src in self.copy_pairs(buf, with_factors=False):  # resident paths cast their own
                dst.copy_(src, non_blocking=True)
            views = self.slot_views(buf)
            self._device = [
                v if e.plain else e.host.to(device)
                for e, v in zip(self.entries, views[: len(self.entries)], strict=True)
            ]
        for e, d in zip(self.entries, self._device, strict=True):
            e.point(d)
        self.place = "device"

    def to_host(self) -> None:
        for e in self.entries:
            e.point(e.host)
        for path, *_ in self.factors:
            factors.unbind(path)  # a slot view or a resident cast: neither outlives the block's residency
        self._device = None
        self.place = "host"

    # -- slots -----------------------------------------------------------------------------------------------
    def slot_views(self, buf: torch.Tensor) -> list[torch.Tensor | None]:
        """Views of `buf` for every plain entry and travelling factor (entry order, then down/up per factor);
        None for tensor subclasses, which get their own device copy when the block is pointed at the slot."""
        views: list[torch.Tensor | None] = []
        for e in self.entries:
            views.append(typed_view(buf, e.offset, e.host) if e.plain else None)
        for _, _, down, d_off, up, u_off in self.factors:
            for t, off in ((down, d_off), (up, u_off)):
                views.append(typed_view(buf, off, t))
        return views

    def point_to(self, views: list[torch.Tensor | None], device: torch.device) -> int:
        """Compute from the slot's views; returns the bytes of tensor subclasses copied here, on the compute
        stream (a copy made on the side stream would be freed into that stream's pool while compute reads
        it)."""
        n, side = len(self.entries), 0
        for e, v in zip(self.entries, views[:n], strict=True):
            if v is None:
                v = e.host.to(device)
                side += tensor_bytes(e.host) if v is not e.host else 0
            e.point(v)
        for k, (path, dtype, *_) in enumerate(self.factors):
            factors.bind(path, device, dtype, views[n + 2 * k], views[n + 2 * k + 1])
        self.place = "slot"
        return side

    def version(self) -> tuple:
        """Changes whenever a tensor is written in place through its Parameter/buffer, or its storage
        replaced."""
        return (self.factor_version, *((e.tensor._version, e.host.data_ptr()) for e in self.entries))

    def changed(self) -> str | None:
        """A tensor replaced behind the streamer's back (a new Parameter, `.data =`, `module.to()`), or None.

        Streaming would otherwise copy the old host values over the new ones: refuse instead."""
        expected = self._device if self.place == "device" else [e.host for e in self.entries]
        for e, want in zip(self.entries, expected, strict=True):
            table = e.owner._parameters if e.kind == "param" else e.owner._buffers
            now = table.get(e.name)
            if now is not e.obj or now.data_ptr() != want.data_ptr() or now.device != want.device:
                return f"{self.name}: {type(e.owner).__name__}.{e.name}"
        return None

    def restore(self) -> None:
        """Back to what the model held before streaming: same objects, devices, values. Host copies are
        dropped (pinned memory goes back to torch's host cache: the handle empties it)."""
        for e in self.entries:
            if e.orig is not None:
                e.point(e.orig)
            elif (
                e.host.device == e.orig_device
            ):  # a packed (pinned) copy on the original device: an unpinned one
                e.point(torch.empty(e.host.shape, dtype=e.host.dtype, device=e.orig_device).copy_(e.host))
            else:
                e.point(e.host.to(e.orig_device))
            e.host = e.orig = None
        self.runs = []  # the factors' host copies go with set_factors([]), which also unbinds their paths
        self._device = None
        self.place = "orig"

    def weight_modules(self) -> list[torch.nn.Module]:
        return [m for m in self.module.modules() if isinstance(m._parameters.get("weight"), torch.Tensor)]
