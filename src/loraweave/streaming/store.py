"""One unit's tensors (a block, or the rest of the model): host storage, device residency, slot views, restore."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mechanisms.runtime import RuntimePath
from . import factors
from .planner import aligned, module_tensors, tensor_bytes


@dataclass(eq=False)
class Entry:
    owner: torch.nn.Module
    kind: str  # "param" | "buffer"
    name: str
    orig: torch.Tensor | None  # the tensor the model held before streaming, kept when it costs no device memory
    orig_device: torch.device
    host: torch.Tensor  # the values on the storage device (pinned when the compute device is CUDA)
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


class Unit:
    """A block (or the rest): its tensors, where they live now ("host" | "device" | "slot" | "orig" after close),
    its slot layout, and the runtime adapter factors that travel with it."""

    def __init__(self, name: str, module: torch.nn.Module, seen: set[int], storage: torch.device, pin: bool,
                 skip: frozenset[int] = frozenset()) -> None:
        self.name, self.module = name, module
        self.entries: list[Entry] = []
        offset = 0
        for owner, kind, tname in module_tensors(module, seen, skip):
            t = (owner._parameters if kind == "param" else owner._buffers)[tname]
            data = t.data
            on_storage = data.device == storage
            host = data if on_storage else data.to(storage)
            plain = _plain(t)
            if pin and plain and host.device.type == "cpu" and not host.is_pinned():
                # The pinned copy replaces the original (no second host copy); close() restores pageable memory.
                # Tensor subclasses are not pinned (pin_memory is not defined for most): they copy synchronously.
                host = host.pin_memory()
                on_storage = False
            self.entries.append(Entry(owner, kind, tname, data if on_storage else None, data.device, host,
                                      offset if plain else -1, plain, t))
            if plain:
                offset += aligned(tensor_bytes(data))
        self.weight_layout_bytes = offset
        self.side_bytes = sum(tensor_bytes(e.host) for e in self.entries if not e.plain)
        self.storage, self.pin = storage, pin
        self.factors: list[tuple[RuntimePath, torch.dtype, torch.Tensor, int, torch.Tensor, int]] = []
        self.factor_version = 0  # bumped whenever the set of travelling adapter factors changes
        self.set_factors([])
        self._device: list[torch.Tensor] | None = None
        for e in self.entries:
            e.point(e.host)
        self.place = "host"

    def set_factors(self, paths: list[RuntimePath]) -> None:
        """Runtime adapter paths on this block's layers: their factors join the slot layout (host copies already
        in the compute dtype, pinned on CUDA, so a copy is a plain transfer)."""
        offset = self.weight_layout_bytes
        for path, *_ in self.factors:
            factors.unbind(path)  # a path leaving (adapter removed) must not keep a slot view
        self.factors = []
        for path in paths:
            factors.unbind(path)  # a cast made before (e.g. warmed on the device at apply) is not ours to keep
            dtype = factors.travel_dtype(path)
            down, up = (t.detach().to(self.storage, dtype).contiguous() for t in (path.down, path.up))
            if self.pin:
                down, up = down.pin_memory(), up.pin_memory()
            self.factors.append((path, dtype, down, offset, up, offset + aligned(tensor_bytes(down))))
            offset += aligned(tensor_bytes(down)) + aligned(tensor_bytes(up))
        self.slot_layout_bytes = offset
        self.nbytes = offset + aligned(self.side_bytes)  # what it takes on the device, as a slot or resident
        self.factor_version += 1

    # -- residency -------------------------------------------------------------------------------------------
    def to_device(self, device: torch.device) -> None:
        """Resident: a device copy of every tensor (the host tensor itself when storage is the device)."""
        self._device = [e.host if e.host.device == device else e.host.to(device) for e in self.entries]
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
            views.append(buf[e.offset : e.offset + tensor_bytes(e.host)].view(e.host.dtype).view(e.host.shape)
                         if e.plain else None)
        for _, _, down, d_off, up, u_off in self.factors:
            for t, off in ((down, d_off), (up, u_off)):
                views.append(buf[off : off + tensor_bytes(t)].view(t.dtype).view(t.shape))
        return views

    def host_sources(self) -> list[torch.Tensor | None]:
        """The host tensor behind each of `slot_views`' entries (None where the view is None)."""
        out: list[torch.Tensor | None] = [e.host if e.plain else None for e in self.entries]
        for _, _, down, _, up, _ in self.factors:
            out += [down, up]
        return out

    def copy_to(self, views: list[torch.Tensor | None]) -> None:
        """Copy host values into `views` on the current stream (asynchronous from pinned memory)."""
        for v, src in zip(views, self.host_sources(), strict=True):
            if v is not None:
                v.copy_(src, non_blocking=True)

    def point_to(self, views: list[torch.Tensor | None], device: torch.device) -> int:
        """Compute from the slot's views; returns the bytes of tensor subclasses copied here, on the compute
        stream (a copy made on the side stream would be freed into that stream's pool while compute reads it)."""
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
        """Changes whenever a tensor is written in place through its Parameter/buffer, or its storage replaced."""
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
        """Back to what the model held before streaming: same objects, devices, values."""
        for e in self.entries:
            if e.orig is not None:
                e.point(e.orig)
            elif e.orig_device.type == "cpu" and e.host.device.type == "cpu":  # pinned by us: back to pageable
                e.point(torch.empty(e.host.shape, dtype=e.host.dtype).copy_(e.host))
            else:
                e.point(e.host.to(e.orig_device))
        self._device = None
        self.place = "orig"

    def weight_modules(self) -> list[torch.nn.Module]:
        return [m for m in self.module.modules() if isinstance(m._parameters.get("weight"), torch.Tensor)]
