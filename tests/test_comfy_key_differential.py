"""The differential against ComfyUI's key maps: every key ComfyUI's own `model_lora_keys_unet` /
`model_lora_keys_clip` land on the real module tree of a tiny ComfyUI model of each class loraweave maps, in
every layout they recognise, lands through loraweave's ComfyUI planner on the same weight and rows, or is a
miss named with its reason in helpers.key_differential.NAMED_MISSES (and in docs/support-matrix.md); every
key diffusers 0.42.1's converters turn into a module of the diffusers twin (fed the same model's original
names) lands through loraweave on that twin on the same rows.

Runs on the newest tree only (LORAWEAVE_COMFYUI=latest): v0.19.3's maps are a subset of its maps (Krea 2,
ERNIE-Image `transformer.`, the bare LTX names and the single-LLM `lora_te_` map were added since, nothing was
removed: comfy/lora.py diffed), so the older pass would check nothing more and cost its CI time again.
Planning only: no weight is written, no forward runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.comfy_env import COMFYUI_TREE, REPO_ROOT, import_comfy
from helpers.key_differential import (
    CONVERTERS,
    NAMED_MISSES,
    TABLE_HEADING,
    all_results,
    table_lines,
    unnamed,
)

pytestmark = pytest.mark.skipif(
    COMFYUI_TREE != "latest",
    reason="the differential runs on the newest ComfyUI tree (a superset of v0.19.3's)",
)


@pytest.fixture(scope="module")
def all_():
    import_comfy()
    return all_results()


def test_every_key_diffusers_converters_land_lands_on_the_same_rows(all_):
    assert {r.case for r in all_.diffusers} == set(CONVERTERS)
    assert all(r.lands >= r.modules // 2 for r in all_.diffusers), [(r.case, r.lands) for r in all_.diffusers]
    assert all(not r.missed and not r.wrong for r in all_.diffusers), [
        (r.case, r.missed[:3], r.wrong[:3]) for r in all_.diffusers if r.missed or r.wrong
    ]


def test_every_key_comfyui_lands_lands_on_the_same_rows(all_):
    results = all_.comfy
    assert len({r.case for r in results}) >= 25, sorted({r.case for r in results})
    assert sum(r.comfy for r in results) > 3000
    missed = {f"{r.case} {r.layout}": unnamed(r)[:4] for r in results if unnamed(r)}
    assert not missed, missed
    wrong = {f"{r.case} {r.layout}": r.wrong[:2] for r in results if r.wrong}
    assert not wrong, wrong


def test_each_named_miss_still_occurs(all_):
    # A named miss that no key shows any more is stale (fixed, or ComfyUI changed): its row must go.
    for case, named in NAMED_MISSES.items():
        keys = [k for r in all_.comfy if r.case == case for k in r.missed]
        for n in named:
            assert any(re.fullmatch(n.pattern, k) for k in keys), (case, n.why)


def test_support_matrix_section_is_the_generated_one(all_):
    text = (REPO_ROOT / "docs" / "support-matrix.md").read_text()
    lines = text.splitlines()
    assert [ln for ln in lines if ln.startswith("## Keys ComfyUI")] == [TABLE_HEADING], "run the script"
    start = lines.index(TABLE_HEADING)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    committed = lines[start:end]
    while committed and not committed[-1]:
        committed.pop()
    assert committed == table_lines(all_), "docs/support-matrix.md is stale: run scripts/support_matrix.py"


def test_the_support_matrix_script_writes_this_section():
    script = Path(REPO_ROOT / "scripts" / "support_matrix.py").read_text()
    assert "key_differential" in script
