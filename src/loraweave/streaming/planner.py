"""Split a model into its repeated blocks and the rest, and choose which blocks stay resident under a
budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..errors import ArgumentError, BudgetTooSmall

log = logging.getLogger("loraweave")

ALIGN = 256  # slot offsets: a multiple of every element size, and of CUDA's copy-friendly alignment


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor really holds: a tensor subclass (torchao) counts its inner tensors, not its logical
    shape."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(
            tensor_bytes(getattr(t, n)) for n in names if isinstance(getattr(t, n, None), torch.Tensor)
        )
    return t.numel() * t.element_size()


def typed_view(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of flat uint8 `buf` at byte `offset` with `like`'s dtype and shape (a plain tensor)."""
    return buf[offset : offset + tensor_bytes(like)].view(like.dtype).view(like.shape)


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ArgumentError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def find_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The outermost ModuleLists of >= 2 parameter-holding children, flattened in registration order.

    Those children are the units a diffusion backbone calls one after another (Flux double/single blocks,
    UNet down/up blocks, Z-Image layers); everything else is "the rest" and stays resident."""
    out: list[tuple[str, torch.nn.Module]] = []

    def walk(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, torch.nn.ModuleList):
                members = [
                    (f"{path}.{i}", m) for i, m in enumerate(child) if any(True for _ in m.parameters())
                ]
                if len(members) >= 2:
                    out.extend(members)
                    continue
            walk(path, child)

    walk("", model)
    return out


def module_tensors(
    module: torch.nn.Module, seen: set[int], skip: frozenset[int] = frozenset()
) -> list[tuple[torch.nn.Module, str, str]]:
    """(owner, "param"|"buffer", name) of every tensor under `module` not already in `seen`, not descending
    into modules whose id is in `skip` (tied tensors stay with their first owner)."""
    out = []
    stack = [module]
    while stack:
        owner = stack.pop(0)
        for kind, table in (("param", owner._parameters), ("buffer", owner._buffers)):
            for name, t in table.items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                out.append((owner, kind, name))
        stack[:0] = [c for c in owner.children() if id(c) not in skip]
    return out


@dataclass
class StreamPlan:
    """Which blocks are resident and which are streamed, and the device bytes that implies."""

    budget: int  # bytes the plan had to fit (after clamping to what was free)
    margin: int  # bytes kept free for activations and the allocator
    rest_bytes: int  # non-block tensors, always resident
    extra_bytes: int  # adapter factors kept on the device (counted, never streamed)
    block_names: list[str]
    block_bytes: list[int]  # per block, slot layout (aligned) bytes
    resident: list[bool]
    n_slots: int  # 0 (all resident), 1 (one streamed block: it stays in its slot) or 2 (current + prefetch)
    slot_bytes: int  # size of each slot: the largest streamed block
    notes: list[str] = field(default_factory=list)
    placement: str = "prefix"  # where the resident blocks sit in execution order ("prefix" | "spread")

    @property
    def resident_bytes(self) -> int:
        return sum(b for b, r in zip(self.block_bytes, self.resident, strict=True) if r)

    @property
    def device_bytes(self) -> int:
        """Most bytes this plan ever holds on the device (rest, resident blocks, slots, adapter factors)."""
        return self.rest_bytes + self.extra_bytes + self.resident_bytes + self.n_slots * self.slot_bytes

    @property
    def streamed(self) -> list[str]:
        return [n for n, r in zip(self.block_names, self.resident, strict=True) if not r]

    def summary(self) -> dict:
        return {
            "placement": self.placement,
            "budget": self.budget,
            "margin": self.margin,
            "device_bytes": self.device_bytes,
            "rest_bytes": self.rest_bytes,
            "adapter_bytes": self.extra_bytes,
            "resident_blocks": sum(self.resident),
            "streamed_blocks": len(self.resident) - sum(self.resident),
            "resident_bytes": self.resident_bytes,
            "slots": self.n_slots,
            "slot_bytes": self.slot_bytes,
        }


PLACEMENTS = ("prefix", "spread")


def spread_streamed(n: int, m: int) -> set[int]:
    """`m` of `n` positions spread evenly: between two streamed blocks there are as many resident ones as can
    be, so each prefetch overlaps more than one block's compute."""
    return {int((j + 0.5) * n / m) for j in range(m)} if m else set()


def plan_residency(
    names: list[str],
    block_bytes: list[int],
    rest_bytes: int,
    budget: int,
    margin: int = 0,
    extra_bytes: int = 0,
    placement: str = "prefix",
) -> StreamPlan:
    """Most resident blocks that fit, in execution order.

    "prefix": the first k blocks are resident, for the largest k with rest + extra + prefix + slots(streamed)
    <= budget - margin, where slots = 2 x largest streamed block (the block computing and the one being
    prefetched), or 1 x when a single block is streamed (it simply stays in its slot).
    "spread": the same count rule, with the streamed blocks spread evenly among the resident ones: a block's
    copy then has the compute of the resident blocks before it to hide behind, not only the previous streamed
    block's."""
    check_placement(placement)
    n = len(block_bytes)
    usable = budget - margin
    best = None
    for k in range(n + 1):
        streamed = set(range(k, n)) if placement == "prefix" else spread_streamed(n, n - k)
        slots = min(2, len(streamed))
        slot_bytes = max((block_bytes[i] for i in streamed), default=0)
        held = sum(b for i, b in enumerate(block_bytes) if i not in streamed)
        if rest_bytes + extra_bytes + held + slots * slot_bytes <= usable:
            best = (streamed, slots, slot_bytes)
    if best is None:
        need = rest_bytes + extra_bytes + min(2, n) * (max(block_bytes) if n else 0)
        raise BudgetTooSmall(
            f"budget {budget} B minus margin {margin} B cannot hold the rest of the model ({rest_bytes} B), "
            f"adapter factors ({extra_bytes} B) and the streaming slots; at least {need + margin} B are "
            f"needed"
        )
    streamed, slots, slot_bytes = best
    plan = StreamPlan(
        budget,
        margin,
        rest_bytes,
        extra_bytes,
        list(names),
        list(block_bytes),
        [i not in streamed for i in range(n)],
        slots,
        slot_bytes,
        placement=placement,
    )
    log.debug(
        "loraweave stream plan: placement=%s resident=%d streamed=%d device_bytes=%d budget=%d",
        placement,
        n - len(streamed),
        len(streamed),
        plan.device_bytes,
        budget,
    )
    return plan
