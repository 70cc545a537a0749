"""loraweave.diffusers: the same LoRA calls on a PEFT pipeline (diffusers' own path) and a loraweave one.

Tiny Flux, SDXL (UNet) and Z-Image pipelines. After every call the denoiser outputs agree within 1e-5 relative
(max|ours - ref| / max|ref|), the adapter lists and active sets are equal, and no PEFT layer exists in
ours."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import REALDATA
from helpers.real_files import REAL_FILES
from helpers.tiny_models import MODELS
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

import loraweave.diffusers as lwd
from loraweave import LoraweaveError
from loraweave.diffusers import DropInError, NotLoraPipelineError, UnsupportedError

TOL = 1e-5
PIPES = {"flux": "FluxPipeline", "zimage": "ZImagePipeline", "sdxl_unet": "StableDiffusionXLPipeline"}
SCALE_KW = {
    "flux": "joint_attention_kwargs",
    "zimage": "joint_attention_kwargs",
    "sdxl_unet": "cross_attention_kwargs",
}
# SDXL: every block-scale form diffusers accepts (scalar part, per-block list of layers+1 for up).
BLOCK_DICT = {"unet": {"down": 0.6, "mid": 0.3, "up": {"block_0": [0.2, 0.5, 0.8]}}}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def make_pipe(arch: str, denoiser: torch.nn.Module, **components):
    """The arch's pipeline holding `denoiser` and `components` (e.g. text encoders); everything else None."""
    import diffusers

    cls = getattr(diffusers, PIPES[arch])
    kwargs = dict.fromkeys(cls._get_signature_keys(cls)[0])
    return cls(**kwargs | {MODELS[arch][2]: denoiser} | components)


def tiny_clip_encoders(seed: int = 0) -> dict[str, torch.nn.Module]:
    """SDXL's two text encoder classes at toy size (seeded)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=32,
    )
    torch.manual_seed(seed)
    return {
        "text_encoder": CLIPTextModel(cfg).eval(),
        "text_encoder_2": CLIPTextModelWithProjection(cfg).eval(),
    }


def _targets(model: torch.nn.Module, arch: str, every: int, offset: int) -> list[str]:
    kinds = (torch.nn.Linear, torch.nn.Conv2d) if arch == "sdxl_unet" else (torch.nn.Linear,)
    names = [n for n, m in model.named_modules() if isinstance(m, kinds)]
    if (
        arch == "sdxl_unet"
    ):  # block dicts address only down/mid/up blocks (diffusers raises IndexError elsewhere)
        names = [n for n in names if n.split(".")[0] in ("down_blocks", "mid_block", "up_blocks")]
    return names[offset::every]


def lora_layers(model: torch.nn.Module, targets: list[str], seed: int) -> tuple[dict, LoraConfig]:
    """A random PEFT LoRA (r=4, alpha 8, to_k alpha 2) on `targets` of a copy of `model`: (state dict,
    config)."""
    cfg = LoraConfig(
        r=4, lora_alpha=8, alpha_pattern={"to_k": 2}, init_lora_weights=False, target_modules=targets
    )
    torch.manual_seed(seed)
    model = inject_adapter_in_model(cfg, copy.deepcopy(model))
    return {k.replace(".default.", "."): v for k, v in model.state_dict().items() if ".lora_" in k}, cfg


def save_adapter(arch: str, base: torch.nn.Module, folder, seed: int, every: int, offset: int, **encoders):
    """lora_layers on `every`-th layer from `offset`, saved the diffusers way; `encoders`: name -> (module,
    seed)."""
    sd, cfg = lora_layers(base, _targets(base, arch, every, offset), seed)
    component = MODELS[arch][2]
    layers = {f"{component}_lora_layers": sd, f"{component}_lora_adapter_metadata": cfg.to_dict()}
    for name, (encoder, te_seed) in encoders.items():
        targets = [n for n, m in encoder.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n]
        te_sd, te_cfg = lora_layers(encoder, targets, te_seed)
        layers |= {f"{name}_lora_layers": te_sd, f"{name}_lora_adapter_metadata": te_cfg.to_dict()}
    type(make_pipe(arch, base)).save_lora_weights(folder, **layers)
    return folder / "pytorch_lora_weights.safetensors"


class Pair:
    """A PEFT pipeline and a loraweave one built from the same seeded denoiser."""

    def __init__(self, arch: str, **encoders) -> None:
        build, self.forward, self.component = MODELS[arch]
        self.arch = arch
        self.base = build()
        self.pristine = {k: v.clone() for k, v in self.base.state_dict().items()}
        self.peft = make_pipe(arch, copy.deepcopy(self.base), **copy.deepcopy(encoders))
        self.ours = lwd.enable(make_pipe(arch, copy.deepcopy(self.base), **copy.deepcopy(encoders)))

    def both(self, method: str, *args, **kwargs) -> None:
        getattr(self.peft, method)(*args, **kwargs)
        getattr(self.ours, method)(*args, **kwargs)

    @torch.no_grad()
    def outputs(self, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        extra = {} if scale is None else {SCALE_KW[self.arch]: {"scale": scale}}
        return (
            self.forward(getattr(self.peft, self.component), **extra),
            self.forward(getattr(self.ours, self.component), **extra),
        )

    def check(self, step: str, scale: float | None = None) -> torch.Tensor:
        ref, ours = self.outputs(scale)
        assert rel_err(ours, ref) <= TOL, step
        assert self.ours.get_active_adapters() == self.peft.get_active_adapters(), step
        assert self.ours.get_list_adapters() == self.peft.get_list_adapters(), step
        denoiser = getattr(self.ours, self.component)
        assert not any(isinstance(m, BaseTunerLayer) for m in denoiser.modules()), step
        return ours

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in getattr(self.ours, self.component).state_dict().items()}


def _silence_peft_warnings():
    logging.getLogger("diffusers").setLevel(logging.ERROR)


@pytest.mark.parametrize("arch", ["flux", "zimage", "sdxl_unet"])
def test_dropin_matches_diffusers_peft(arch, tmp_path):
    _silence_peft_warnings()
    pair = Pair(arch)
    base_out = pair.outputs()[1]
    a = save_adapter(arch, pair.base, tmp_path / "a", seed=3, every=1, offset=0)
    b = save_adapter(arch, pair.base, tmp_path / "b", seed=4, every=3, offset=1)

    pair.both("load_lora_weights", a, adapter_name="a")
    pair.check("load a")
    assert set(pair.ours.loraweave_reports) == {"a"}
    pair.both("load_lora_weights", str(b.parent), weight_name=b.name, adapter_name="b")
    assert pair.check("load b: only b active") is not None and pair.ours.get_active_adapters() == ["b"]
    assert pair.ours.loraweave_reports["b"].keys_applied == pair.ours.loraweave_reports["b"].keys_total > 0

    pair.both("set_adapters", ["a", "b"], [0.7, 0.4])
    pair.check("set_adapters floats")
    pair.check("per-call scale", scale=0.5)
    pair.check("after per-call scale")
    pair.both("set_adapters", ["a", "b"], [{pair.component: 0.5}, 0.9])
    pair.check("set_adapters per-component dict")
    if arch == "sdxl_unet":
        pair.both("set_adapters", ["a", "b"], [BLOCK_DICT, 0.8])
        pair.check("set_adapters nested block dict")
        pair.both("fuse_lora", components=["unet"])  # per-module scales fused (Handle.set_part_strengths)
        pair.check("fuse_lora under a block dict")
        pair.both("unfuse_lora", components=["unet"])
        pair.check("unfuse_lora under a block dict")
        bad = {"unet": {"up": {"block_0": [1.0, 2.0]}}}  # up blocks take layers_per_block + 1 scales
        with pytest.raises(ValueError) as ref:
            pair.peft.set_adapters("a", bad)
        with pytest.raises(DropInError) as ours:
            pair.ours.set_adapters("a", bad)
        assert str(ours.value) == str(ref.value)
        pair.check("after a rejected block dict")
    pair.both("set_adapters", "a")
    pair.check("set_adapters one name")

    before_fuse = pair.weights()
    runtime_out = pair.check("before fuse")
    pair.both("set_adapters", ["a", "b"], [0.6, 1.1])
    pair.both("fuse_lora")
    fused_out = pair.check("fuse_lora")
    assert pair.ours.num_fused_loras == pair.peft.num_fused_loras == 2
    assert any(not torch.equal(w, before_fuse[k]) for k, w in pair.weights().items()), (
        "fuse_lora merged nothing"
    )
    pair.both("unfuse_lora")
    assert rel_err(pair.check("unfuse_lora"), fused_out) <= TOL
    assert all(torch.equal(w, before_fuse[k]) for k, w in pair.weights().items()), "unfuse is not bit-exact"
    pair.both("fuse_lora", lora_scale=0.7, adapter_names=["a", "b"])
    pair.check("fuse_lora lora_scale=0.7")
    pair.both("unfuse_lora")
    pair.both("set_adapters", ["a", "b"], [0.6, 1.1])  # PEFT kept the 0.7 in its scalings; reset both
    pair.check("after unfuse, weights set again")
    assert not torch.equal(runtime_out, fused_out)

    pair.both("disable_lora")
    assert rel_err(pair.check("disable_lora"), base_out) == 0.0
    pair.both("fuse_lora")  # PEFT merges, then unmerges at the next forward while disabled
    assert rel_err(pair.check("fuse_lora while disabled"), base_out) == 0.0
    pair.both("enable_lora")
    pair.check("enable_lora")

    pair.both("delete_adapters", ["a", "not-there"])
    pair.check("delete a")
    pair.both("load_lora_weights", a)  # unnamed: default_{n}
    pair.check("load unnamed")
    assert pair.ours.get_list_adapters()[pair.component][-1] == "default_0"  # its first layer held only a

    pair.both("unload_lora_weights")
    out = pair.check("unload_lora_weights")
    assert torch.equal(out, base_out)
    for k, w in pair.weights().items():
        assert torch.equal(w, pair.pristine[k]), k
    assert pair.ours.loraweave_reports == {}


def test_dropin_errors_match_diffusers(tmp_path):
    _silence_peft_warnings()
    pair = Pair("flux")
    a = save_adapter("flux", pair.base, tmp_path / "a", seed=3, every=2, offset=0)
    pair.both("load_lora_weights", a, adapter_name="a")
    cases = [
        ("load_lora_weights", (a,), {"adapter_name": "a"}),
        ("set_adapters", (["a", "nope"],), {}),
        ("set_adapters", (["a"], [0.5, 0.5]), {}),
        ("fuse_lora", (), {"components": []}),
        ("fuse_lora", (), {"components": ["unet"]}),
        ("unfuse_lora", (), {"components": ["vae"]}),
    ]
    for method, args, kwargs in cases:
        with pytest.raises(ValueError) as ref:
            getattr(pair.peft, method)(*args, **kwargs)
        with pytest.raises(DropInError) as ours:
            getattr(pair.ours, method)(*args, **kwargs)
        assert str(ours.value) == str(ref.value), method
    pair.check("after the errors: nothing changed")
    for method, args in (("enable_lora_hotswap", ()), ("set_lora_device", (["a"], "cpu"))):
        with pytest.raises(UnsupportedError):
            getattr(pair.ours, method)(*args)
    with pytest.raises(UnsupportedError):
        pair.ours.load_lora_weights(a, adapter_name="a", hotswap=True)
    with pytest.raises(UnsupportedError, match="pipe.set_adapters"):
        pair.ours.transformer.set_adapters("a")  # model level: would silently do nothing without PEFT layers
    with pytest.raises(NotLoraPipelineError):
        lwd.enable(pair.peft)  # holds PEFT layers
    with pytest.raises(NotLoraPipelineError):
        lwd.enable(object())


def _loha_state_dict(
    unet: torch.nn.Module, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """kohya LoHa on two UNet attention projections, and the fp64 ΔW each should get (alpha 2, rank 2)."""
    g = torch.Generator().manual_seed(seed)
    sd, deltas = {}, {}
    for path in (
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
        "up_blocks.0.attentions.1.transformer_blocks.0.attn2.to_out.0",
    ):
        w = unet.get_submodule(path).weight
        key = "lora_unet_" + path.replace(".", "_")
        t = {
            n: torch.randn(shape, generator=g) * 0.3
            for n, shape in (
                ("hada_w1_a", (w.shape[0], 2)),
                ("hada_w1_b", (2, w.shape[1])),
                ("hada_w2_a", (w.shape[0], 2)),
                ("hada_w2_b", (2, w.shape[1])),
            )
        }
        sd |= {f"{key}.{n}": v for n, v in t.items()} | {f"{key}.alpha": torch.tensor(2.0)}
        d = {n: v.double() for n, v in t.items()}
        deltas[path] = (d["hada_w1_a"] @ d["hada_w1_b"]) * (d["hada_w2_a"] @ d["hada_w2_b"]) * (2.0 / 2)
    return sd, deltas


def test_loha_that_diffusers_rejects_loads(tmp_path):
    _silence_peft_warnings()
    pair = Pair("sdxl_unet")
    sd, deltas = _loha_state_dict(pair.base, seed=5)
    with pytest.raises(ValueError):
        pair.peft.load_lora_weights(dict(sd), adapter_name="loha")
    pair.ours.load_lora_weights(sd, adapter_name="loha")
    report = pair.ours.loraweave_reports["loha"]
    assert report.keys_applied == report.keys_total == len(sd)
    assert pair.ours.get_list_adapters() == {"unet": ["loha"]}
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for path, delta in deltas.items():
            layer = pair.ours.unet.get_submodule(path)
            xin = x[..., : layer.in_features]
            bias = None if layer.bias is None else layer.bias.double()
            ref = torch.nn.functional.linear(xin.double(), layer.weight.double() + delta, bias)
            assert rel_err(layer(xin), ref) <= TOL, path
    pair.ours.fuse_lora(components=["unet"])
    for path, delta in deltas.items():
        weight = pair.ours.unet.get_submodule(path).weight
        assert rel_err(weight, pair.base.get_submodule(path).weight.double() + delta) <= 1e-6, path
    pair.ours.unfuse_lora(components=["unet"])
    pair.ours.unload_lora_weights()
    for k, w in pair.ours.unet.state_dict().items():
        assert torch.equal(w, pair.pristine[k]), k


def test_disable_restores_diffusers_methods(tmp_path, caplog):
    _silence_peft_warnings()
    pair = Pair("zimage")
    a = save_adapter("zimage", pair.base, tmp_path / "a", seed=3, every=2, offset=0)
    with caplog.at_level(logging.INFO, logger="loraweave"):
        pair.ours.load_lora_weights(a, adapter_name="a")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loraweave.diffusers load")]
    assert len(lines) == 1 and "adapter=a" in lines[0] and "keys_applied=" in lines[0]
    lwd.disable(pair.ours)
    assert "load_lora_weights" not in pair.ours.__dict__ and not hasattr(pair.ours, "loraweave_reports")
    for k, w in pair.ours.transformer.state_dict().items():
        assert torch.equal(w, pair.pristine[k]), k
    pair.both("load_lora_weights", a, adapter_name="a")  # diffusers' own path again, on both
    ref, ours = pair.outputs()
    assert torch.equal(ours, ref)


@torch.no_grad()
def _encoder_outputs(pipe) -> list[torch.Tensor]:
    ids = torch.tensor([[0, 5, 17, 42, 98, 1]])
    return [pipe.text_encoder(ids)[0], pipe.text_encoder_2(ids)[0]]


def test_dropin_text_encoders_match_diffusers_peft(tmp_path):
    """SDXL with both text encoders: TE LoRAs, per-component weights, default fuse components (unet + TEs)."""
    _silence_peft_warnings()
    encoders = tiny_clip_encoders()
    pair = Pair("sdxl_unet", **encoders)
    pristine_te = {n: copy.deepcopy(m.state_dict()) for n, m in encoders.items()}
    base_te = _encoder_outputs(pair.ours)
    a = save_adapter(
        "sdxl_unet",
        pair.base,
        tmp_path / "a",
        seed=3,
        every=2,
        offset=0,
        text_encoder=(encoders["text_encoder"], 7),
        text_encoder_2=(encoders["text_encoder_2"], 8),
    )
    b = save_adapter("sdxl_unet", pair.base, tmp_path / "b", seed=4, every=3, offset=1)

    def check(step: str) -> list[torch.Tensor]:
        pair.check(step)
        ours = _encoder_outputs(pair.ours)
        for ref_out, our_out in zip(_encoder_outputs(pair.peft), ours, strict=True):
            assert rel_err(our_out, ref_out) <= TOL, step
        for name in encoders:
            assert not any(isinstance(m, BaseTunerLayer) for m in getattr(pair.ours, name).modules()), step
        return ours

    pair.both("load_lora_weights", a, adapter_name="a")
    assert rel_err(check("load a")[0], base_te[0]) > 1e-3  # the TE LoRA does something
    pair.both("load_lora_weights", b, adapter_name="b")  # unet only: the TEs keep `a` active (diffusers)
    check("load b")
    pair.both("set_adapters", ["a", "b"], [{"unet": 0.5, "text_encoder": 0.3, "text_encoder_2": 0.8}, 0.9])
    check("per-component dict with text encoders")
    pair.both("set_adapters", ["a", "b"], [0.6, 1.2])
    pair.both("fuse_lora")
    fused = check("fuse_lora, default components")
    pair.both("unfuse_lora", components=["text_encoder_2"])
    check("unfuse text_encoder_2 only")
    pair.both("unfuse_lora")
    assert rel_err(check("unfuse_lora")[0], fused[0]) <= TOL
    pair.both("disable_lora")
    assert all(torch.equal(o, r) for o, r in zip(check("disable_lora"), base_te, strict=True))
    pair.both("enable_lora")
    check("enable_lora")
    pair.both("delete_adapters", "a")
    check("delete a")
    pair.both("unload_lora_weights")
    check("unload")
    for name, state in pristine_te.items():
        for k, w in getattr(pair.ours, name).state_dict().items():
            assert torch.equal(w, state[k]), (name, k)


def tiny_clip_tokenizer(folder) -> object:
    """A CLIP tokenizer written offline: the two special tokens and a few whole-word tokens, no merges."""
    import json

    from transformers import CLIPTokenizer

    words = ["a", "b", "cat", "dog"]
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1} | {f"{w}</w>": i + 2 for i, w in enumerate(words)}
    vocab |= {c: len(vocab) + i for i, c in enumerate(sorted({c for w in words for c in w}))}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=77)


def test_encode_prompt_lora_scale_matches_diffusers_peft(tmp_path):
    """pipe.encode_prompt(lora_scale=s) scales the text encoders' adapters for that call only, as diffusers
    does."""
    _silence_peft_warnings()
    encoders = tiny_clip_encoders()
    tokenizer = tiny_clip_tokenizer(tmp_path / "tok")
    pair = Pair("sdxl_unet", **encoders, tokenizer=tokenizer, tokenizer_2=tokenizer)
    a = save_adapter(
        "sdxl_unet",
        pair.base,
        tmp_path / "a",
        seed=3,
        every=4,
        offset=0,
        text_encoder=(encoders["text_encoder"], 7),
        text_encoder_2=(encoders["text_encoder_2"], 8),
    )
    pair.both("load_lora_weights", a, adapter_name="a")
    pair.both("set_adapters", "a", 0.8)

    def encode(pipe, scale):
        with torch.no_grad():
            embeds, _, pooled, _ = pipe.encode_prompt(
                "a cat", device="cpu", do_classifier_free_guidance=False, lora_scale=scale
            )
        return embeds, pooled

    plain = encode(pair.ours, None)
    for scale in (0.5, None):
        for ours, ref in zip(encode(pair.ours, scale), encode(pair.peft, scale), strict=True):
            assert rel_err(ours, ref) <= TOL, scale
    assert rel_err(encode(pair.ours, 0.5)[0], plain[0]) > 1e-4  # the scale acts
    assert torch.equal(encode(pair.ours, None)[0], plain[0])  # and is gone after the call


def test_kohya_layout_matches_diffusers_conversion():
    """A kohya-named SDXL LoRA (lora_unet_*, lora_down/lora_up/alpha) lands as diffusers' converter puts
    it."""
    _silence_peft_warnings()
    pair = Pair("sdxl_unet")
    g = torch.Generator().manual_seed(9)
    sd = {}
    for path in _targets(pair.base, "sdxl_unet", every=5, offset=2):
        layer = pair.base.get_submodule(path)
        if not isinstance(layer, torch.nn.Linear):
            continue
        key = "lora_unet_" + path.replace(".", "_")
        sd[f"{key}.lora_down.weight"] = torch.randn(4, layer.in_features, generator=g)
        sd[f"{key}.lora_up.weight"] = torch.randn(layer.out_features, 4, generator=g)
        sd[f"{key}.alpha"] = torch.tensor(2.0)
    pair.both("load_lora_weights", dict(sd), adapter_name="kohya")
    pair.check("kohya load")
    assert pair.ours.loraweave_reports["kohya"].keys_applied == len(sd)
    pair.both("set_adapters", "kohya", 0.6)
    pair.both("fuse_lora", components=["unet"])
    pair.check("kohya fused")


def test_fused_deltas_outlive_delete_and_unload_as_in_diffusers(tmp_path):
    """diffusers' load -> fuse -> unload (or delete) pattern leaves a fused model with no adapter layers."""
    _silence_peft_warnings()
    pair = Pair("zimage")
    a = save_adapter("zimage", pair.base, tmp_path / "a", seed=3, every=2, offset=0)
    b = save_adapter("zimage", pair.base, tmp_path / "b", seed=4, every=3, offset=1)
    pair.both("load_lora_weights", a, adapter_name="a")
    pair.both("fuse_lora", lora_scale=0.5)
    pair.both("delete_adapters", "a")
    fused = pair.check("fused a deleted: its delta stays")
    pair.both("load_lora_weights", b, adapter_name="b")
    pair.both("load_lora_weights", a, adapter_name="a2")
    pair.both("set_adapters", ["b", "a2"])
    pair.both("fuse_lora")
    with pytest.raises(DropInError, match="fused together with"):  # diffusers allows it; our undo could not
        pair.ours.delete_adapters("a2")
    pair.both("unload_lora_weights")
    assert rel_err(pair.check("fused b unloaded: its delta stays"), fused) > 1e-4
    assert pair.ours.fused_loras == pair.peft.fused_loras


def test_failed_calls_leave_the_pipeline_unchanged(tmp_path):
    pair = Pair("flux")
    ours = pair.ours
    with pytest.raises(LoraweaveError):
        ours.load_lora_weights(tmp_path / "missing.safetensors", adapter_name="x")
    with pytest.raises(DropInError, match="none of the 2 keys landed"):
        ours.load_lora_weights(
            {
                "transformer.nowhere.lora_A.weight": torch.ones(2, 4),
                "transformer.nowhere.lora_B.weight": torch.ones(4, 2),
            },
            adapter_name="x",
        )
    a = save_adapter("flux", pair.base, tmp_path / "a", seed=3, every=4, offset=0)
    ours.load_lora_weights(a, adapter_name="a")
    before = pair.weights()
    for bad in ([[0.5]], float("nan"), {"transformer": "x"}, {"transformer": {"transformer_blocks.0": None}}):
        with pytest.raises(DropInError, match="must be a finite number"):
            ours.set_adapters("a", bad)
    # finite factors whose product overflows fp32: loraweave reads them, the fused weights turn inf
    nan = {k: torch.full_like(v, 1e20) if ".lora_" in k else v for k, v in load_file(a).items()}
    ours.load_lora_weights(nan, adapter_name="nan")
    for safe in (True, False):  # loraweave never merges non-finite values
        with pytest.raises(DropInError, match="NaNs detected"):
            ours.fuse_lora(adapter_names=["nan"], safe_fusing=safe)
    assert ours.get_list_adapters() == {"transformer": ["a", "nan"]} and ours.num_fused_loras == 0
    assert all(torch.equal(w, before[k]) for k, w in pair.weights().items())
    ours.unload_lora_weights()
    assert all(torch.equal(w, pair.pristine[k]) for k, w in pair.weights().items())


@pytest.fixture(scope="module")
def meta_pipes(realdata):
    """Full-size SD1.5, SD2 (UNet + text encoder) and Flux.1 pipelines on the meta device, drop-in enabled."""
    from diffusers import FluxPipeline, FluxTransformer2DModel, StableDiffusionPipeline, UNet2DConditionModel
    from helpers.common import real_config
    from transformers import CLIPTextConfig, CLIPTextModel

    sd2 = real_config("sd15__unet_config.json")  # as in test_realdata: SD2 differs from SD1.5 in these fields
    sd2.update(cross_attention_dim=1024, attention_head_dim=[5, 10, 20, 20], use_linear_projection=True)
    pipes = {}
    with torch.device("meta"):
        te = CLIPTextModel(CLIPTextConfig(**real_config("sd15__text_encoder_config.json")))
        for kind, config in (("sd15", real_config("sd15__unet_config.json")), ("sd2", sd2)):
            kwargs = dict.fromkeys(StableDiffusionPipeline._get_signature_keys(StableDiffusionPipeline)[0])
            unet = UNet2DConditionModel.from_config(config)
            pipes[kind] = StableDiffusionPipeline(
                **kwargs | {"unet": unet, "text_encoder": te, "requires_safety_checker": False}
            )
        flux = FluxTransformer2DModel.from_config(real_config("flux1-dev__transformer_config.json"))
    kwargs = dict.fromkeys(FluxPipeline._get_signature_keys(FluxPipeline)[0])
    pipes["flux"] = FluxPipeline(**kwargs | {"transformer": flux})
    return {kind: lwd.enable(pipe) for kind, pipe in pipes.items()}


@pytest.mark.parametrize("name", sorted(REAL_FILES))
def test_every_real_file_loads_through_the_dropin(name, meta_pipes):
    """Every real adapter file lands fully through pipe.load_lora_weights (a folder + weight_name, as
    diffusers scripts pass them), including the kohya LoKr files diffusers' own loader rejects."""
    pipe = meta_pipes[REAL_FILES[name][0]]
    pipe.load_lora_weights(str(REALDATA / "lora"), weight_name=name, adapter_name="real")
    try:
        report = pipe.loraweave_reports["real"]
        assert report.keys_applied == report.keys_total > 0, report.reasons()
        assert pipe.get_active_adapters() == ["real"]
    finally:
        pipe.unload_lora_weights()
    if "lokr" in name:
        with pytest.raises(ValueError):
            type(pipe).lora_state_dict(str(REALDATA / "lora" / name))


def test_unfuse_after_a_weight_change_is_exact_where_diffusers_drifts(tmp_path):
    """Deliberate difference: diffusers unfuses ΔW at the current scaling, so fuse -> set_adapters -> unfuse
    leaves its weights off; ours come back bit-exactly."""
    _silence_peft_warnings()
    pair = Pair("flux")
    a = save_adapter("flux", pair.base, tmp_path / "a", seed=3, every=2, offset=0)
    pair.both("load_lora_weights", a, adapter_name="a")
    pair.both("fuse_lora")
    pair.both("set_adapters", "a", 0.3)
    pair.both("unfuse_lora")
    peft_weights = {
        k.replace(".base_layer", ""): v
        for k, v in pair.peft.transformer.state_dict().items()
        if "lora_" not in k
    }
    drift = max(float((peft_weights[k] - w).abs().max()) for k, w in pair.pristine.items())
    assert drift > 1e-3  # diffusers' defect, still present in 0.42.1
    assert all(torch.equal(w, pair.pristine[k]) for k, w in pair.weights().items())


def test_fuse_on_an_sdnq_quantized_transformer(tmp_path):
    """diffusers' fuse_lora fails on SDNQ layers; the drop-in fuses through loraweave's quantized mechanisms
    (the factor channel for plain LoRA), matches its own runtime output and unfuses to the same stored
    tensors."""
    import os

    os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")
    from diffusers import FluxTransformer2DModel
    from helpers.tiny_models import flux_forward
    from sdnq import sdnq_post_load_quant

    _silence_peft_warnings()
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=64,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[16, 24, 24],
        guidance_embeds=True,
    ).eval()
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "blocks" in n]
    sd, _ = lora_layers(model, targets, seed=3)
    sd = {f"transformer.{k}": v * 0.2 for k, v in sd.items()}
    sdnq_post_load_quant(model, weights_dtype="int8", add_skip_keys=False)
    assert type(model.get_submodule(targets[0])).__name__ == "SDNQLinear"
    stored = {k: v.clone() for k, v in model.state_dict().items()}
    peft, ours = (make_pipe("flux", copy.deepcopy(model)) for _ in range(2))
    peft.load_lora_weights(dict(sd), adapter_name="a")
    with pytest.raises(RuntimeError):
        peft.fuse_lora()
    lwd.enable(ours).load_lora_weights(sd, adapter_name="a")
    with torch.no_grad():
        base = flux_forward(model)
        runtime = flux_forward(ours.transformer)
        ours.fuse_lora()
        fused = flux_forward(ours.transformer)
    assert rel_err(runtime, base) > 1e-3 and rel_err(fused, runtime) <= 1e-4
    ours.unfuse_lora()
    ours.unload_lora_weights()
    for k, v in ours.transformer.state_dict().items():
        assert torch.equal(v, stored[k]), k


def test_per_call_scale_zero_keeps_the_weights(tmp_path):
    """Deliberate difference: after a call with scale 0, diffusers resets set_adapters weights to 1; ours
    stay."""
    _silence_peft_warnings()
    pair = Pair("zimage")
    a = save_adapter("zimage", pair.base, tmp_path / "a", seed=3, every=2, offset=0)
    pair.both("load_lora_weights", a, adapter_name="a")
    pair.both("set_adapters", "a", 0.5)
    before = pair.check("weight 0.5")
    base = pair.forward(pair.base)
    ref, ours = pair.outputs(scale=0.0)
    assert torch.equal(ours, base) and rel_err(ref, base) <= TOL
    ref, ours = pair.outputs()
    assert torch.equal(ours, before) and rel_err(ref, before) > 1e-3  # PEFT came back at weight 1
    pair.both("set_adapters", "a", 1.0)
    assert rel_err(pair.outputs()[1], ref) <= TOL


def test_fuse_reuses_the_loads_resolution(tmp_path, monkeypatch):
    """fuse_lora merges the parts load_lora_weights resolved (factors read and checked once): no key is
    resolved again, and the fused weights are bit-identical to loraweave.apply(mode="merge") of the file at
    that weight."""
    import loraweave
    from loraweave.resolve import planner

    pair = Pair("sdxl_unet")
    a = save_adapter("sdxl_unet", pair.base, tmp_path / "a", seed=5, every=2, offset=0)
    pair.ours.load_lora_weights(a, adapter_name="a")
    pair.ours.set_adapters("a", 0.7)
    calls = []
    real = planner._plan_part
    monkeypatch.setattr(planner, "_plan_part", lambda *args: calls.append(args[1]) or real(*args))
    pair.ours.fuse_lora(lora_scale=0.5)
    assert calls == []
    monkeypatch.undo()
    fused = pair.weights()
    reference = copy.deepcopy(pair.base)
    loraweave.apply({"unet": reference}, (str(a), 0.35), mode="merge")
    assert fused.keys() == reference.state_dict().keys()
    assert all(torch.equal(w, reference.state_dict()[k]) for k, w in fused.items())
    pair.ours.unfuse_lora()
    assert all(torch.equal(w, pair.pristine[k]) for k, w in pair.weights().items())
