"""Split a model into its repeated blocks and the rest, and choose which blocks stay resident under a budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger("loraweave")

ALIGN = 256  # slot offsets: a multiple of every element size, and of CUDA's copy-friendly alignment


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def find_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The outermost ModuleLists of >= 2 parameter-holding children, flattened in registration order.

    Those children are the units a diffusion backbone calls one after another (Flux double/single blocks,
    UNet down/up blocks, Z-Image layers); everything else is "the rest" and stays resident."""
    out: list[tuple[str, torch.nn.Module]] = []

    def walk(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, torch.nn.ModuleList):
                members = [(f"{path}.{i}", m) for i, m in enumerate(child) if any(True for _ in m.parameters())]
                if len(members) >= 2:
                    out.extend(members)
                    continue
            walk(path, child)

    walk("", model)
    return out


def module_tensors(module: torch.nn.Module, seen: set[int], skip: frozenset[int] = frozenset()
                   ) -> list[tuple[torch.nn.Module, str, str]]:
    """(owner, "param"|"buffer", name) of every tensor under `module` not already in `seen`, not descending into
    modules whose id is in `skip` (tied tensors stay with their first owner)."""
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
            "budget": self.budget, "margin": self.margin, "device_bytes": self.device_bytes,
            "rest_bytes": self.rest_bytes, "adapter_bytes": self.extra_bytes,
            "resident_blocks": sum(self.resident), "streamed_blocks": len(self.resident) - sum(self.resident),
            "resident_bytes": self.resident_bytes, "slots": self.n_slots, "slot_bytes": self.slot_bytes,
        }


class BudgetTooSmall(ValueError):
    """The budget cannot hold the rest of the model plus the slots for the largest block."""


def plan_residency(
    names: list[str], block_bytes: list[int], rest_bytes: int, budget: int, margin: int = 0, extra_bytes: int = 0,
) -> StreamPlan:
    """Greedy resident prefix in execution order.

    The first k blocks are resident for the largest k with rest + extra + prefix + slots(streamed) <= budget -
    margin, where slots = 2 x largest streamed block (the block computing and the one being prefetched), or 1 x
    when a single block is streamed (it simply stays in its slot)."""
    n = len(block_bytes)
    usable = budget - margin
    # suffix_max[k] = largest block among k..n-1 (the streamed set when the prefix is k blocks long)
    suffix_max = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix_max[i] = max(block_bytes[i], suffix_max[i + 1])
    prefix = 0
    best = None
    for k in range(n + 1):
        if k:
            prefix += block_bytes[k - 1]
        streamed = n - k
        slots = min(2, streamed)
        need = rest_bytes + extra_bytes + prefix + slots * suffix_max[k]
        if need <= usable:
            best = (k, slots, suffix_max[k])
    if best is None:
        need = rest_bytes + extra_bytes + min(2, n) * (max(block_bytes) if n else 0)
        raise BudgetTooSmall(
            f"budget {budget} B minus margin {margin} B cannot hold the rest of the model ({rest_bytes} B), "
            f"adapter factors ({extra_bytes} B) and the streaming slots; at least {need + margin} B are needed"
        )
    k, slots, slot_bytes = best
    plan = StreamPlan(budget, margin, rest_bytes, extra_bytes, list(names), list(block_bytes),
                      [i < k for i in range(n)], slots, slot_bytes)
    log.debug("loraweave stream plan: resident=%d streamed=%d device_bytes=%d budget=%d", k, n - k,
              plan.device_bytes, budget)
    return plan
