"""Prompt tags: strengths, lbw, lyco, name resolution inside lora_dir, and refused escapes."""

from __future__ import annotations

import os

import pytest

from loraweave.errors import PromptAdapterError
from loraweave.request.prompt import parse_prompt, resolve_adapter_name
from loraweave.request.spec import AdapterSpec


@pytest.fixture
def lora_dir(tmp_path):
    root = tmp_path / "loras"
    (root / "styles").mkdir(parents=True)
    (root / "chars" / "deep").mkdir(parents=True)
    for rel in (
        "subject.safetensors",
        "styles/ink.safetensors",
        "chars/deep/alice_v1.5.safetensors",
        "styles/notes.txt",
    ):
        (root / rel).write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.safetensors").write_bytes(b"x")
    return root


def test_plain_and_two_strengths(lora_dir):
    clean, specs = parse_prompt("a cat <lora:subject:0.8>, oil painting <lora:ink:1.0:0.5>", lora_dir)
    assert clean == "a cat, oil painting"
    assert [s.name for s in specs] == ["subject", "ink"]
    assert specs[0].source == (lora_dir / "subject.safetensors").resolve()
    assert (specs[0].strength, specs[0].te_strength, specs[0].text_encoder_strength) == (0.8, None, 0.8)
    assert (specs[1].strength, specs[1].te_strength) == (1.0, 0.5)
    assert specs[1].source == (lora_dir / "styles" / "ink.safetensors").resolve()


def test_lbw_named_items_and_lyco(lora_dir):
    clean, specs = parse_prompt(
        "<lyco:styles/ink:1:lbw=OUTALL> x <lora:alice_v1.5:te=0.25:unet=0.6> <lora:subject:lbw=1,0,0.5>",
        lora_dir,
    )
    assert clean == "x"
    ink, alice, subj = specs
    assert isinstance(ink, AdapterSpec) and ink.block_weights == "OUTALL" and ink.strength == 1.0
    assert (alice.strength, alice.te_strength) == (0.6, 0.25)
    assert alice.source.name == "alice_v1.5.safetensors"
    assert subj.block_weights == [1.0, 0.0, 0.5] and subj.strength == 1.0


def test_step_window_keys(lora_dir):
    _, (a, b, c, d) = parse_prompt(
        "<lora:subject:0.7:start=0.0:end=0.3> <lora:ink:start=0.5> <lora:subject:end=0.25> <lora:ink:1:0.5>",
        lora_dir,
    )
    assert (a.strength, a.steps) == (0.7, (0.0, 0.3))
    assert (b.steps, c.steps, d.steps) == ((0.5, 1.0), (0.0, 0.25), None)


def test_no_tags(lora_dir):
    assert parse_prompt("just a prompt", lora_dir) == ("just a prompt", [])


def test_name_with_extension_and_backslash(lora_dir):
    assert (
        resolve_adapter_name("styles\\ink.safetensors", lora_dir)
        == (lora_dir / "styles/ink.safetensors").resolve()
    )


@pytest.mark.parametrize(
    "tag,match",
    [
        ("<lora:../outside/evil:1>", r"'\.\.'"),
        ("<lora:styles/../../outside/evil:1>", r"'\.\.'"),
        ("<lora:/etc/passwd:1>", "absolute"),
        ("<lora:\\\\server\\share\\x:1>", "absolute"),
        ("<lora:C\\evil:1>", "no adapter"),
        ("<lora:sub\x00ject:1>", "NUL"),
        ("<lora::1>", "empty"),
    ],
)
def test_traversal_refused(lora_dir, tag, match):
    with pytest.raises(PromptAdapterError, match=match):
        parse_prompt(f"x {tag}", lora_dir)


def test_windows_drive_refused(lora_dir):
    with pytest.raises(PromptAdapterError, match="absolute"):
        resolve_adapter_name("C:/Windows/evil", lora_dir)


def test_symlink_escape_refused(lora_dir):
    outside = lora_dir.parent / "outside"
    os.symlink(outside / "evil.safetensors", lora_dir / "linked.safetensors")
    os.symlink(outside, lora_dir / "linkdir")
    with pytest.raises(PromptAdapterError, match="outside"):
        parse_prompt("<lora:linked:1>", lora_dir)
    with pytest.raises(PromptAdapterError, match="outside"):
        parse_prompt("<lora:linkdir/evil:1>", lora_dir)
    # a symlink that stays inside the folder is fine
    os.symlink(lora_dir / "subject.safetensors", lora_dir / "styles" / "alias.safetensors")
    assert (
        parse_prompt("<lora:alias:1>", lora_dir)[1][0].source == (lora_dir / "subject.safetensors").resolve()
    )


def test_unknown_name_lists_close_matches(lora_dir):
    with pytest.raises(PromptAdapterError, match=r"no adapter 'subjekt'.*close matches: subject"):
        parse_prompt("<lora:subjekt:1>", lora_dir)
    with pytest.raises(PromptAdapterError, match=r"close matches: .*styles/ink"):
        parse_prompt("<lora:styles/inc:1>", lora_dir)


def test_ambiguous_stem(lora_dir):
    (lora_dir / "chars" / "ink.safetensors").write_bytes(b"x")
    with pytest.raises(PromptAdapterError, match="ambiguous.*chars/ink.safetensors.*styles/ink.safetensors"):
        parse_prompt("<lora:ink:1>", lora_dir)
    assert parse_prompt("<lora:chars/ink:1>", lora_dir)[1][0].source.parent.name == "chars"


@pytest.mark.parametrize(
    "tag,match",
    [
        ("<lora:subject:abc>", "not a number"),
        ("<lora:subject:inf>", "finite"),
        ("<lora:subject:1:2:3>", "at most two"),
        ("<lora:subject:1:foo=2>", "unknown item"),
        ("<lora:subject:1:unet=2>", "both positionally"),
        ("<lora:subject:lbw=OUTS:1>", "after a named"),
        ("<lora:subject:1:lbw=>", "empty"),
        ("<lora:subject:1:lbw=1,x>", "not a number"),
        ("<lora:subject:1:start=0.5:end=0.5>", "start < end"),
        ("<lora:subject:1:start=0.5:start=0.1>", "given twice"),
        ("<lora:subject:1:end=1.5>", "start < end"),
        ("<lora:subject:1:end=x>", "not a number"),
    ],
)
def test_bad_syntax(lora_dir, tag, match):
    with pytest.raises(PromptAdapterError, match=match):
        parse_prompt(tag, lora_dir)


def test_error_is_value_error_and_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        parse_prompt("<lora:a:1>", tmp_path / "nope")


def test_adapter_spec_validation():
    with pytest.raises(ValueError, match="finite"):
        AdapterSpec("x.safetensors", strength=float("nan"))
    assert AdapterSpec("x", strength=0.5, te_strength=0.0).text_encoder_strength == 0.0
