"""Random sequences of apply / set_strength / switch / remove over several handles (merge and runtime, LoRA,
LoHa, LoKr, full diff, DoRA, OFT, the same file twice, removal in the wrong order):
- whenever every handle is removed, the model is bit-identical to the pristine one and hook-free;
- at random checkpoints the model equals one fresh merge of everything live (within 1e-5).
LORAWEAVE_SEQUENCE_SEEDS / LORAWEAVE_SEQUENCE_STEPS set the amount (CI: small)."""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch
from helpers.common import rel_err
from safetensors.torch import save_file
from torch import nn

import loraweave

SEEDS = int(os.environ.get("LORAWEAVE_SEQUENCE_SEEDS", "3"))
STEPS = int(os.environ.get("LORAWEAVE_SEQUENCE_STEPS", "50"))
LINEAR = {"lora", "loha", "lokr", "full"}  # deltas that add up whichever handle holds them


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x, img):
        return self.fc3(self.fc2(self.fc1(x))), self.conv(img)


def family_sd(family: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.2):
        return torch.randn(*shape, generator=g) * s

    if family == "lora":
        return {
            "fc1.lora_down.weight": r(2, 8),
            "fc1.lora_up.weight": r(8, 2),
            "fc2.lora_down.weight": r(2, 8),
            "fc2.lora_up.weight": r(8, 2),
            "conv.lora_down.weight": r(2, 4, 3, 3),
            "conv.lora_up.weight": r(4, 2, 1, 1),
        }
    if family == "loha":
        return {
            f"{m}.{k}": r(*s)
            for m in ("fc2", "fc3")
            for k, s in (
                ("hada_w1_a", (8, 2)),
                ("hada_w1_b", (2, 8)),
                ("hada_w2_a", (8, 2)),
                ("hada_w2_b", (2, 8)),
            )
        }
    if family == "lokr":
        return {
            "fc1.lokr_w1": r(2, 2),
            "fc1.lokr_w2": r(4, 4),
            "fc3.lokr_w1": r(2, 2),
            "fc3.lokr_w2": r(4, 4),
        }
    if family == "full":
        return {"fc2.diff": r(8, 8, s=0.05), "fc2.diff_b": r(8, s=0.05)}
    if family == "dora":
        return {
            "fc1.lora_down.weight": r(2, 8),
            "fc1.lora_up.weight": r(8, 2),
            "fc1.dora_scale": r(8, 1).abs() + 0.5,
        }
    assert family == "oft"
    return {"fc3.oft_blocks": r(2, 4, 4), "fc3.alpha": torch.tensor(0.0)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("seq")
    out = {}
    for i, family in enumerate(["lora", "loha", "lokr", "full", "dora", "oft"]):
        path = root / f"{family}.safetensors"
        save_file(family_sd(family, 10 + i), str(path))
        out[family] = str(path)
    return out


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def outputs(model):
    g = torch.Generator().manual_seed(3)
    x, img = torch.randn(3, 8, generator=g), torch.randn(2, 4, 5, 5, generator=g)
    with torch.no_grad():
        return model(x, img)


class Live:
    """One handle and the (family, strength) list it should represent now."""

    def __init__(self, handle, items, mode) -> None:
        self.handle, self.items, self.mode = handle, items, mode


def random_set(rng: random.Random) -> list[tuple[str, float]]:
    families = rng.sample(["lora", "loha", "lokr", "full", "dora", "oft"], rng.randint(1, 3))
    if rng.random() < 0.3:
        families.append(families[0])  # the same file twice
    return [(f, round(rng.uniform(-1.0, 1.5), 2)) for f in families]


def check_equal_to_fresh(model, pristine, live: list[Live], files) -> None:
    items = [(files[f], s) for entry in live for f, s in entry.items]
    fresh = copy.deepcopy(pristine)
    loraweave.apply(fresh, items, mode="merge")
    for ours, ref in zip(outputs(model), outputs(fresh), strict=True):
        assert rel_err(ours, ref) <= 1e-5, [e.items for e in live]


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_operation_sequences(files, seed):
    rng = random.Random(seed)
    pristine = Model()
    model = copy.deepcopy(pristine)
    clean = state(pristine)
    live: list[Live] = []
    seen = {"checks": 0, "remove_all": 0, "refused": 0}
    for _ in range(STEPS):
        op = rng.choice(["apply", "apply", "set_strength", "switch", "remove", "remove", "check"])
        if op == "apply" and len(live) < 3:
            items, mode = random_set(rng), rng.choice(["merge", "runtime"])
            live.append(
                Live(loraweave.apply(model, [(files[f], s) for f, s in items], mode=mode), items, mode)
            )
        elif op == "set_strength" and live:
            entry = rng.choice(live)
            names = [a["name"] for a in entry.handle.report.adapters]
            i = rng.randrange(len(names))
            value = round(rng.uniform(-1.0, 1.5), 2)
            try:
                entry.handle.set_strength(names[i], value)
            except RuntimeError:  # a later handle merged over it: refused, nothing changed
                continue
            entry.items[i] = (entry.items[i][0], value)
        elif op == "switch" and live:
            entry = rng.choice(live)
            items = random_set(rng)
            try:
                entry.handle.switch([(files[f], s) for f, s in items])
            except RuntimeError:  # buried under a later merge: refused before anything changed
                continue
            entry.items = items
        elif op == "remove" and live:
            entry = rng.choice(live)  # any order: a buried merge refuses, the model stays as it was
            before = state(model)
            try:
                entry.handle.remove()
            except RuntimeError:
                now = state(model)
                assert all(torch.equal(now[k], before[k]) for k in before)
                seen["refused"] += 1
                continue
            live.remove(entry)
            if not live:
                seen["remove_all"] += 1
                now = state(model)
                assert all(torch.equal(now[k], clean[k]) for k in clean)
                assert all(not m._forward_hooks and "forward" not in m.__dict__ for m in model.modules())
        elif op == "check" and live:
            families = {f for e in live for f, _ in e.items}
            if len(live) == 1 or families <= LINEAR:  # W-dependent deltas of two handles do not simply add up
                check_equal_to_fresh(model, pristine, live, files)
                seen["checks"] += 1
    for entry in reversed(live):  # newest first: always undoable
        entry.handle.remove()
    now = state(model)
    assert all(torch.equal(now[k], clean[k]) for k in clean)
    assert seen["checks"] and seen["remove_all"], seen  # the sequence exercised both checks
