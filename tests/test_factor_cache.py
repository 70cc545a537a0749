"""Hosted-factor cache: a replay is bit-identical to a fresh compute, strength changes miss, a corrupted or
old-format entry is recomputed, budget 0 writes nothing, the budget evicts least-recently-used entries."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.sdnq_models import OUT_A, OUT_B, float_model, lokr, quantized
from safetensors.torch import load_file, save_file

import loraweave
from loraweave.mechanisms.runtime.factor_cache import FactorCache

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")

RANK = 16


def adapters() -> dict:
    (sa, _), (sb, _) = lokr("a", OUT_A, 60, scale=0.05), lokr("b", OUT_B, 61, scale=0.05)
    return sa | sb


def side_channel(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {
        n: (model.get_submodule(n).svd_up.clone(), model.get_submodule(n).svd_down.clone())
        for n in ("a", "b")
    }


def hosted(model, cache, strength: float = 1.0):
    handle = loraweave.apply(
        model, (adapters(), strength), mode="merge", host_rank=RANK, cache=cache, strict=True
    )
    assert {m.mechanism for m in handle.report.applied} == {"hosted"}
    return handle


def hits(handle) -> list[bool | None]:
    return [m.cache_hit for m in handle.report.applied]


def entries(root) -> list:
    return sorted(p for p in root.iterdir() if p.suffix == ".safetensors") if root.is_dir() else []


def test_replay_is_bit_identical_to_fresh(tmp_path):
    model = quantized(float_model(), "uint4")
    cache = FactorCache(tmp_path)
    fresh = hosted(model, cache)
    assert hits(fresh) == [False, False] and len(entries(tmp_path)) == 2
    first = side_channel(model)
    fresh.remove()
    assert model.a.svd_up is None
    replay = hosted(model, FactorCache(tmp_path))  # a new cache object: only the disk is shared
    assert hits(replay) == [True, True]
    for name, (up, down) in side_channel(model).items():
        assert torch.equal(up, first[name][0]) and torch.equal(down, first[name][1]), name
    assert [m.retention for m in replay.report.applied] == [m.retention for m in fresh.report.applied]
    replay.remove()
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]  # atomic writes leave no temp files


def test_a_strength_change_misses_and_set_strength_replays(tmp_path):
    model = quantized(float_model(), "uint4")
    cache = FactorCache(tmp_path)
    hosted(model, cache).remove()
    other = hosted(model, cache, strength=0.5)
    assert hits(other) == [False, False]
    name = other.report.adapters[0]["name"]
    other.set_strength(name, 1.0)  # back to the first configuration: its entries replay
    assert [m.cache_hit for m in other.quant_writes] == [True, True]
    other.remove()


def test_a_different_base_model_misses(tmp_path):
    cache = FactorCache(tmp_path)
    hosted(quantized(float_model(seed=0), "uint4"), cache).remove()
    other = hosted(quantized(float_model(seed=5), "uint4"), cache)
    assert hits(other) == [False, False]
    other.remove()


@pytest.mark.parametrize("damage", ["garbage", "old_format", "wrong_signature"])
def test_a_damaged_entry_is_recomputed_never_trusted(tmp_path, damage):
    model = quantized(float_model(), "uint4")
    hosted(model, FactorCache(tmp_path)).remove()
    first_files = entries(tmp_path)
    reference = hosted(model, FactorCache(tmp_path))
    want = side_channel(model)
    reference.remove()
    target = first_files[0]
    if damage == "garbage":
        target.write_bytes(b"\x00not a safetensors file" * 10)
    else:
        tensors = load_file(str(target))
        tensors["up_q"] = torch.zeros_like(tensors["up_q"])  # if it were trusted, the layer would change
        from safetensors import safe_open

        with safe_open(str(target), framework="pt") as f:
            meta = dict(f.metadata())
        if damage == "old_format":
            meta["fmt"] = "0"
        else:
            meta["sig"] = meta["sig"].replace('"host_rank": 16', '"host_rank": 17')
        save_file(tensors, str(target), metadata=meta)
    again = hosted(model, FactorCache(tmp_path))
    assert sorted(hits(again)) == [False, True]
    for name, (up, down) in side_channel(model).items():
        assert torch.equal(up, want[name][0]) and torch.equal(down, want[name][1]), name
    again.remove()
    assert load_file(str(target))["up_q"].abs().sum() > 0  # the entry was rewritten with good factors


def test_budget_zero_writes_nothing(tmp_path):
    root = tmp_path / "cache"
    model = quantized(float_model(), "uint4")
    handle = hosted(model, FactorCache(root, budget_bytes=0))
    assert hits(handle) == [False, False]
    assert not root.exists() or not any(root.iterdir())
    handle.remove()


def test_budget_evicts_least_recently_used(tmp_path):
    model = quantized(float_model(), "uint4")
    hosted(model, FactorCache(tmp_path)).remove()
    sizes = [p.stat().st_size for p in entries(tmp_path)]
    budget = max(sizes) + min(sizes) // 2  # room for one entry, not two
    for p in entries(tmp_path):
        p.unlink()
    cache = FactorCache(tmp_path, budget_bytes=budget)
    hosted(model, cache).remove()
    left = entries(tmp_path)
    assert len(left) == 1 and cache.size() <= budget
    # The survivor is the layer written last ("b"); the older entry ("a") was evicted.
    from safetensors import safe_open

    with safe_open(str(left[0]), framework="pt") as f:
        assert json.loads(f.metadata()["sig"])["layer"].endswith(".b")
