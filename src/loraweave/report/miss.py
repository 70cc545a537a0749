"""Why a key did not land: a `Miss(kind, detail)` with a kind from a closed set, chosen where the miss is
made.

`detail` is the readable reason, prefix included ("shape mismatch: ..."); reports group by `kind`, never by
parsing the text. Bottom layer: imports nothing from loraweave."""

from __future__ import annotations

from dataclasses import dataclass

MISS_KINDS = (
    "not_parsed",  # the key matches no layout we know, or repeats a role
    "no_such_component",  # the key names a component the target does not have
    "no_such_module",  # no module of the target carries that name (or that positional index)
    "ambiguous_module",  # several modules match the name once '.' is written '_'
    "ambiguous",  # the tensors fit the module more than one way (IA3 side on a square layer)
    "shape_mismatch",  # the factors do not fit the module's shape
    "incomplete",  # a part lacks a tensor its family needs
    "bad_tensor",  # a tensor of the wrong dtype or shape for its role
    "non_finite",  # NaN/Inf in a factor, alpha or scale
    "unsupported",  # a family, form or combination loraweave does not land
    "no_mechanism",  # the layer takes neither merge nor runtime in the requested mode
    "expected_absent",  # the model variant leaves this module out on purpose
    "other_input",  # trained on inputs the model is not fed (a control LoRA on Flux Fill): refused
    "not_resolved",  # inspect without a model: nothing was resolved
)


@dataclass(frozen=True)
class Miss:
    kind: str
    detail: str

    def __post_init__(self) -> None:
        if self.kind not in MISS_KINDS:
            raise ValueError(f"miss kind must be one of {MISS_KINDS}, got {self.kind!r}")

    def where(self, suffix: str) -> Miss:
        """The same miss with ` (suffix)` added to its detail (the layer it was found on)."""
        return Miss(self.kind, f"{self.detail} ({suffix})")

    def __str__(self) -> str:
        return self.detail


@dataclass(frozen=True)
class Unmatched:
    """One key that did not land. Read as `u.reason`/`u.kind` (or `u["reason"]`, as the dicts it replaces)."""

    adapter: str
    key: str
    miss: Miss

    @property
    def kind(self) -> str:
        return self.miss.kind

    @property
    def reason(self) -> str:
        return self.miss.detail

    def __getitem__(self, name: str) -> str:
        if name not in ("adapter", "key", "reason", "kind"):
            raise KeyError(name)
        return getattr(self, name)

    def to_dict(self) -> dict[str, str]:
        return {"adapter": self.adapter, "key": self.key, "reason": self.reason, "kind": self.kind}


@dataclass(frozen=True)
class Skipped:
    """One key the request left aside on purpose (a model-only loader: text-encoder keys). Not a miss:
    reports count it apart and strict does not refuse it."""

    adapter: str
    key: str
    component: str  # the pipeline component the key addresses (text_encoder, text_encoder_2, ...)
    why: str  # short, e.g. "model-only"

    def to_dict(self) -> dict[str, str]:
        return {"adapter": self.adapter, "key": self.key, "component": self.component, "why": self.why}
