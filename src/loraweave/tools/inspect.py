"""`inspect`: what an adapter file is (layout, families, ranks, alphas, dtypes, metadata, architecture with
its evidence) and how much of it lands on a model: every key resolved against a full-size meta model or a
checkpoint."""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from ..arch.detect import detect_architecture
from ..arch.variants import variant_fit, variants
from ..formats.adapter import Adapter, load_adapter
from ..report.report import failures
from .target import by_variant, model_target, shape_only, unet_fit

if TYPE_CHECKING:
    pass

log = logging.getLogger("loraweave")

# Training metadata that says what the file is; the rest (tag frequencies, bucket info, hashes) is noise here.
SHOWN_METADATA = (
    "ss_network_module",
    "ss_network_dim",
    "ss_network_alpha",
    "ss_network_args",
    "ss_base_model_version",
    "ss_sd_model_name",
    "ss_v2",
    "ss_output_name",
    "modelspec.architecture",
    "modelspec.title",
    "modelspec.implementation",
    "software",
    "format",
    "lora_adapter_metadata",
    "loraweave.baked",
    "loraweave.converted",
    "loraweave.extracted",
)
MAX_METADATA_CHARS = 300
# Role whose first dimension is the rank, per family.
RANK_ROLES = ("down", "hada_w1_b", "lokr_w1_b", "lokr_w2_b", "a1")


def _dtype(adapter: Adapter, key: str) -> str:
    source = adapter.source
    if hasattr(source, "dtype_name"):  # from the header: no torch import
        return source.dtype_name(key)
    dtype = source.dtype(key) if hasattr(source, "dtype") else adapter.tensor(key).dtype
    return str(dtype).removeprefix("torch.")


def _rank(adapter: Adapter, part) -> int | None:
    for role in RANK_ROLES:
        if role in part.roles:
            shape = adapter.shape(part.roles[role])
            return int(shape[0]) if shape else None
    return None


def _alpha(adapter: Adapter, part) -> float | None:
    key = part.roles.get("alpha")
    if key is None:
        return None
    value = (
        adapter.source.scalar(key) if hasattr(adapter.source, "scalar") else None
    )  # from the bytes: no torch
    if value is not None:
        return value
    t = adapter.tensor(key)
    return float(t.reshape(-1)[0].float()) if t.numel() >= 1 else None


def describe(adapter: Adapter) -> dict:
    """Shape facts about the file alone (no model needed)."""
    ranks = Counter(r for p in adapter.parts if (r := _rank(adapter, p)) is not None)
    alphas = Counter(a for p in adapter.parts if (a := _alpha(adapter, p)) is not None)
    keys = [k for p in adapter.parts for k in p.keys] + [u["key"] for u in adapter.unparsed]
    meta = {
        k: v if len(v) <= MAX_METADATA_CHARS else v[:MAX_METADATA_CHARS] + "..."
        for k, v in adapter.metadata.items()
        if k in SHOWN_METADATA
    }
    alpha_note = (
        "alpha tensors"
        if alphas
        else (
            "metadata"
            if not adapter.meta_alpha.empty
            else "none (scale 1 unless the loader assumes otherwise)"
        )
    )
    return {
        "name": adapter.name,
        "path": adapter.path,
        "layout": adapter.layout,
        "families": adapter.families,
        "parts": len(adapter.parts),
        "keys_total": adapter.keys_total,
        "components": sorted({p.component for p in adapter.parts}),
        "ranks": {str(k): v for k, v in sorted(ranks.items())},
        "alphas": {f"{k:g}": v for k, v in sorted(alphas.items())},
        "alpha_from": alpha_note,
        "dtypes": dict(Counter(_dtype(adapter, k) for k in keys)),
        "metadata": meta,
        "metadata_keys": sorted(adapter.metadata),
        "unparsed": adapter.unparsed,
    }


def _unresolved_coverage(adapter: Adapter, against: str) -> dict:
    """Coverage when no model could be built: every key unmatched, with why."""
    unmatched = [
        {"key": k, "reason": f"not resolved: {against}", "kind": "not_resolved"}
        for p in adapter.parts
        for k in p.keys
    ]
    unmatched += [
        {"key": u["key"], "reason": f"not parsed: {u['reason']}", "kind": "not_parsed"}
        for u in adapter.unparsed
    ]
    return {
        "against": None,
        "keys_total": adapter.keys_total,
        "keys_applied": 0,
        "unmatched": unmatched,
    }


def _planned_coverage(
    adapter: Adapter, components, against: str, model: str | None, fit_report, check_values: bool
) -> dict:
    """Coverage from a plan against the model (shape-only unless `check_values`)."""
    from ..api import plan
    from .skeleton import alias_tables

    tables = alias_tables(components) if model is None else None
    if fit_report is not None and not check_values:  # the same shape-only plan on the same skeleton
        report = fit_report
    else:
        report = plan(components, adapter if check_values else shape_only(adapter), tables=tables)
    return {
        "against": against,
        "keys_total": report.keys_total,
        "keys_applied": report.keys_applied,
        "unmatched": [{"key": u.key, "reason": u.reason, "kind": u.kind} for u in report.unmatched],
        "modules": dict(Counter(m.component for m in report.applied)),
        "alpha_sources": report.adapters[0]["alpha_sources"] if report.adapters else {},
        "values_checked": check_values,
    }


def inspect_adapter(
    path: str | Path,
    arch: str | None = None,
    model: str | None = None,
    allow_pickle: bool = False,
    text_encoders: bool = True,
    check_values: bool = False,
    coverage: bool = True,
) -> dict:
    """Everything `loraweave inspect` shows, as one JSON-ready dict (keys `layout`, `families`,
    `architecture`, `coverage` are the public contract). coverage=False: the file alone (no model, no torch
    import); `coverage` then says `checked: false` and has no counts of landed keys."""
    t0 = time.perf_counter()
    adapter = load_adapter(path, allow_pickle=allow_pickle)
    info = describe(adapter)
    detection = detect_architecture(adapter)
    info["architecture"] = {
        "name": detection.architecture,
        "evidence": detection.evidence,
        "scores": detection.scores,
        "metadata_says": detection.metadata,
    }
    info["architecture_evidence"] = detection.evidence  # the pre-contract key, kept for older callers
    info["variant"] = variant_fit(adapter)
    detection = by_variant(detection, info["variant"], arch, model)
    info["architecture"]["name"] = detection.architecture
    info["variant"] = variant_fit(
        adapter, arch or detection.architecture
    )  # releases of what it was found to be
    if not coverage:
        info["coverage"] = {
            "checked": False,
            "against": None,
            "keys_total": adapter.keys_total,
            "keys_applied": None,
            "unmatched": [],
            "complete": None,
        }
        info["seconds"] = round(time.perf_counter() - t0, 3)
        return info
    fit_report = None
    if detection.architecture == "unet" and arch is None and model is None:
        detection, fit_report = unet_fit(adapter, detection, text_encoders)
        info["architecture"]["name"] = detection.architecture
    components, against = model_target(arch, model, detection.architecture, text_encoders)
    if components is None:
        covered = _unresolved_coverage(adapter, against)
    else:
        if (
            model is not None
        ):  # a checkpoint's shadow tree has no classes to count positions in: name them first
            from .positional import name_positional

            adapter = name_positional(adapter, arch)
        covered = _planned_coverage(adapter, components, against, model, fit_report, check_values)
    covered["unmatched_by_kind"] = dict(Counter(u["kind"] for u in covered["unmatched"]))
    covered["complete"] = not failures(covered["unmatched"])
    covered["checked"] = True
    info["coverage"] = covered
    if model is None and components is not None and covered["keys_applied"] == covered["keys_total"]:
        target = arch or detection.architecture
        info["variant"] = variant_fit(adapter, target, landed=target)
    info["seconds"] = round(time.perf_counter() - t0, 3)
    log.info(
        "inspect file=%s layout=%s arch=%s keys_applied=%d/%d seconds=%.3f",
        adapter.name,
        adapter.layout,
        detection.architecture,
        covered["keys_applied"],
        covered["keys_total"],
        info["seconds"],
    )
    return info


CLI_MORE = "--limit, or --json for all"  # how the CLI shows the unmatched keys past `limit`


def format_table(info: dict, limit: int = 20, more: str | None = CLI_MORE) -> str:
    """Readable multi-line summary of `inspect_adapter`'s dict; `more`: how to see the unmatched keys past
    `limit` (None: the count alone)."""
    cov = info["coverage"]
    rows = _file_rows(info) + _variant_rows(info) + [(f"  {k}", v) for k, v in info["metadata"].items()]
    rows += _coverage_rows(cov)
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for u in cov["unmatched"][:limit]:
        lines.append(f"    {u['key']}: {u['reason']}")
    if len(cov["unmatched"]) > limit:
        hint = f" ({more})" if more else ""
        lines.append(f"    ... {len(cov['unmatched']) - limit} more{hint}")
    return "\n".join(lines)


def _tally(counts: dict) -> str:
    """{"a": 2, "b": 1} -> "a x2, b x1" ("" when empty)."""
    return ", ".join(f"{k} x{v}" for k, v in counts.items())


def _file_rows(info: dict) -> list[tuple[str, str]]:
    """What the file is: layout, families, ranks, alphas, dtypes, components, architecture and its
    evidence."""
    rows = [
        ("file", info["path"] or info["name"]),
        ("layout", info["layout"]),
        ("families", _tally(info["families"]) or "-"),
        ("ranks", _tally(info["ranks"]) or "-"),
        ("alphas", _tally(info["alphas"]) or info["alpha_from"]),
        ("dtypes", _tally(info["dtypes"])),
        ("components", ", ".join(info["components"]) or "-"),
        ("architecture", info["architecture"]["name"]),
    ]
    return rows + [("  evidence", e) for e in info["architecture"]["evidence"]]


def _variant_rows(info: dict) -> list[tuple[str, str]]:
    """The model variant the file's block counts fit, if the architecture has variants."""
    variant = info.get("variant") or {}
    # "no known variant" only says something for the families arch.variants lists (not SD3's or LTX-2's
    # blocks)
    varied = variant.get("fits") or any(info["architecture"]["name"].startswith(v.arch) for v in variants())
    if not (variant.get("blocks") and varied):
        return []
    named = variant.get("named", {})
    words = [_chain_words(c, n, named.get(c)) for c, n in variant["blocks"].items()]
    if all(w.startswith(f"{n} ") for w, n in zip(words, variant["blocks"].values(), strict=True)):
        blocks = ", ".join(w.removesuffix(" blocks") for w in words) + " blocks"  # 8 double, 24 single blocks
    else:
        blocks = ", ".join(words)
    fits = variant["likely"] or (", ".join(variant["fits"]) if variant["fits"] else "no known variant")
    landed = f"; every key lands on the {variant['landed']} skeleton" if variant.get("landed") else ""
    return [("  variant", f"{fits} (file: {blocks}, width {variant['hidden']}{landed})")]


def _chain_words(chain: str, count: int, named: list[int] | None) -> str:
    """`38 single blocks` when the file names blocks 0..37, else which it names (`single blocks 7-20`): blocks
    7-20 do not make a 21-block file."""
    if named is None or (named[0] == 0 and named[2] == count):
        return f"{count} {chain} blocks"
    first, last, n = named
    span = f"{chain} blocks {first}-{last}" if first != last else f"{chain} block {first}"
    return span if n == last - first + 1 else f"{span} ({n} of them)"


def _coverage_rows(cov: dict) -> list[tuple[str, str]]:
    """How many keys land (or that coverage was not checked), alpha sources, unmatched keys by kind."""
    if not cov.get("checked", True):
        rows = [("coverage", f"not checked ({cov['keys_total']} keys; drop --no-coverage to resolve them)")]
    else:
        against = f" on {cov['against']}" if cov["against"] else ""
        rows = [("coverage", f"{cov['keys_applied']}/{cov['keys_total']} keys land{against}")]
    # what the count cannot tell (LoraWeave Inspect on a MODEL loraweave has no reference for)
    if cov.get("note"):
        rows.append(("  note", cov["note"]))
    if cov.get("alpha_sources"):
        rows.append(("  alpha from", _tally(cov["alpha_sources"])))
    rows += [("  unmatched", f"{n} x {reason}") for reason, n in cov.get("unmatched_by_kind", {}).items()]
    # keys left aside on purpose (LoraWeave Inspect on a MODEL without a CLIP: text encoders, model-only)
    rows += [
        ("  skipped", f"{component}={n} (model-only)")
        for component, n in cov.get("skipped_by_component", {}).items()
    ]
    return rows
