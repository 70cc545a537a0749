"""Model-only nodes skip text-encoder keys, as core's LoraLoaderModelOnly does (issue 43 D).

A real SD1 LyCORIS file with kohya text-encoder keys (`lora_te_`, 360 of its 1750) through the pack's nodes on
ComfyUI's own SD1.5 model and CLIP (full size, on meta): the model-only loader, the step window and the stack
without a CLIP land every UNet key, count the text-encoder keys as skipped (not missed: strict accepts the
file), and land on the same modules as core's model-only key map. Inspect judges the text-encoder keys on a
connected CLIP, and skips them on a MODEL alone. The expected counts come from the file's header."""

from __future__ import annotations

import pytest
from helpers.comfy_env import import_comfy
from helpers.comfy_full import META, SD15_UNET, meta_patcher
from helpers.comfy_home import comfy_home_fixture  # noqa: F401  (fixture)
from safetensors import safe_open
from safetensors.torch import load_file

FILE = "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors"
TE_PREFIX = "lora_te_"  # kohya's SD1 text-encoder prefix
SKIPPED_LINE = "  skipped text_encoder={n} (model-only)"


@pytest.fixture(scope="module")
def sd15():
    c = import_comfy()
    import comfy.sd1_clip
    import comfy.supported_models_base

    target = comfy.supported_models_base.ClipTarget(comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel)
    clip = c.sd.CLIP(target, model_options={"initial_device": META}, disable_dynamic=True)
    return meta_patcher(c.supported_models.SD15, SD15_UNET), clip


@pytest.fixture(scope="module")
def lora(realdata, comfy_home):
    """(lora_name in ComfyUI's loras folder, the file's text-encoder keys, its other keys), from the
    header."""
    source = realdata / "lora" / FILE
    link = comfy_home["base"] / "models" / "loras" / FILE
    if not link.exists():
        link.symlink_to(source)  # the real file stays where it is
    with safe_open(str(source), "pt") as f:
        keys = set(f.keys())
    te = {k for k in keys if k.startswith(TE_PREFIX)}
    assert len(te) == 360 and len(keys) == 1750  # the file of the issue
    return FILE, te, keys - te


def node(node_id: str):
    import nodes

    return nodes.NODE_CLASS_MAPPINGS[node_id]


def core_model_only_targets(model, path) -> int:
    """How many modules core's LoraLoaderModelOnly patches (its key map without a CLIP)."""
    c = import_comfy()
    key_map = c.lora.model_lora_keys_unet(model.model, {})
    sd = c.lora_convert.convert_lora(load_file(str(path)))
    return len(c.lora.load_lora(sd, key_map, log_missing=False))


def assert_skipped_text(text: str, te: set[str], rest: set[str]) -> None:
    assert not text.startswith("WARNING"), text  # a model-only load of an ordinary LoRA is no partial load
    assert f"keys_applied={len(rest)}/{len(rest)}" in text and f"skipped_text_encoder={len(te)}" in text
    assert SKIPPED_LINE.format(n=len(te)) in text.splitlines() and "missed" not in text, text


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_model_only_loader_skips_text_encoder_keys_and_strict_accepts(sd15, lora, realdata, mode):
    from loraweave.comfy.api import load_lora_for_models

    model, clip = sd15
    name, te, rest = lora
    patched, text, _ = node("LoraWeaveLoaderModelOnly").execute(model, name, 1.0, mode, True).args
    assert_skipped_text(text, te, rest)
    _, none, report = load_lora_for_models(model, None, realdata / "lora" / name, 1.0, 0.0, mode, True)
    d = report.to_dict()
    assert none is None and d["unmatched"] == [] and d["unmatched_by_kind"] == {}
    assert d["keys_skipped"] == len(te) and d["skipped_by_component"] == {"text_encoder": len(te)}
    assert {s["key"] for s in d["skipped"]} == te and {s["why"] for s in d["skipped"]} == {"model-only"}
    assert d["keys_applied"] == d["keys_total"] == len(rest)
    assert len(report.applied) == core_model_only_targets(model, realdata / "lora" / name)
    if mode == "merge":  # the model side is what the loader with a CLIP patches on the model
        with_clip, _, both, _ = (
            node("LoraWeaveLoader").execute(model, name, 1.0, 1.0, mode, True, clip=clip).args
        )
        assert set(patched.patches) == set(with_clip.patches)
        assert f"keys_applied={len(te) + len(rest)}/{len(te) + len(rest)}" in both and "skipped" not in both
    assert model.patches == {}


def test_step_window_and_stack_without_clip_skip_text_encoder_keys(sd15, lora):
    model, _ = sd15
    name, te, rest = lora
    _, text = node("LoraWeaveStepWindow").execute(model, name, 1.0, 0.2, 0.8, 0.0).args
    assert_skipped_text(text, te, rest)
    for mode in ("merge", "runtime"):
        _, clip, text = node("LoraWeaveApplyStack").execute(model, [(name, 1.0, 1.0)], "sum", "", mode).args
        assert clip is None
        assert_skipped_text(text, te, rest)
    assert model.patches == {}


def _rows(report: str, label: str) -> list[str]:
    return [line.split(None, 1)[1] for line in report.splitlines() if line.split(None, 1)[:1] == [label]]


def test_inspect_judges_text_encoder_keys_on_a_clip_and_skips_them_without(sd15, lora, monkeypatch):
    import sys

    model, clip = sd15
    name, te, rest = lora
    inspect = node("LoraWeaveInspect")
    # the heatmap (tested in test_comfy_nodes) is not what this test judges, and takes minutes on this LoKr
    monkeypatch.setattr(sys.modules[inspect.__module__], "heatmap_image", lambda path: (None, None))
    alone = inspect.execute(name, model=model).args[0]
    assert _rows(alone, "coverage")[0].startswith(f"{len(rest)}/{len(rest)} keys land on the connected MODEL")
    assert _rows(alone, "skipped") == [f"text_encoder={len(te)} (model-only)"] and not _rows(
        alone, "unmatched"
    )
    both = inspect.execute(name, model=model, clip=clip).args[0]
    total = len(te) + len(rest)
    assert _rows(both, "coverage")[0].startswith(f"{total}/{total} keys land on the connected MODEL")
    assert "and CLIP" in _rows(both, "coverage")[0]
    assert not _rows(both, "skipped") and not _rows(both, "unmatched")
    assert model.patches == {} and clip.patcher.patches == {}
