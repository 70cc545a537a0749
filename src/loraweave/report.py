"""What an apply (or plan) did: per component and mechanism, every key accounted for."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger("loraweave")

MECHANISMS = ("merge", "runtime", "planned")


@dataclass
class AppliedModule:
    component: str
    module: str
    mechanism: str  # merge | runtime | planned (plan() only)
    adapters: list[str]
    why: str = ""  # for auto: why this mechanism was chosen
    cost: str = ""  # runtime forms that are not a plain low-rank pair, e.g. "dense ΔW (L×in·k) cached"
    notes: list[str] = field(default_factory=list)  # adaptations made to land the adapter (input widening, ...)


@dataclass
class Report:
    mode: str
    adapters: list[dict] = field(default_factory=list)  # name, layout, families, alpha_sources, keys_total, ...
    applied: list[AppliedModule] = field(default_factory=list)
    unmatched: list[dict] = field(default_factory=list)  # {adapter, key, reason}
    keys_total: int = 0
    keys_applied: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.unmatched

    def counts(self) -> dict[str, dict[str, int]]:
        """{component: {mechanism: modules}}."""
        out: dict[str, dict[str, int]] = {}
        for m in self.applied:
            out.setdefault(m.component, {}).setdefault(m.mechanism, 0)
            out[m.component][m.mechanism] += 1
        return out

    def reasons(self) -> dict[str, int]:
        """Unmatched keys counted by the kind of reason (text before the first ':')."""
        return dict(Counter(u["reason"].split(":", 1)[0] for u in self.unmatched))

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "keys_total": self.keys_total,
            "keys_applied": self.keys_applied,
            "seconds": round(self.seconds, 6),
            "adapters": self.adapters,
            "counts": self.counts(),
            "applied": [vars(m).copy() for m in self.applied],
            "unmatched": [dict(u) for u in self.unmatched],
            "unmatched_by_reason": self.reasons(),
        }

    def summary(self) -> str:
        mech = Counter(m.mechanism for m in self.applied)
        parts = [
            f"mode={self.mode}",
            f"adapters={len(self.adapters)}",
            f"keys_applied={self.keys_applied}/{self.keys_total}",
            *(f"{k}={mech[k]}" for k in MECHANISMS if mech[k]),
            f"components={','.join(sorted(self.counts())) or '-'}",
            f"unmatched={len(self.unmatched)}",
        ]
        parts += [f"miss_{reason.replace(' ', '_')}={n}" for reason, n in sorted(self.reasons().items())]
        parts.append(f"seconds={self.seconds:.3f}")
        return " ".join(parts)

    def log(self) -> None:
        log.info("loraweave %s", self.summary())

    def __str__(self) -> str:
        return self.summary()
