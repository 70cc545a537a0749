"""StreamHandle: per-block hooks that copy a streamed block into a slot one block ahead and release it
after."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..errors import StateError
from . import factors, hostmem, outside
from .ledger import Ledger
from .planner import StreamPlan, plan_residency
from .report import ForwardStats, StreamReport
from .slots import Copier, Slot
from .store import Unit

log = logging.getLogger("loraweave")
STREAMED_ATTR = "_loraweave_streamed"


class StreamHandle:
    """A model whose repeated blocks stream through device slots under a byte budget.

    `release()` gives back every device byte (e.g. before a VAE decode; the next forward re-plans against what
    is free then); `close()` restores the model exactly (same parameter objects, devices, values)."""

    def __init__(
        self,
        model: torch.nn.Module,
        blocks: list[tuple[str, torch.nn.Module]],
        budget: int | None,
        device: torch.device,
        storage: torch.device,
        margin: int,
        free_bytes: Callable[[], int] | None,
        trace: bool = False,
        placement: str = "prefix",
    ) -> None:
        self.model, self.device, self.storage = model, device, storage
        self._outside = outside.resident_outside_bytes(
            model, device
        )  # refuses unstreamable layers, moves nothing
        self._requested = budget  # None: "auto" (free memory at each forward)
        self._free_bytes = free_bytes
        self.margin, self.placement = margin, placement
        pin = hostmem.pins(device, storage)
        seen: set[int] = set()
        skip = frozenset(id(m) for _, m in blocks)
        self.rest = Unit(
            "rest", model, seen, storage, pin, skip
        )  # first: tensors tied to the rest stay resident
        self.units = [Unit(name, m, seen, storage, pin) for name, m in blocks]
        self.order = list(range(len(self.units)))  # execution order, learned from the first forward
        self._seen_order: list[int] = []
        self.copier = Copier(device)
        self.slots: list[Slot] = []
        self.epoch = 0  # bumped on every plan change: slot contents from an older plan are never used
        self._ratchet: int | None = None  # effective budget only shrinks between releases
        # Runtime paths sit on weight-holding layers: the per-forward adapter check looks only there.
        self._layers = [m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)]
        self._params = list(model.parameters())
        self._owner = {id(m): k for k, u in enumerate(self.units) for m in u.module.modules()}
        self._adapters: tuple = ()
        self._extra = (
            self._outside
        )  # bytes that stay on the device: adapter factors not travelling, quant state
        self._refresh_adapters()
        self.ledger = Ledger(0, trace=[] if trace else None)
        self.plan: StreamPlan | None = None
        self._resident_units: set[int] = set()  # unit indices (the plan lists blocks in execution order)
        self.report: StreamReport | None = None
        self._released = True
        self._in_forward = False
        self._active: tuple[int, Slot] | None = None
        self._stats = ForwardStats()
        self.marked: list[torch.nn.Module] = []
        for unit in [self.rest, *self.units]:  # merging into any of them would write a copy (merge_blocker)
            for m in unit.weight_modules():
                if not getattr(m, STREAMED_ATTR, False):
                    setattr(m, STREAMED_ATTR, True)
                    self.marked.append(m)
        self._slot_buffer = 0
        self._hooks = [
            model.register_forward_pre_hook(self._begin_forward),
            model.register_forward_hook(self._end_forward, always_call=True),
        ]
        for i, unit in enumerate(self.units):
            self._hooks.append(unit.module.register_forward_pre_hook(self._pre_hook(i)))
            self._hooks.append(unit.module.register_forward_hook(self._post_hook(i), always_call=True))
        self.closed = False
        try:
            self._acquire()
        except BaseException:
            self.close()  # a budget too small (or an interrupt) leaves the model exactly as it was
            raise

    # -- budget and plan
    # ---------------------------------------------------------------------------------------
    def _free_now(self) -> int | None:
        if self._free_bytes is not None:
            return self._free_bytes()
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            return free + cached  # the caching allocator's idle blocks are free to us too
        return None

    def _effective_budget(self) -> int:
        """Requested budget clamped to what is free now (plus what we hold), never growing between
        releases."""
        free = self._free_now()
        avail = None if free is None else free + self.ledger.current
        if self._requested is None:
            budget = avail if avail is not None else self._all_resident_bytes()
        else:
            budget = self._requested if avail is None else min(self._requested, avail)
        if self._ratchet is not None:
            budget = min(budget, self._ratchet)
        self._ratchet = budget
        return budget

    def _all_resident_bytes(self) -> int:
        return self.rest.nbytes + sum(u.nbytes for u in self.units) + self._extra + self.margin

    def _new_plan(self, budget: int) -> StreamPlan:
        order = self.order
        return plan_residency(
            [self.units[i].name for i in order],
            [self.units[i].nbytes for i in order],
            self.rest.nbytes,
            budget,
            self.margin,
            self._extra,
            self.placement,
        )

    def _resident(self, plan: StreamPlan) -> set[int]:
        """Unit indices `plan` keeps resident (it was made along the current execution order)."""
        return {self.order[k] for k, r in enumerate(plan.resident) if r}

    def _install(self, plan: StreamPlan) -> None:
        """Move from the current residency to `plan`'s: free first, then book and allocate."""
        old = self._resident_units if not self._released else set()
        new = self._resident(plan)
        self.copier.drain()
        self.slots = []
        for k in range(2):
            self.ledger.free(f"slot{k}")
        for i in sorted(old - new):
            self.units[i].to_host()
            self.ledger.free(f"block:{self.units[i].name}")
        self.ledger.limit = plan.budget - plan.margin
        # Resident blocks and kept factors may have changed size (adapters came or went): shrinks first.
        resize = [(f"block:{self.units[i].name}", self.units[i].nbytes) for i in old & new]
        resize.append(("adapters", plan.extra_bytes))
        for tag, nbytes in sorted(resize, key=lambda tb: tb[1] - self.ledger.held.get(tb[0], 0)):
            self.ledger.book(tag, nbytes)
        if self._released:
            self.ledger.book("rest", self.rest.nbytes)
            self.rest.to_device(self.device)
        for i in sorted(new - old):
            self.ledger.book(f"block:{self.units[i].name}", self.units[i].nbytes)
            self.units[i].to_device(self.device)
        buf = self._slot_buffer = self._slot_buffer_bytes(plan)
        for k in range(plan.n_slots):
            self.ledger.book(f"slot{k}", plan.slot_bytes)
            self.slots.append(Slot(buf, self.device, self.copier))
        self.plan = plan
        self._resident_units = new
        self.epoch += 1
        self._released = False
        first = next((j for j in self.order if j not in new), None)
        if (
            first is not None and self._active is None
        ):  # the next forward's first streamed block, ahead of time
            self._fill(self.slots[0], first, prefetch=True)
        if self.report is None:
            self.report = StreamReport(
                str(self.device),
                str(self.storage),
                plan,
                trace=self.ledger.trace,
                asynchronous=self.copier.asynchronous,
            )
        else:
            self.report.plan = plan
            self.report.replans += 1
        self.report.peak_bytes = self.ledger.peak
        log.info("loraweave stream plan: %s", " ".join(f"{k}={v}" for k, v in plan.summary().items()))

    def _slot_buffer_bytes(self, plan: StreamPlan) -> int:
        """A slot's flat buffer: the largest slot layout among the blocks `plan` streams."""
        resident = self._resident(plan)
        return max((u.slot_layout_bytes for i, u in enumerate(self.units) if i not in resident), default=0)

    def _acquire(self) -> None:
        self._install(self._new_plan(self._effective_budget()))

    def _refresh_adapters(self) -> bool:
        """Find the attached runtime paths; when they changed, re-lay the blocks' travelling factors."""
        paths = factors.runtime_paths(self.model, self._layers)
        signature = tuple(paths)  # the objects, held: an id() could be reused by a later adapter's path
        if signature == self._adapters:
            return False
        self._adapters = signature
        travel: dict[int, list] = {}
        self._extra = self._outside  # quantization state kept on the device (counted like kept factors)
        for p in paths:
            k = self._owner.get(id(p.module))
            if k is not None and factors.travel_dtype(p) is not None:
                travel.setdefault(k, []).append(p)
                self._extra += factors.scale_bytes(p)  # the per-rank scale vector stays with its path
            else:
                self._extra += factors.path_bytes(p)
        for k, unit in enumerate(self.units):
            if [p for p, *_ in unit.factors] != travel.get(k, []):
                unit.set_factors(travel.get(k, []))
        return True

    def _check_intact(self) -> None:
        for unit in [self.rest, *self.units]:
            what = unit.changed()
            if what is not None:
                raise StateError(
                    f"a streamed tensor was replaced behind loraweave's back ({what}), e.g. by "
                    "module.to() or a new Parameter; close() the StreamHandle before moving or "
                    "editing the model's tensors, then stream() again"
                )

    def _maybe_replan(self) -> None:
        self._check_intact()
        changed = self._refresh_adapters()
        if self._released:
            self._acquire()
            return
        budget = self._effective_budget()
        if changed or budget < self.plan.budget:
            plan = self._new_plan(budget)
            # Same residency, slots and sizes: keep the slots and their prefetched contents. (Block sizes
            # count: a resident block's booking or a slot buffer must grow when its adapters do.)
            same = (
                plan.resident,
                plan.n_slots,
                plan.slot_bytes,
                plan.extra_bytes,
                plan.block_bytes,
                self._slot_buffer_bytes(plan),
            ) == (
                self.plan.resident,
                self.plan.n_slots,
                self.plan.slot_bytes,
                self.plan.extra_bytes,
                self.plan.block_bytes,
                self._slot_buffer,
            )
            if same:  # a little less free memory, same plan: keep slots and their prefetched contents
                self.plan.budget = plan.budget
                self.ledger.limit = plan.budget - plan.margin
            else:
                self._install(plan)

    # -- hooks
    # -------------------------------------------------------------------------------------------------
    def _begin_forward(self, module, args) -> None:
        if self._in_forward:
            return
        if torch.is_grad_enabled() and any(p.requires_grad for p in self._params):
            raise StateError(
                "loraweave streaming is inference-only: call the model under torch.no_grad() "
                "(slots are reused, so autograd would see overwritten weights)"
            )
        self._in_forward = True
        self.copier.resolve(self.report.total)
        self._maybe_replan()

    def _end_forward(self, module, args, output) -> None:
        if not self._in_forward:
            return
        self._in_forward = False
        if (
            self._active is not None
        ):  # a block raised: its post-hook ran, but be sure nothing points at a slot
            self._release_block(*self._active)
        r = self.report
        r.forwards += 1
        r.last = self._stats
        r.total.add(self._stats)
        self._stats = ForwardStats()  # copies made from here on (prefetch for the next forward) count there
        if len(self._seen_order) == len(self.units) and self._seen_order != self.order:
            self.order = list(self._seen_order)  # learned order: re-plan along it
            self._install(self._new_plan(self._effective_budget()))
        self._seen_order = []
        r.peak_bytes = self.ledger.peak
        self.ledger.note("forward end")

    def _pre_hook(self, i: int):
        def hook(module, args):
            if not self._in_forward:  # a block called on its own: plan as a forward would
                self._begin_forward(self.model, ())
                self._in_forward = "block"
            if i not in self._seen_order:
                self._seen_order.append(i)
            if i in self._resident_units:
                return
            self._load(i)

        return hook

    def _post_hook(self, i: int):
        def hook(module, args, output):
            if self._active is not None and self._active[0] == i:
                self._release_block(*self._active)
            if self._in_forward == "block":
                self._end_forward(self.model, (), None)

        return hook

    # -- slots
    # -------------------------------------------------------------------------------------------------
    def _tag(self, i: int) -> tuple:
        return (i, self.epoch, self.units[i].version())

    def _holding(self, i: int) -> Slot | None:
        tag = None
        for slot in self.slots:
            if slot.index == i:
                tag = tag or self._tag(i)
                if slot.tag == tag:
                    return slot
                slot.index = slot.tag = slot.views = None  # written since the copy: never used stale
                self._stats.stale += 1
        return None

    def _next_streamed(self, i: int) -> int | None:
        streamed = [j for j in self.order if j not in self._resident_units]
        if len(streamed) < 2:
            return None
        k = streamed.index(i) if i in streamed else -1
        return streamed[(k + 1) % len(streamed)]  # wraps: the next forward's first streamed block

    def _fill(self, slot: Slot, i: int, prefetch: bool) -> None:
        unit = self.units[i]
        slot.index, slot.tag, slot.prefetched = i, self._tag(i), prefetch
        before = self._stats.copy_seconds
        self.copier.fill(slot, unit, self._stats)
        slot.copy_s = self._stats.copy_seconds - before
        self.ledger.note(f"copy {unit.name}")

    def _load(self, i: int) -> None:
        slot = self._holding(i)
        if slot is None:
            nxt = self._next_streamed(i)
            free = [s for s in self.slots if not s.busy]
            # Prefer a slot that does not hold the block predicted next.
            free.sort(key=lambda s: (s.index is not None and s.index == nxt, s.index is not None))
            slot = free[0]
            self._fill(slot, i, prefetch=False)
            self._stats.on_demand += 1
            self.copier.wait(slot, self._stats, slot.copy_s)
        else:
            if slot.prefetched:
                self._stats.prefetched += 1
                self.copier.wait(slot, self._stats, slot.copy_s)
            else:
                self._stats.kept += 1
                self.copier.wait(slot, self._stats, 0.0)
            slot.prefetched = False
        slot.busy = True
        self._stats.bytes_copied += self.units[i].point_to(slot.views, self.device)
        self._active = (i, slot)
        self.ledger.note(f"compute {self.units[i].name}")
        nxt = self._next_streamed(i)
        if nxt is not None and self._holding(nxt) is None:
            other = next((s for s in self.slots if not s.busy), None)
            if other is not None:
                self._fill(other, nxt, prefetch=True)

    def _release_block(self, i: int, slot: Slot) -> None:
        self.copier.done(slot)
        slot.busy = False
        self.units[i].to_host()
        self._active = None
        self.ledger.note(f"done {self.units[i].name}")

    # -- public
    # ------------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Give back every device byte (resident blocks, the rest, slots, adapter factor casts). The next
        forward re-plans against the memory free then (the budget ratchet is reset)."""
        if self.closed or self._released:
            return
        self.copier.drain()
        self.slots = []
        for unit in [self.rest, *self.units]:
            unit.to_host()
        factors.recast(self.model)  # factor casts follow their weights back to the host
        self.ledger.free_all()
        self._ratchet = None
        self._released = True
        self.report.releases += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("loraweave stream released: device_bytes=0")

    def close(self) -> None:
        """Remove the hooks and restore the model exactly as it was before `stream`. Idempotent."""
        if self.closed:
            return
        self.copier.drain()
        if self.report is not None:
            self.copier.resolve(self.report.total, block=True)
        for h in self._hooks:
            h.remove()
        self.slots = []
        for unit in [self.rest, *self.units]:
            unit.restore()
            if unit.pin:  # pinned host copies freed by restore go back to the OS, one unit at a time
                hostmem.empty_host_cache()
        for unit in self.units:
            unit.set_factors([])  # unbinds every travelling path and drops the host copies of its factors
        if self.rest.pin:
            hostmem.empty_host_cache()
        self._adapters = ()
        for m in self.marked:
            if STREAMED_ATTR in m.__dict__:
                delattr(m, STREAMED_ATTR)
        factors.recast(self.model)
        self.ledger.free_all()
        self.closed = True
        self._released = True

    def sync_report(self) -> StreamReport:
        """The report with every pending CUDA timing folded in (synchronizes the copy events)."""
        self.copier.resolve(self.report.total, block=True)
        return self.report

    def __enter__(self) -> StreamHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StreamHandle(closed={self.closed}, {self.report.summary() if self.report else ''})"
