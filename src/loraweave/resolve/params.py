"""Planning patches of bare parameters (modulation tables), which are no module's weight.

A full-difference key (`<parameter>.diff`) names a parameter directly, in live or original spelling;
lightx2v's Wan distillation LoRAs write the delta of `<block>.modulation` as `<block>.diff_m`. The target is
the pair (owning module, parameter name); the delta must have the parameter's shape, or its size where the
table says the original stores it flattened."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..arch.aliases import AliasTable
from ..arch.spec import Piece
from ..families.base import PartRejected, check_factor
from ..formats.adapter import Adapter, AdapterPart

# lightx2v: `<module>.diff_m` is the delta of that module's `modulation` parameter (Wan's per-block table).
DIFF_M_PARAM = "modulation"
PARAM_ROLES = ("diff", "diff_m")


@dataclass
class PlannedParam:
    adapter: Adapter
    part: AdapterPart
    component: str
    owner: str  # path of the module holding the parameter ("" for the root)
    name: str  # the parameter's attribute name on `owner`
    delta: torch.Tensor  # in the parameter's shape, stored dtype
    strength: float
    notes: list[str] = field(default_factory=list)
    block_weight: float = 1.0
    scale: float = 1.0  # full differences carry no alpha
    alpha_source: str = "none:full"

    @property
    def path(self) -> str:
        return f"{self.owner}.{self.name}" if self.owner else self.name

    @property
    def pieces(self) -> tuple[Piece, ...]:  # block weights look up the owning module
        return (Piece(self.owner, 0, 0, self.delta.shape[0], True),)


def param_role(part: AdapterPart) -> str | None:
    """The role holding a bare-parameter delta, when the part is one (a full diff with nothing else)."""
    if part.family != "full" or set(part.roles) - {"diff", "diff_m"} or len(part.roles) != 1:
        return None
    return next(iter(part.roles))


def param_target(part: AdapterPart, table: AliasTable) -> tuple[str, bool] | None:
    """(live parameter, reshape) a full diff lands on: a bare parameter, or the 1-D weight of a norm module
    (an elementwise scale, which no dense runtime product can express: it is patched like a parameter)."""
    role = param_role(part)
    if role is None:
        return None
    path = f"{part.path}.{DIFF_M_PARAM}" if role == "diff_m" else part.path
    found = table.lookup(path) if role == "diff" else None
    if isinstance(found, tuple) and len(found) == 1 and found[0].whole:
        weight = getattr(table.modules[found[0].module], "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 1:
            return f"{found[0].module}.weight", False
    return table.param(path)


def plan_param(
    adapter: Adapter,
    part: AdapterPart,
    component: str,
    table: AliasTable,
    target: tuple[str, bool],
    strength: float,
) -> PlannedParam:
    live, reshape = target
    param = table.root.get_parameter(live)
    key = next(iter(part.roles.values()))
    delta = adapter.tensor(key)
    notes = [f"parameter {live}"]
    if tuple(delta.shape) != tuple(param.shape):
        if not reshape or delta.numel() != param.numel():
            raise PartRejected(
                "shape_mismatch",
                f"shape mismatch: {key} {tuple(delta.shape)} vs parameter {component}.{live} "
                f"{tuple(param.shape)}",
            )
        notes.append(f"delta reshaped {tuple(delta.shape)} -> {tuple(param.shape)} (original stores it flat)")
        delta = delta.reshape(param.shape)
    check_factor(key, delta)
    owner, _, name = live.rpartition(".")
    return PlannedParam(adapter, part, component, owner, name, delta, strength, notes)
