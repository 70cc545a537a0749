"""Which mechanism each layer gets (merge, runtime, or a quantized layer's factor/hosted/requantize route).

`plan_work` decides for every layer of a plan; a part some layer refuses is dropped everywhere (a part split
over several modules lands everywhere or nowhere) and its keys go to the unmatched list with the reason."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..errors import QuantizedWeightError
from ..modes import ApplyMode, Mechanism, QuantizedMode
from ..quant import QuantBackend, backend_for
from ..report.miss import Miss, Unmatched
from ..resolve.planner import Plan
from ..resolve.stacking import Contribution
from .merge.checks import merge_blocker, needs_bias
from .quantized.write import Route, factorable_reason, route_hook_free
from .runtime.factor_cache import FactorCache
from .runtime.host import runtime_blocker, runtime_host
from .runtime.offload import weight_copies


@dataclass
class LayerWork:
    """One layer's unit of work: where it is, the mechanism chosen for it (None: refused) and why, and what
    lands."""

    component: str
    path: str
    module: torch.nn.Module
    mechanism: Mechanism | None
    why: str
    contribs: list[Contribution]


Work = list[LayerWork]


@dataclass
class QuantSettings:
    quantized: QuantizedMode = "auto"
    host_rank: int = 256
    cache: FactorCache | None = None


@dataclass
class WorkPlan:
    work: Work
    routes: dict[tuple[str, str], tuple[QuantBackend, Route | None]] = field(default_factory=dict)


def choose(
    mode: ApplyMode, module: torch.nn.Module, contribs: list[Contribution], copy_reason: str | None = None
) -> tuple[Mechanism | None, str]:
    """(mechanism or None, why) for a layer no quantization backend owns; copy_reason: an offload group owns
    it."""
    merge_no = copy_reason or merge_blocker(module, needs_bias(contribs))
    runtime_no = runtime_blocker(module)
    if mode == "merge":
        return (
            (None, f"cannot merge: {merge_no}; use mode='runtime' or 'auto'") if merge_no else ("merge", "")
        )
    if mode == "runtime":
        return (
            (None, f"cannot run at runtime: {runtime_no}; use mode='merge' or 'auto'")
            if runtime_no
            else ("runtime", "")
        )
    if merge_no is None:
        return "merge", "plain floating weight"
    if runtime_no is None:
        return "runtime", merge_no
    return None, f"neither mechanism fits: {merge_no}; {runtime_no}"


def runtime_refusal(module: torch.nn.Module, contribs: list[Contribution]) -> Miss | None:
    """Whether a family will refuse this layer at runtime (e.g. DoRA on a quantized weight), asked of the
    families' declared abilities: nothing is built."""
    host = None
    for pp, _ in contribs:
        if pp.family.reads_host and host is None:
            host = runtime_host(module)
        refused = pp.family.runtime_refusal(pp.factors, host if pp.family.reads_host else None)
        if refused is not None:
            return refused
    return None


def check_runtime(
    mode: ApplyMode, module: torch.nn.Module, contribs: list[Contribution], why: str, quantized: bool = False
) -> tuple[Mechanism | None, str, str]:
    """(mechanism, why, miss kind) once the families had their say on the runtime form."""
    refused = runtime_refusal(module, contribs)
    if refused is None:
        return "runtime", why, ""
    # Never fall back to a plain merge on a quantized layer: its storage is not the weight (fp8 looks float).
    if mode == "auto" and not quantized and merge_blocker(module, needs_bias(contribs)) is None:
        return "merge", f"runtime refused: {refused}", ""
    return None, f"cannot run at runtime: {refused}", refused.kind


def _runtime_else_none(why: str, runtime_no: str | None) -> tuple[Mechanism | None, str, None]:
    """The runtime path when the layer takes one, else no mechanism (and both reasons)."""
    if runtime_no is None:
        return "runtime", why, None
    return None, f"neither mechanism fits: {why}; {runtime_no}", None


def _hook_free_route(
    qs: QuantSettings,
    backend: QuantBackend,
    module: torch.nn.Module,
    contribs: list[Contribution],
    layer: str,
    missing: str | None,
) -> Route:
    if missing:
        return Route(None, f"{backend.name} cannot run here: {missing}")
    return route_hook_free(
        backend,
        module,
        contribs,
        qs.host_rank,
        force_requantize=qs.quantized == "requantize",
        cache=qs.cache,
        layer=layer,
    )


def _side_channel(
    backend: QuantBackend,
    module: torch.nn.Module,
    contribs: list[Contribution],
    missing: str | None,
    runtime_no: str | None,
) -> tuple[Mechanism | None, str, Route | None]:
    """The backend's exact side channel when it has one and the deltas factor, else the runtime path."""
    caps = None if missing else backend.capabilities(module)
    not_factorable = factorable_reason(module, contribs) or ("bias delta" if needs_bias(contribs) else None)
    if caps is None:  # the backend cannot run here
        return _runtime_else_none(f"{backend.name}: {missing}", runtime_no)
    if caps.factor_channel and not_factorable is None:
        return "factor", f"{backend.name} side channel, exact", Route("factor", "")
    reason = not_factorable if not_factorable is not None and caps.factor_channel else None
    return _runtime_else_none(f"{backend.name}: " + (reason or caps.reason or "no side channel"), runtime_no)


def choose_quantized(
    mode: ApplyMode,
    qs: QuantSettings,
    backend: QuantBackend,
    module: torch.nn.Module,
    contribs: list[Contribution],
    layer: str = "",
) -> tuple[Mechanism | None, str, Route | None]:
    """(mechanism or None, why, routing result) for a layer a quantization backend owns."""
    runtime_no = runtime_blocker(module)
    if mode == "runtime":
        return (None, f"cannot run at runtime: {runtime_no}", None) if runtime_no else ("runtime", "", None)
    # side channels and requantize write tensors the streamer copies
    if getattr(module, "_loraweave_streamed", False):
        if mode == "merge":
            return None, "cannot merge: layer is streamed; use mode='runtime' or 'auto'", None
        return _runtime_else_none("layer is streamed", runtime_no)
    missing = backend.unavailable()
    if mode == "merge" or (mode == "auto" and qs.quantized in ("host", "requantize")):
        route = _hook_free_route(qs, backend, module, contribs, layer, missing)
        if route.mechanism is not None or mode == "merge":
            return route.mechanism, route.why if route.mechanism else f"cannot merge: {route.why}", route
        if runtime_no is None:
            return "runtime", f"hook-free path declined: {route.why}", None
        return None, f"neither mechanism fits: {route.why}; {runtime_no}", None
    return _side_channel(backend, module, contribs, missing, runtime_no)


def plan_work(
    p: Plan,
    groups: dict[tuple[str, str], list[Contribution]],
    mode: ApplyMode,
    unmatched: list[Unmatched],
    qs: QuantSettings | None = None,
) -> WorkPlan:
    """A mechanism per layer, decided from the layers and the families' declared abilities (nothing built)."""
    qs = qs or QuantSettings()
    plan = WorkPlan([])
    rejected_parts: dict[int, Miss] = {}
    copies = weight_copies(p.components.modules.values())
    for (comp, path), contribs in groups.items():
        module = p.components.modules[comp].get_submodule(path)
        backend = backend_for(module)
        if backend is not None and (bad := backend.malformed(module)) is not None:
            raise QuantizedWeightError(
                f"{comp}.{path}: malformed {backend.name} layer ({type(module).__name__}): {bad}; "
                "nothing was changed"
            )
        if backend is not None:
            mechanism, why, route = choose_quantized(mode, qs, backend, module, contribs, f"{comp}.{path}")
            plan.routes[(comp, path)] = (backend, route)
        else:
            mechanism, why = choose(mode, module, contribs, copies.get(id(module)))
        kind = "no_mechanism"
        if mechanism == "runtime":
            mechanism, why, refused_kind = check_runtime(
                mode, module, contribs, why, quantized=backend is not None
            )
            kind = refused_kind or kind
        if mechanism is None:
            for pp, _ in contribs:
                rejected_parts.setdefault(id(pp), Miss(kind, f"{why} ({comp}.{path})"))
        plan.work.append(LayerWork(comp, path, module, mechanism, why, contribs))
    if rejected_parts:
        _drop_rejected(p, plan, unmatched, rejected_parts)
    return plan


def _drop_rejected(p: Plan, plan: WorkPlan, unmatched: list[Unmatched], rejected: dict[int, Miss]) -> None:
    """A part no mechanism takes on one of its layers goes from every layer (its keys to `unmatched`)."""
    for pp in p.planned:
        if id(pp) in rejected:
            unmatched += [Unmatched(pp.adapter.name, k, rejected[id(pp)]) for k in pp.part.keys]
    p.planned = [pp for pp in p.planned if id(pp) not in rejected]
    kept = []
    for item in plan.work:
        remaining = [c for c in item.contribs if id(c.part) not in rejected]
        where = (item.component, item.path)
        if len(remaining) != len(item.contribs) and where in plan.routes:
            plan.routes[where] = (plan.routes[where][0], None)  # routed on other contributions
        if remaining:
            kept.append(dataclasses.replace(item, contribs=remaining))
    plan.work = kept
