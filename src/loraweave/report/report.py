"""What an apply (or plan) did: per component and mechanism, every key accounted for."""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from ..modes import REPORT_MECHANISMS, ApplyMode, ReportMechanism
from .miss import Skipped, Unmatched

log = logging.getLogger("loraweave")

EXPECTED_ABSENT = "expected_absent"  # miss kind for keys only a sibling variant of the model can take


def failures(unmatched: list) -> list:
    """Misses that count against strict mode: all but keys expected absent on this variant."""
    return [
        u for u in unmatched if u["kind"] != EXPECTED_ABSENT
    ]  # Unmatched or inspect's dicts: both have a kind


MECHANISMS = REPORT_MECHANISMS


@dataclass
class AppliedModule:
    component: str
    module: str
    mechanism: ReportMechanism  # quantized layers: factor | hosted | requantize; plan() reports "planned"
    adapters: list[str]
    why: str = ""  # for auto and quantized layers: why this mechanism was chosen
    cost: str = ""  # runtime forms that are not a plain low-rank pair, e.g. "dense ΔW (L×in·k) cached"
    notes: list[str] = field(
        default_factory=list
    )  # adaptations made to land the adapter (input widening, ...)
    backend: str = ""  # quantization backend owning the layer ("" for ordinary layers)
    retention: float | None = None  # ρ = <applied Δ, intended Δ>/‖intended Δ‖² (factor, hosted, requantize)
    capture: float | None = None  # hosted: energy fraction of the delta the truncation kept
    rank: int | None = None  # factor/hosted: rank appended to the side channel (before bucket padding)
    cache_hit: bool | None = None  # hosted with a factor cache: replayed (True) or computed (False)
    undo: str = ""  # merged layers: the undo record's kind (compact | copy | source | none)
    undo_bytes: int = 0  # merged layers: bytes the undo record holds


@dataclass
class Report:
    mode: ApplyMode | Literal["plan"]
    adapters: list[dict] = field(
        default_factory=list
    )  # name, layout, families, alpha_sources, keys_total, ...
    applied: list[AppliedModule] = field(default_factory=list)
    unmatched: list[Unmatched] = field(default_factory=list)  # adapter, key, miss (kind + reason)
    # keys left aside on purpose (model-only: text encoders); keys_total does not count them
    skipped: list[Skipped] = field(default_factory=list)
    keys_total: int = 0  # the keys the request covers: the adapters' keys less the skipped ones
    keys_applied: int = 0
    seconds: float = 0.0
    backends_unavailable: dict[str, str] = field(default_factory=dict)  # quant backends that cannot run here
    # Files of another architecture applied anyway (allow_other_arch): adapter, file_arch, model_arch, words.
    other_arch: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not failures(self.unmatched)

    def counts(self) -> dict[str, dict[str, int]]:
        """{component: {mechanism: modules}}."""
        out: dict[str, dict[str, int]] = {}
        for m in self.applied:
            out.setdefault(m.component, {}).setdefault(m.mechanism, 0)
            out[m.component][m.mechanism] += 1
        return out

    def kinds(self) -> dict[str, int]:
        """Unmatched keys counted by miss kind (miss.MISS_KINDS)."""
        return dict(Counter(u.kind for u in self.unmatched))

    reasons = kinds  # the name reports had before misses were typed

    @property
    def keys_skipped(self) -> int:
        return len(self.skipped)

    def skipped_by_component(self) -> dict[str, int]:
        """Keys left aside on purpose, counted by the component they address."""
        return dict(sorted(Counter(s.component for s in self.skipped).items()))

    def mechanisms(self) -> dict[str, dict]:
        """Per mechanism: layers, and for hosted/requantized layers ρ (and capture) median and min."""
        out: dict[str, dict] = {}
        for m in self.applied:
            out.setdefault(m.mechanism, {"layers": 0, "_rho": [], "_cap": [], "_rank": []})
            entry = out[m.mechanism]
            entry["layers"] += 1
            if m.retention is not None:
                entry["_rho"].append(m.retention)
            if m.capture is not None:
                entry["_cap"].append(m.capture)
            if m.rank:
                entry["_rank"].append(m.rank)
        for entry in out.values():
            for key, name in (("_rho", "retention"), ("_cap", "capture")):
                values = entry.pop(key)
                if values:
                    entry[f"{name}_median"], entry[f"{name}_min"] = statistics.median(values), min(values)
            ranks = entry.pop("_rank")
            if ranks:
                entry["rank_max"] = max(ranks)
        return out

    def undo_bytes(self) -> int:
        """Bytes held to undo merged layers (the kinds per layer are in `applied[i].undo`)."""
        return sum(m.undo_bytes for m in self.applied)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "keys_total": self.keys_total,
            "keys_applied": self.keys_applied,
            "seconds": round(self.seconds, 6),
            "adapters": self.adapters,
            "counts": self.counts(),
            "applied": [vars(m).copy() for m in self.applied],
            "unmatched": [u.to_dict() for u in self.unmatched],
            "unmatched_by_kind": self.kinds(),
            "keys_skipped": self.keys_skipped,
            "skipped_by_component": self.skipped_by_component(),
            "skipped": [s.to_dict() for s in self.skipped],
            "mechanisms": self.mechanisms(),
            "backends_unavailable": dict(self.backends_unavailable),
            "undo_bytes": self.undo_bytes(),
            "other_arch": [dict(o) for o in self.other_arch],
        }

    def other_arch_lines(self) -> list[str]:
        """One line per file of another architecture applied anyway: what it is, said in users' terms."""
        return [f"{o['adapter']}: {o['words']}, applied anyway (allow_other_arch)" for o in self.other_arch]

    def summary(self) -> str:
        mech = Counter(m.mechanism for m in self.applied)
        parts = [
            *(f"other_arch={o['file_arch']}_on_{o['model_arch']}" for o in self.other_arch),
            f"mode={self.mode}",
            f"adapters={len(self.adapters)}",
            f"keys_applied={self.keys_applied}/{self.keys_total}",
            *(f"{k}={mech[k]}" for k in MECHANISMS if mech[k]),
            f"components={','.join(sorted(self.counts())) or '-'}",
            f"unmatched={len(self.unmatched)}",
        ]
        parts += [f"miss_{kind}={n}" for kind, n in sorted(self.kinds().items())]
        parts += [f"skipped_{component}={n}" for component, n in self.skipped_by_component().items()]
        if any(m.undo for m in self.applied):
            parts.append(f"undo_bytes={self.undo_bytes()}")
        parts.append(f"seconds={self.seconds:.3f}")
        return " ".join(parts)

    def log(self) -> None:
        log.info("loraweave %s", self.summary())
        if not any(m.backend for m in self.applied):
            return
        for name, entry in self.mechanisms().items():  # one line per mechanism on quantized models
            extra = " ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in entry.items()
                if k != "layers"
            )
            backends = (
                ",".join(sorted({m.backend for m in self.applied if m.mechanism == name and m.backend}))
                or "-"
            )
            log.info(
                "loraweave apply=%s layers=%d backend=%s%s",
                name,
                entry["layers"],
                backends,
                f" {extra}" if extra else "",
            )
        hits = [m.cache_hit for m in self.applied if m.cache_hit is not None]
        if hits:
            log.info("loraweave factor_cache hits=%d misses=%d", sum(hits), len(hits) - sum(hits))
        for name, why in sorted(self.backends_unavailable.items()):
            log.info("loraweave backend_unavailable name=%s reason=%r", name, why)

    def __str__(self) -> str:
        return self.summary()
