"""Loud coverage: one WARNING line per adapter that did not fully land, and a typed error when none of it did.

A LoRA that silently does nothing is the complaint users raise most about every loader; every face refuses
through `engine.decide.refuse` after planning and before touching the model, so a refusal changes nothing."""

from __future__ import annotations

import logging
from collections import Counter

from ..errors import NoKeysLandedError
from .report import failures

log = logging.getLogger("loraweave")
TOP_KINDS = 3  # miss kinds named per WARNING line


def miss_kind(miss) -> str:
    """The kind of a miss (an Unmatched, or inspect's dict with the same fields): typed where it was made."""
    return miss["kind"]


def _field(miss, name: str) -> str:
    try:
        return miss[name]
    except KeyError:
        return ""


def adapter_misses(report, name: str) -> list:
    return [u for u in report.unmatched if _field(u, "adapter") == name]


def coverage_line(summary: dict, misses: list[dict]) -> str:
    """`adapter=NAME landed=A/T [skipped=S] misses=kind×n,... example=KEY (reason)` for one adapter."""
    kinds = Counter(miss_kind(u) for u in misses).most_common()
    shown = ",".join(f"{k.replace(' ', '_')}x{n}" for k, n in kinds[:TOP_KINDS])
    if len(kinds) > TOP_KINDS:
        shown += f",+{len(kinds) - TOP_KINDS}_more_kinds"
    example = f" example={misses[0]['key']!r} ({misses[0]['reason']})" if misses else ""
    skipped = summary.get("keys_skipped", 0)  # left aside on purpose (model-only: text encoders)
    return (
        f"adapter={summary['name']!r} landed={summary['keys_applied']}/{summary['keys_total']} "
        f"{f'skipped={skipped} ' if skipped else ''}misses={shown or '-'}{example}"
    )


def _short(summary: dict) -> bool:
    return summary["keys_applied"] < summary["keys_total"] or summary["keys_total"] == 0


EMPTY_OPT_IN = "Pass allow_empty=True to apply anyway"


def refuse_empty(report, allow_empty: bool = False, opt_in: str | None = EMPTY_OPT_IN) -> None:
    """NoKeysLandedError (carrying `report`) when some adapter landed no key, unless `allow_empty`. `opt_in`:
    how the face offers allow_empty, for the message (None: it offers none)."""
    empty = [
        coverage_line(s, adapter_misses(report, s["name"]))
        for s in report.adapters
        if s["keys_applied"] == 0 and not allow_empty
    ]
    if empty:
        hint = f" {opt_in}" if opt_in else ""
        raise NoKeysLandedError(
            f"no key landed for {len(empty)} adapter(s), nothing was changed: {'; '.join(empty)}. Wrong base "
            f"model?{hint} (the report lists every miss).",
            report,
        )


def warn_incomplete(report) -> None:
    """One WARNING line per adapter that did not fully land (keys expected absent on this variant do not
    count)."""
    for summary in report.adapters:
        if _short(summary) and (
            summary["keys_total"] == 0 or failures(adapter_misses(report, summary["name"]))
        ):
            log.warning(
                "loraweave incomplete %s", coverage_line(summary, adapter_misses(report, summary["name"]))
            )
