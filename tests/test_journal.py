"""The journal's failure paths under fault injection: a switch or strength change failing at any point leaves
the model clean (switch: no adapters; set_strength: the old strengths), never half-changed; undo runs every
entry."""

from __future__ import annotations

import pytest
import torch
from helpers.common import fail_on_call
from helpers.hostile_nets import Net, lora, no_hooks, same, state

import loraweave
import loraweave.engine.install
import loraweave.mechanisms.merge.layer
import loraweave.mechanisms.runtime.path
from loraweave.engine.journal import Journal

A, B, C = lora(["fc1", "fc2"], 1), lora(["fc2", "fc3"], 2), lora(["fc1", "fc3"], 3)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_switch_merge_failing_midway_leaves_the_model_clean(monkeypatch, exc, nth, after):
    pristine = state(Net())
    model = Net()
    handle = loraweave.apply(model, [(A, 1.0), (B, 0.5)], mode="merge")
    cls = loraweave.mechanisms.merge.layer.MergedModule
    wrapper = fail_on_call(nth, exc, cls.write, after=after)
    monkeypatch.setattr(cls, "write", wrapper)
    with pytest.raises(exc, match="injected"):
        handle.switch([(A, 0.3), (C, 1.0)])  # fc1 rewritten, fc2 and fc3 redone
    assert wrapper.calls["n"] == nth
    assert same(model, pristine) and not handle.active
    monkeypatch.undo()
    handle.remove()  # a no-op: nothing is left to undo
    assert same(model, pristine)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("nth", [1, 2])
@pytest.mark.parametrize("target", ["attach", "constructor"])
def test_switch_runtime_failing_midway_leaves_no_hook(monkeypatch, exc, nth, target):
    pristine = state(Net())
    model = Net()
    handle = loraweave.apply(model, [(A, 1.0)], mode="runtime")
    if target == "attach":
        cls = loraweave.mechanisms.runtime.path.RuntimePath
        monkeypatch.setattr(cls, "attach", fail_on_call(nth, exc, cls.attach, after=True))
    else:
        real = loraweave.engine.install.RuntimePath
        monkeypatch.setattr(loraweave.engine.install, "RuntimePath", fail_on_call(nth, exc, real))
    with pytest.raises(exc, match="injected"):
        handle.switch([(B, 1.0), (C, 1.0)])  # every layer rebuilt
    assert same(model, pristine) and no_hooks(model) and not handle.active


@pytest.mark.parametrize("mode", ["merge", "runtime"])
@pytest.mark.parametrize("nth", [1, 2])
def test_set_strength_failing_midway_keeps_the_old_strength_everywhere(monkeypatch, mode, nth):
    model = Net()
    handle = loraweave.apply(model, [(A, 1.0), (C, 0.5)], mode=mode)
    name = handle.report.adapters[0]["name"]
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before_out, before = model(x), state(model)
    cls = (
        loraweave.mechanisms.merge.layer.MergedModule
        if mode == "merge"
        else loraweave.mechanisms.runtime.path.RuntimePath
    )
    method = "write" if mode == "merge" else "refresh_scales"
    monkeypatch.setattr(cls, method, fail_on_call(nth, RuntimeError, getattr(cls, method), after=True))
    with pytest.raises(RuntimeError, match="injected"):
        handle.set_strength(name, 2.0)
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(model(x), before_out) and same(model, before)
    assert handle.strengths[name] == 1.0 and handle.active
    handle.remove()
    assert same(model, state(Net())) and no_hooks(model)


def test_undo_runs_every_entry_and_raises_the_first_error():
    done = []

    class Entry:
        def __init__(self, name: str, fail: bool = False) -> None:
            self.module, self.name, self.fail = None, name, fail

        def undo(self) -> None:
            done.append(self.name)
            if self.fail:
                raise RuntimeError(f"undo {self.name} failed")

    journal = Journal()
    for entry in (Entry("a"), Entry("b", fail=True), Entry("c", fail=True), Entry("d")):
        journal.record(entry)
    with pytest.raises(RuntimeError, match="undo c failed"):
        journal.undo()
    assert done == ["d", "c", "b", "a"] and journal.entries == []


def test_transaction_undoes_only_what_it_added():
    done = []

    class Entry:
        module = None

        def __init__(self, name: str) -> None:
            self.name = name

        def undo(self) -> None:
            done.append(self.name)

    journal = Journal()
    journal.record(Entry("kept"))
    with pytest.raises(KeyboardInterrupt), journal.transaction():
        journal.record(Entry("new1"))
        journal.record(Entry("new2"))
        raise KeyboardInterrupt
    assert done == ["new2", "new1"] and [e.name for e in journal.entries] == ["kept"]


def test_handle_changes_go_through_the_journal():
    """apply records every change; switch and remove read it: after remove the journal is empty."""
    model = Net()
    handle = loraweave.apply(model, [(A, 1.0)], mode="merge")
    assert len(handle.journal.entries) == 2 and handle.merged_layers == handle.journal.entries
    handle.switch([(A, 1.0), (B, 1.0)])
    assert {id(e.module) for e in handle.journal.entries} == {id(model.fc1), id(model.fc2), id(model.fc3)}
    handle.remove()
    assert handle.journal.entries == [] and same(model, state(Net()))
