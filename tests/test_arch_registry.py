"""The architecture registry: every record fills each facet it claims consistently (facet checks over the
whole registry), and an architecture declared in one file (tests/helpers/toy_arch.py) is picked up by
detection, the catalog, the block maps and the support matrix script once registered."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from helpers.toy_arch import TOY, TOY_TABLE, ToyTransformer, toy_lora

import loraweave
from loraweave.arch import registry
from loraweave.arch.aliases import AliasTable, metadata_alpha_of
from loraweave.arch.blocks import block_slots, block_weights, chain_lengths, detect_block_arch, slot_names
from loraweave.arch.catalog import CATALOG, build_meta, canonical
from loraweave.arch.detect import detect_architecture
from loraweave.arch.spec import Piece
from loraweave.formats.blocks import CHAINS, block_counts
from loraweave.formats.keys import underscore_form

ROOT = Path(__file__).resolve().parents[1]
RECORDS = list(registry.ARCHITECTURES)
NAMES = [a.name for a in RECORDS]


def _table_names(arch) -> list[str]:
    """Underscore forms of every name the record's tables map (original sources and live targets) or refuse
    (unmapped), split by columns or interleave, block 0."""
    out = []
    for table in arch.tables:
        for alias in (*table.aliases, *table.runtime_fusions):
            targets = [t if isinstance(t, str) else t.module for t in alias.targets]
            out += [underscore_form(n.replace("{i}", "0")) for n in (alias.source, *targets)]
        out += [underscore_form(p.source.replace("{i}", "0")) for p in table.parameters]
        out += [underscore_form(n.replace("{i}", "0")) for u in table.unmapped for n in (*u.names, u.anchor)]
        out += [
            underscore_form(n.replace("{i}", "0"))
            for c in table.column_splits
            for n in (*c.sources, *c.targets)
        ]
        out += [underscore_form(n.replace("{i}", "0")) for e in table.interleaved_rows for n in e.names]
    return out


def _branches(pattern: str) -> list[str]:
    """The top-level alternatives of a regex (`a|b(c|d)` -> `a`, `b(c|d)`)."""
    out, depth, current = [], 0, ""
    for ch in pattern:
        depth += (ch == "(") - (ch == ")")
        if ch == "|" and depth == 0:
            out.append(current)
            current = ""
        else:
            current += ch
    return [*out, current]


def test_names_are_unique_and_every_record_says_something():
    assert len(NAMES) == len(set(NAMES))
    for arch in RECORDS:
        assert arch.tables or arch.signature or arch.skeleton or arch.widths, arch.name


@pytest.mark.parametrize("arch", RECORDS, ids=NAMES)
def test_facets_are_consistent(arch):
    position = NAMES.index(arch.name)
    if arch.signature:
        re.compile(arch.signature)
        # Each alternative names keys its table maps (no names where the table is substring renames only:
        # LTX-2, Anima, Wan-Animate-2).
        names = _table_names(arch)
        for branch in _branches(arch.signature) if names else ():
            assert any(re.search(branch, n) for n in names), f"{arch.name}: {branch!r} matches no table name"
    # Owners are registered and more specific (earlier in the registry): folds run most general first.
    for owner in arch.owners:
        assert owner in NAMES and NAMES.index(owner) < position, (arch.name, owner)
    if arch.widths:
        re.compile(arch.widths.pattern)
        for width, release in arch.widths.names.items():
            assert width > 0 and release in NAMES, (arch.name, release)
    if arch.depth:
        family, chains = arch.depth
        family_record = registry.by_name()[family]
        assert family_record.depth and family_record.depth[0] == family, (
            f"{family} declares no depth of its own"
        )
        assert set(chains) <= set(CHAINS) and all(n > 0 for n in chains.values()), chains
        if family != arch.name:  # told apart by going deeper: it must reach past the family in some chain
            assert any(n > family_record.depth[1].get(c, 0) for c, n in chains.items()), arch.name
    for alias in arch.cli_names:  # resolves back to this record; shadows no catalog entry (a family name may)
        assert alias not in CATALOG and canonical(alias) == arch.name, alias
    if arch.skeleton:
        import diffusers

        assert CATALOG[arch.name].cls == arch.skeleton.cls and hasattr(diffusers, arch.skeleton.cls)
        assert arch.skeleton.denoiser in ("unet", "transformer")
    if arch.tables and arch.skeleton:  # its own table applies to the class its skeleton builds
        assert arch.skeleton.cls in arch.tables[0].classes, arch.name
    if arch.metadata_alpha:
        module = type(arch.tables[0].classes[0], (torch.nn.Module,), {})()
        assert metadata_alpha_of(module) == arch.metadata_alpha
    for facet in (arch.layouts, arch.not_mapped):
        for test_file in re.findall(r"test_\w+\.py", str(facet or "")):
            assert (ROOT / "tests" / test_file).is_file(), test_file
    if arch.blocks:
        assert arch.skeleton is not None, f"{arch.name}: a block map needs the skeleton it slots"
        assert bool(arch.blocks.chains) != bool(arch.blocks.unet), arch.name
    if arch.comfy:  # ComfyUI models resolve on the catalog skeleton's tree, at the model's widths
        assert arch.skeleton is not None and arch.comfy.classes, arch.name
        assert arch.comfy.skeleton in (None, arch.name), arch.name  # comfy/skeletons/<its name>.json
    for release in arch.releases:  # chains the file reader counts, and a skeleton the catalog has
        assert release.chains and set(release.chains) <= set(CHAINS), (arch.name, release.name)
        assert release.hidden > 0 and all(n > 0 for n in release.chains.values()), release.name
        assert release.catalog is None or release.catalog in CATALOG, release.catalog


def test_each_comfy_class_names_one_architecture():
    classes = [c for a in RECORDS if a.comfy for c in a.comfy.classes]
    assert len(classes) == len(set(classes)), sorted(c for c in classes if classes.count(c) > 1)


RELEASES = [(a.name, r) for a in RECORDS for r in a.releases if r.catalog]


@pytest.mark.parametrize("arch,release", RELEASES, ids=[r.catalog for _, r in RELEASES])
def test_a_release_is_its_catalog_skeleton(arch, release):
    """A release that names a skeleton has that skeleton's block counts and hidden width (on the meta
    device)."""
    model = build_meta(release.catalog, text_encoders=False)[CATALOG[release.catalog].denoiser]
    assert block_counts([n for n, _ in model.named_modules()]) == release.chains
    assert model.config.num_attention_heads * model.config.attention_head_dim == release.hidden


@pytest.mark.parametrize("arch", [a for a in RECORDS if a.blocks], ids=[a.name for a in RECORDS if a.blocks])
def test_block_map_slots_exist_in_the_skeleton(arch):
    """The block arch of the full-size skeleton is this map's, and every chain it slots is in the skeleton."""
    model = build_meta(arch.name, text_encoders=False)[arch.skeleton.denoiser]
    assert detect_block_arch(model) == arch.blocks.key
    paths = [name for name, _ in model.named_modules()]
    lengths = chain_lengths(arch.blocks.key, paths)
    for _, chain, _ in arch.blocks.chains:
        assert lengths.get(chain, 0) > 0, (arch.name, chain)
    slots = set(slot_names(arch.blocks.key, lengths or None))
    assert set(block_slots(arch.blocks.key, paths).values()) <= slots | {None}


WITH_INPUTS = [a for a in RECORDS if a.skeleton and any(t.model_inputs for t in a.tables)]


@pytest.mark.parametrize("arch", WITH_INPUTS, ids=[a.name for a in WITH_INPUTS])
def test_model_inputs_name_the_skeletons_input_and_its_latents(arch):
    """A declared model input (arch/spec.py ModelInput) is a Linear of the full-size skeleton taking the
    latents its `latents` module gives back, recorded under its config key: the base every other width of an
    adapter is told by."""
    model = build_meta(arch.name, text_encoders=False)[arch.skeleton.denoiser]
    table = AliasTable(model)
    assert table.model_inputs, arch.name
    for declared in table.model_inputs.values():
        module = model.get_submodule(declared.module)
        assert isinstance(module, torch.nn.Linear), (arch.name, declared.module)
        assert table.latent_width(declared) == module.in_features == model.config[declared.config_key]


def _support_matrix_rows() -> list[str]:
    spec = importlib.util.spec_from_file_location("support_matrix", ROOT / "scripts" / "support_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.original_layouts()


def test_a_toy_architecture_in_one_file_is_picked_up_everywhere():
    adapter = loraweave.load_adapter(toy_lora())
    assert detect_architecture(adapter).architecture == "unknown"
    assert "toy-dit" not in CATALOG and not any("toy-dit" in row for row in _support_matrix_rows())
    with registry.registered(TOY, before="unet"):
        detection = detect_architecture(adapter)
        assert detection.architecture == "toy-dit", detection.evidence
        assert detection.scores == {"toy-dit": 8}
        # the catalog and its CLI names
        assert canonical("toy") == canonical("TOY-1") == "toy-dit"
        assert CATALOG["toy-dit"].cls == "ToyTransformer" and CATALOG["toy-dit"].config == {
            "width": 8,
            "depth": 4,
        }
        # the block map
        model = ToyTransformer()
        assert detect_block_arch(model) == "toy"
        assert slot_names("toy") == ["BASE", "T00", "T01", "T02", "T03"]
        slots = block_slots("toy", [n for n, _ in model.named_modules() if n])
        assert slots["toy_blocks.2.mix"] == "T02" and slots["proj_in"] == "BASE"
        assert block_weights("toy", "OUTS")["T03"] == 1.0
        # the support matrix's listing
        assert any(row.startswith("| toy-dit | toy names") for row in _support_matrix_rows())
    assert detect_architecture(adapter).architecture == "unknown" and "toy-dit" not in CATALOG
    with pytest.raises(ValueError, match="unknown block arch"):
        slot_names("toy")


@pytest.mark.parametrize(
    "record,before,match",
    [
        (TOY, "no-such-arch", "no such architecture"),
        (registry.by_name()["flux"], None, "registered already"),
    ],
    ids=["unknown-before", "duplicate-name"],
)
def test_registering_a_bad_record_is_refused_and_changes_nothing(record, before, match):
    names = [a.name for a in registry.ARCHITECTURES]
    with pytest.raises(loraweave.ArgumentError, match=match), registry.registered(record, before=before):
        pass
    assert [a.name for a in registry.ARCHITECTURES] == names


def test_a_registered_records_alias_tables_hold_for_its_duration_only():
    """registered() takes the record's alias tables with it: while it is in, arch.aliases maps the toy's
    original fused name onto its two modules (mix rows then gate rows); before and after, nothing does."""
    fused = "blocks.1.mix_gate"
    assert TOY_TABLE not in registry.arch_tables() and AliasTable(ToyTransformer()).lookup(fused) is None
    with registry.registered(TOY, before="unet"):
        assert TOY_TABLE in registry.arch_tables()
        assert AliasTable(ToyTransformer()).lookup(fused) == (
            Piece("toy_blocks.1.mix", 0, 0, 8, True),
            Piece("toy_blocks.1.gate", 8, 0, 8, True),
        )
    assert TOY_TABLE not in registry.arch_tables() and AliasTable(ToyTransformer()).lookup(fused) is None
    assert registry.arch_tables() == tuple(t for a in registry.ARCHITECTURES for t in a.tables[:1]) + tuple(
        t for a in registry.ARCHITECTURES for t in a.tables[1:]
    )
