"""The MODEL input of the pack's nodes given what a miswired graph or another pack can hand a node, above all
LoraWeave Inspect's optional MODEL (coverage judged by `api.judge` on that model's own modules).

Each case ends in one of two ways, never in a bare AttributeError/KeyError from deep inside planning:
- a typed loraweave error (TargetError) raised through the node's own error path, its message naming the file
  and the input (`input 'model'`) and what it got: a CLIP, a CLIP's own ModelPatcher or another ModelPatcher
  whose model has no `diffusion_model`, a bare BaseModel, a dict;
- a report whose coverage says why it could not judge every layout: a model ComfyUI knows and loraweave maps
  no architecture onto (AuraFlow), a patcher whose model has a diffusion model but no ComfyUI config (another
  pack's wrapper), a mapped model whose widths loraweave's reference does not fit. Its count is the loader's.
Whatever was handed in is unchanged afterwards: patch lists and their uuid, object patches, attachments,
injections, additional models and every weight, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.comfy_env import import_comfy
from helpers.comfy_home import comfy_home_fixture, execution_error, run_prompt  # noqa: F401  (fixture)
from helpers.comfy_models import _seeded, tiny_flux
from helpers.comfy_pack import flux_lora
from helpers.comfy_sampling import REGISTRY, register_test_nodes
from safetensors.torch import save_file

from loraweave.errors import TargetError

pytestmark = pytest.mark.comfy
LORA = "flux.safetensors"  # comfy_pack.write_loras: a kohya LoRA on two Linear layers of the tiny Flux
AURA = {"dim": 64, "n_layers": 2, "n_double_layers": 1, "n_heads": 2, "global_conddim": 64,
        "cond_seq_dim": 32, "max_seq": 16, "in_channels": 4, "out_channels": 4}  # fmt: skip


@pytest.fixture(scope="module")
def flux():
    return tiny_flux()


def patcher_over(module: torch.nn.Module):
    cpu = torch.device("cpu")
    return import_comfy().model_patcher.ModelPatcher(module, load_device=cpu, offload_device=cpu)


@pytest.fixture(scope="module")
def aura():
    """ComfyUI's AuraFlow (a model loraweave has no architecture for), small, seeded, through
    supported_models."""
    c = import_comfy()
    config = c.supported_models.AuraFlow(dict(AURA))
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    _seeded(model.diffusion_model, 11)
    return patcher_over(model)


class Wrapper(torch.nn.Module):
    """Another pack's model: a diffusion model under `diffusion_model`, no ComfyUI model_config."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.diffusion_model = inner


HOSTILE = {  # name -> (what the graph hands the MODEL input, what the error says it got)
    "clip": (lambda f: f.clip, "got a CLIP"),
    "clip_patcher": (lambda f: f.clip.patcher, "over FluxClipModel_, which has no diffusion_model"),
    "linear_patcher": (
        lambda f: patcher_over(torch.nn.Linear(4, 4)),
        "over Linear, which has no diffusion_model",
    ),
    "base_model": (lambda f: f.patcher.model, "got Flux"),
    "dict": (lambda f: {"model": f.patcher}, "got dict"),
}


def state_of(obj) -> dict:
    """Everything a node could change on `obj` (a ModelPatcher, a CLIP, a module, a dict), copied."""
    import comfy.model_patcher
    import comfy.sd

    out: dict = {}
    patcher = obj.patcher if isinstance(obj, comfy.sd.CLIP) else obj
    if isinstance(patcher, comfy.model_patcher.ModelPatcher):
        out["patcher"] = (
            patcher.patches_uuid,
            {k: list(v) for k, v in patcher.patches.items()},
            dict(patcher.object_patches),
            dict(patcher.attachments),
            {k: list(v) for k, v in patcher.injections.items()},
            {k: list(v) for k, v in patcher.additional_models.items()},
        )
        obj = patcher.model
    if isinstance(obj, torch.nn.Module):
        out["weights"] = {k: v.detach().clone() for k, v in obj.state_dict().items()}
    elif isinstance(obj, dict):
        out["dict"] = dict(obj)
    return out


def assert_unchanged(obj, before: dict) -> None:
    after = state_of(obj)
    assert after.keys() == before.keys()
    assert after.get("patcher") == before.get("patcher")
    assert after.get("dict") == before.get("dict")
    for key, value in before.get("weights", {}).items():
        assert torch.equal(after["weights"][key], value), key


def inspect_node():
    import nodes

    return nodes.NODE_CLASS_MAPPINGS["LoraWeaveInspect"]


@pytest.mark.parametrize("case", list(HOSTILE))
def test_inspect_refuses_what_is_no_diffusion_model(comfy_home, flux, case):
    make, says = HOSTILE[case]
    obj = make(flux)
    before = state_of(obj)
    with pytest.raises(TargetError) as caught:
        inspect_node().execute(LORA, model=obj)
    message = str(caught.value)
    assert message.startswith(f"{LORA}: input 'model': ") and says in message, message
    assert_unchanged(obj, before)


@pytest.mark.parametrize(
    "node",
    [
        {"class_type": "LoraWeaveInspect", "inputs": {}, "report_slot": 0},
        {
            "class_type": "LoraWeaveLoaderModelOnly",
            "inputs": {"strength_model": 1.0, "mode": "auto", "strict": False},
        },
        {
            "class_type": "LoraWeaveStepWindow",
            "inputs": {"strength": 1.0, "start_percent": 0.0, "end_percent": 1.0, "ramp": 0.0},
        },
    ],  # fmt: skip
    ids=lambda node: node["class_type"],
)
@pytest.mark.parametrize("case", ["clip", "clip_patcher"])
def test_a_foreign_object_under_model_is_a_node_error(comfy_home, flux, monkeypatch, node, case):
    """Through ComfyUI's executor: another pack's node whose MODEL output is not a diffusion MODEL (validation
    passes: the socket types match); the pack's node fails with the typed error, naming file and input."""
    register_test_nodes(monkeypatch)
    make, says = HOSTILE[case]
    obj = make(flux)
    monkeypatch.setitem(REGISTRY, "foreign", obj)
    before = state_of(obj)
    prompt = {
        "1": {"class_type": "LWTestModelSource", "inputs": {"name": "foreign"}},
        "2": {**node, "inputs": {**node["inputs"], "model": ["1", 0], "lora_name": LORA}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", node.get("report_slot", 1)]}},
    }
    valid, errors, ex, _ = run_prompt(prompt)  # report_slot is dropped before execution
    assert valid and not ex.success, errors
    failure = execution_error(ex)
    assert failure["node_id"] == "2" and failure["exception_type"] == "loraweave.errors.TargetError", failure
    message = failure["exception_message"]
    assert LORA in message and "input 'model'" in message and says in message, message
    assert_unchanged(obj, before)


def _coverage(report: str) -> tuple[str, str]:
    lines = report.splitlines()
    line = next(i for i, text in enumerate(lines) if text.startswith("coverage"))
    note = next((text for text in lines[line:] if text.startswith("  note")), "")
    return lines[line], note


def test_a_model_loraweave_maps_nothing_onto_says_why(comfy_home, aura):
    """AuraFlow: ComfyUI loads it, loraweave has no architecture for it. Keys in ComfyUI's own names land (and
    the loader lands the same ones); keys in diffusers' names cannot be judged, and the report says so."""
    import nodes

    g = torch.Generator().manual_seed(3)

    def pair() -> dict[str, torch.Tensor]:
        return {
            "lora_A.weight": torch.randn(4, 64, generator=g),
            "lora_B.weight": torch.randn(64, 4, generator=g),
        }

    sd = {f"diffusion_model.double_layers.0.attn.w1q.{k}": v for k, v in pair().items()}
    sd |= {f"transformer.joint_transformer_blocks.0.attn.to_q.{k}": v for k, v in pair().items()}
    save_file(sd, comfy_home["base"] / "models" / "loras" / "aura.safetensors")
    before = state_of(aura)
    report, _, heatmap = inspect_node().execute("aura.safetensors", model=aura).args
    line, note = _coverage(report)
    assert line.split()[1] == "2/4" and "connected MODEL (AuraFlow, its own modules)" in line, report
    assert (
        "loraweave maps no architecture onto AuraFlow" in note and "ComfyUI's own module names only" in note
    )
    assert "transformer.joint_transformer_blocks.0.attn.to_q.lora_A.weight" in report  # the miss is named
    # a file of an architecture loraweave does not know has no block map to draw: a black IMAGE, and the
    # report says why (it raised a bare ValueError from the heatmap before)
    assert "heatmap: not drawn (aura: no heatmap: no full-size model for architecture 'unknown'" in report, (
        report
    )
    assert torch.equal(heatmap, torch.zeros(1, 64, 64, 3))
    loader = nodes.NODE_CLASS_MAPPINGS["LoraWeaveLoaderModelOnly"]
    text = loader.execute(aura, "aura.safetensors", 1.0, "merge", False).args[1]
    assert "keys_applied=2/4" in text, text  # one resolver: Inspect's count is the loader's
    assert_unchanged(aura, before)


def test_another_packs_wrapper_without_config_says_why(comfy_home, flux):
    """A ModelPatcher over a module holding a diffusion model but no ComfyUI model_config: judged on its own
    module names (the kohya file names the BFL modules: it lands), and the report says why."""
    wrapped = patcher_over(Wrapper(flux.patcher.model.diffusion_model))
    before = state_of(wrapped)
    report = inspect_node().execute(LORA, model=wrapped).args[0]
    line, note = _coverage(report)
    assert line.split()[1] == "6/6" and "(Wrapper, its own modules)" in line, report
    assert "loraweave maps no architecture onto Wrapper" in note, report
    assert_unchanged(wrapped, before)


def test_a_mapped_model_whose_widths_do_not_fit_says_why(comfy_home, flux, monkeypatch):
    """Flux with loraweave's width translation taken away (the full-size reference no longer fits the tiny
    model, test_comfy_errors.test_no_fitting_reference_...): the note names the architecture and why."""
    from helpers.registry import patch_records

    from loraweave.arch.registry import by_name

    flux_comfy = by_name()["flux"].comfy
    patch_records(monkeypatch, {"flux"}, comfy=dataclasses.replace(flux_comfy, config=None))
    save_file(flux_lora(), comfy_home["base"] / "models" / "loras" / "flux_again.safetensors")
    report = inspect_node().execute("flux_again.safetensors", model=flux.patcher).args[0]
    line, note = _coverage(report)
    assert line.split()[1] == "6/6", report
    assert "loraweave's flux reference does not fit this model's widths" in note, report
    # with the reference there, nothing is left to explain
    monkeypatch.undo()
    report = inspect_node().execute("flux_again.safetensors", model=flux.patcher).args[0]
    assert _coverage(report)[1] == "", report
