"""Adapters on diffusers' quantized Flux (issue 38, item 4): torchao float8 and GGUF, `apply` and the drop-in.

The base: a tiny FluxTransformer2DModel (diffusers' class, seeded, heads of 128) loaded by diffusers itself:
`from_pretrained(..., quantization_config=TorchAoConfig(Float8WeightOnlyConfig()))` (Float8Tensor weights,
e4m3 per-row scales) and `from_single_file(file.gguf, quantization_config=GGUFQuantizationConfig(fp32))` on a
file this test writes with `gguf.GGUFWriter` (Q8_0, Q4_0 from the gguf package's quantizer; Q4_K as
well-formed random super-blocks, which the gguf package cannot quantize). Q4_K leaves the 64-wide `x_embedder`
F32 (no 256-block fits), as GGUF files keep narrow layers unquantized: a float layer beside the quantized
ones.

For LoRA, LoKr, LoHa, DoRA and OFT files, on nine layers of every kind (attention, FFN, AdaLN modulation,
single-block MLP and output, the image embedder):
- each layer's output with the adapter equals the quantized base's own output plus the exact fp64 term x·ΔWᵀ,
  ΔW from the family's formula on the base's own dequantized weight (torchao's `dequantize()`, diffusers'
  `dequantize_gguf_tensor`). Bound (helpers.diffusers_quant.check_term): 1e-5·max|term| (fp32 arithmetic of
  the term) + 4·eps32·max|y| (the fp32 rounding of y = base + term);
- every stored tensor's bytes (float8 data and scales, GGUF blocks, biases) are unchanged while applied (a
  float layer that `auto` merges is the one exception, and only its weight) and after removal; outputs after
  removal are bit-equal to the base's;
- the report names the mechanism per layer: "runtime" on a quantized layer, with the backend's reason.
The drop-in (`loraweave.diffusers.enable(FluxPipeline(...))`, `load_lora_weights` of a kohya-named file,
`set_adapters`, `fuse_lora`, `unfuse_lora`, `unload_lora_weights`) holds to the same checks.
`mode="merge"` requantizes with the layer's own config: its report's retention ρ equals ρ measured here from
the base's own dequantizer (table in docs/quantized-df.md)."""

from __future__ import annotations

import pytest
import torch
from helpers.common import gen
from helpers.diffusers_quant import (
    FAMILIES,
    TARGETS,
    adapter,
    baseline,
    changed_bytes,
    check_term,
    float_flux,
    flux_inputs,
    flux_pipe,
    gguf_linear,
    kohya_names,
    own_weight,
    quantized_flux,
    retention,
    rms,
    saved_flux,
    storage_bytes,
    storage_kind,
    write_gguf_layer,
)
from safetensors.torch import save_file

import loraweave
import loraweave.diffusers as lwd
from loraweave.quant import backend_for

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

FORMATS = ("torchao-float8", "gguf-Q8_0", "gguf-Q4_0", "gguf-Q4_K")
STORED = {"torchao-float8": "Float8Tensor", "gguf-Q8_0": "GGUF Q8_0", "gguf-Q4_0": "GGUF Q4_0"}
STORED["gguf-Q4_K"] = "GGUF Q4_K"
LINEAR_FAMILIES = ("lora", "lokr", "loha", "oft")  # ΔW linear in strength (DoRA renormalises)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("flux")


_MODELS: dict[str, torch.nn.Module] = {}


@pytest.fixture
def model(request, folder):
    """The format's model, built once per module: every test leaves it as it found it (asserted)."""
    fmt = request.param  # "<format>" computes in fp32, "<format>@bf16" in bf16
    if fmt not in _MODELS:
        name, _, dtype = fmt.partition("@")
        _MODELS[fmt] = quantized_flux(name, folder, torch.bfloat16 if dtype == "bf16" else torch.float32)
    m = _MODELS[fmt]
    before = storage_bytes(m)
    yield m
    assert changed_bytes(m, before) == [], f"{fmt}: a test left the model changed"


def float_layers(model: torch.nn.Module) -> set[str]:
    return {p for p in TARGETS if backend_for(model.get_submodule(p)) is None}


def assert_terms(model, base, deltas, what: str, strength: float = 1.0, merged=frozenset()) -> None:
    for path, (x, b) in base.items():
        ratio = check_term(model.get_submodule(path), x, b, deltas[path], strength, path in merged)
        assert ratio <= 1, (what, path, ratio)


def assert_base_outputs(model, base, what: str) -> None:
    with torch.no_grad():
        for path, (x, (y, _, _)) in base.items():
            assert torch.equal(model.get_submodule(path)(x), y), (what, path)


@pytest.mark.parametrize("model", FORMATS, indirect=True)
def test_diffusers_loaded_the_quantized_layers(model):
    """The base really is diffusers' quantized model: its quantizer, every target layer stored in the format
    (Q4_K: all but the 64-wide x_embedder), each owned by the matching loraweave backend."""
    fmt = next(f for f, m in _MODELS.items() if m is model)
    assert type(model.hf_quantizer).__name__ == {"torchao": "TorchAoHfQuantizer"}.get(
        fmt.split("-")[0], "GGUFQuantizer"
    )
    kinds = {p: storage_kind(model.get_submodule(p)) for p in TARGETS}
    floats = {"x_embedder"} if fmt == "gguf-Q4_K" else set()
    assert kinds == {p: "float32" if p in floats else STORED[fmt] for p in TARGETS}
    assert float_layers(model) == floats
    for p in set(TARGETS) - floats:
        assert backend_for(model.get_submodule(p)).name == fmt.split("-")[0], p


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("model", FORMATS, indirect=True)
def test_apply_auto_lands_every_family_exactly(model, family):
    base, before = baseline(model), storage_bytes(model)
    sd, deltas = adapter(family, model)
    handle = loraweave.apply(model, sd, mode="auto", strict=True)
    rows = {a.module: a for a in handle.report.applied}
    floats = float_layers(model)
    assert set(rows) == set(TARGETS)
    for path, row in rows.items():
        if path in floats:
            assert row.mechanism == "merge", (path, row.mechanism)
        else:  # the layer's backend says why it takes no write: no side branch (and, Q4_K, no quantizer)
            name = backend_for(model.get_submodule(path)).name
            assert row.mechanism == "runtime" and row.why.startswith(f"{name}: "), (path, row)
    assert_terms(model, base, deltas, f"apply {family}")
    # while applied: the quantized storage untouched; only the weights of merged float layers changed
    assert set(changed_bytes(model, before)) == {f"{p}.weight" for p in floats}
    handle.remove()
    assert changed_bytes(model, before) == []
    assert_base_outputs(model, base, f"after remove {family}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("model", [f"{f}@bf16" for f in FORMATS if f != "gguf-Q8_0"], indirect=True)
def test_apply_in_bf16_lands_within_the_bases_own_rounding(model, family):
    """What users run: the same models computing in bf16 (TorchAoConfig with torch_dtype=bf16, GGUF
    compute_dtype=bf16). The error against the fp64 term stays within twice the base's own bf16 rounding
    (its output against fp64 on its own weight, measured per layer) plus bf16's step on the term; bytes
    unchanged."""
    base, before = baseline(model, dtype=torch.bfloat16), storage_bytes(model)
    assert all(x.dtype == torch.bfloat16 == y.dtype for x, (y, _, _) in base.values())
    sd, deltas = adapter(family, model)
    handle = loraweave.apply(model, sd, mode="auto", strict=True)
    floats = float_layers(model)
    assert {a.module: a.mechanism for a in handle.report.applied} == {
        p: "merge" if p in floats else "runtime" for p in TARGETS
    }
    assert_terms(model, base, deltas, f"bf16 apply {family}", merged=floats)
    assert set(changed_bytes(model, before)) == {f"{p}.weight" for p in floats}
    handle.remove()
    assert changed_bytes(model, before) == []
    assert_base_outputs(model, base, f"bf16 after remove {family}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("model", FORMATS, indirect=True)
def test_dropin_lands_every_family_exactly(model, family, tmp_path):
    """pipe.load_lora_weights(kohya-named file) through the drop-in; set_adapters, fuse/unfuse, unload."""
    base, before = baseline(model), storage_bytes(model)
    sd, deltas = adapter(family, model, seed=1)
    path = tmp_path / f"{family}.safetensors"
    save_file(kohya_names(sd), str(path))
    pipe = lwd.enable(flux_pipe(model))
    try:
        pipe.load_lora_weights(str(path), adapter_name=family)
        report = pipe.loraweave_reports[family]
        assert report.keys_applied == report.keys_total == len(sd)
        assert {a.module: a.mechanism for a in report.applied} == dict.fromkeys(TARGETS, "runtime")
        assert changed_bytes(model, before) == []
        assert_terms(model, base, deltas, f"drop-in {family}")
        if family in LINEAR_FAMILIES:
            pipe.set_adapters(family, 0.5)
            assert_terms(model, base, deltas, f"drop-in {family} at 0.5", strength=0.5)
            pipe.set_adapters(family, 1.0)
        pipe.disable_lora()
        assert_base_outputs(model, base, f"drop-in {family} disabled")
        pipe.enable_lora()
        # fuse_lora on a quantized base: `auto` keeps quantized layers at runtime, merges float ones
        pipe.fuse_lora()
        assert set(changed_bytes(model, before)) == {f"{p}.weight" for p in float_layers(model)}
        assert_terms(model, base, deltas, f"drop-in {family} fused")
        pipe.unfuse_lora()
        assert changed_bytes(model, before) == []
        assert_terms(model, base, deltas, f"drop-in {family} unfused")
        pipe.unload_lora_weights()
        assert changed_bytes(model, before) == []
        assert_base_outputs(model, base, f"drop-in {family} unloaded")
    finally:
        lwd.disable(pipe)


@pytest.mark.parametrize("model", ["torchao-float8", "gguf-Q4_0"], indirect=True)
def test_dropin_per_call_scale_on_the_whole_transformer(model):
    """The pipeline's per-call `joint_attention_kwargs={"scale": s}` on a quantized transformer's forward: 0
    gives the base's output bit for bit; 1 gives the loaded adapter's (the same as without the kwarg)."""
    inputs = flux_inputs()
    sd, _ = adapter("loha", model, seed=2)
    with torch.no_grad():
        plain = model(**inputs, return_dict=False)[0]
        pipe = lwd.enable(flux_pipe(model))
        try:
            pipe.load_lora_weights(kohya_names(sd), adapter_name="loha")
            on = model(**inputs, return_dict=False)[0]
            off = model(**inputs, joint_attention_kwargs={"scale": 0.0}, return_dict=False)[0]
            full = model(**inputs, joint_attention_kwargs={"scale": 1.0}, return_dict=False)[0]
            pipe.unload_lora_weights()
        finally:
            lwd.disable(pipe)
        assert torch.equal(off, plain) and torch.equal(full, on)
        assert float((on - plain).abs().max()) > 1e-3 * float(plain.abs().max())


# ------------------------------------------------------------------------------------- merge: retention ρ

REL_SIZES = (0.01, 0.03, 0.1)  # ‖ΔW‖_rms / ‖W‖_rms: a LoRA's typical share of a Flux weight is a few percent
MERGE_TARGETS = ("transformer_blocks.0.ff.net.0.proj", "single_transformer_blocks.0.proj_out")


def sized_lora(model, rel: float, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A rank-8 LoRA on MERGE_TARGETS with ‖ΔW‖_rms = rel·‖W‖_rms; ({key: tensor}, {layer: ΔW fp64})."""
    g = torch.Generator().manual_seed(seed)
    sd, deltas = {}, {}
    for path in MERGE_TARGETS:
        layer = model.get_submodule(path)
        down = torch.randn(8, layer.in_features, generator=g)
        up = torch.randn(layer.out_features, 8, generator=g)
        k = rel * rms(own_weight(layer)) / rms(up.double() @ down.double())
        sd |= {f"{path}.lora_down.weight": down * k, f"{path}.lora_up.weight": up}
        sd[f"{path}.alpha"] = torch.tensor(8.0)
        deltas[path] = up.double() @ (down * k).double()
    return sd, deltas


# ρ a requantize keeps of a ΔW of 1 % of the weight's rms (the smallest size in REL_SIZES), by format: what
# users see as "the LoRA does almost nothing" (float8: 3 mantissa bits; Q4_0: 4-bit blocks) against Q8_0.
RHO_AT_1PCT = {"torchao-float8": (0.0, 0.6), "gguf-Q8_0": (0.9, 1.1), "gguf-Q4_0": (0.0, 0.6)}


@pytest.mark.parametrize("model", FORMATS, indirect=True)
def test_merge_reports_the_retention_it_measured(model):
    """mode="merge" requantizes each layer with its own config: the report's retention equals ρ measured from
    the base's own dequantizer; runtime keeps ρ = 1 (measured on outputs). Q4_K: the gguf package has no
    K-quant quantizer, so a merge is refused and nothing changes (the report says why)."""
    fmt = next(f for f, m in _MODELS.items() if m is model)
    before = storage_bytes(model)
    for i, rel in enumerate(REL_SIZES):
        sd, deltas = sized_lora(model, rel, seed=50 + i)
        w0 = {p: own_weight(model.get_submodule(p)) for p in MERGE_TARGETS}
        if fmt == "gguf-Q4_K":
            handle = loraweave.apply(model, sd, mode="merge", allow_empty=True)
            assert handle.report.applied == []
            misses = handle.report.unmatched
            assert len(misses) == len(sd) and all(u.kind == "no_mechanism" for u in misses)
            assert all("gguf package cannot quantize Q4_K" in u.reason for u in misses), misses[0].reason
            handle.remove()
            continue
        handle = loraweave.apply(model, sd, mode="merge", strict=True)
        rows = {a.module: a for a in handle.report.applied}
        for path in MERGE_TARGETS:
            assert rows[path].mechanism == "requantize", rows[path]
            rho = retention(w0[path], own_weight(model.get_submodule(path)), deltas[path])
            assert abs(rows[path].retention - rho) <= 1e-3, (fmt, rel, path, rows[path].retention, rho)
            if rel == REL_SIZES[0]:
                low, high = RHO_AT_1PCT[fmt]
                assert low <= rho <= high, (fmt, path, rho)
        handle.remove()
        assert changed_bytes(model, before) == []
        xs = {p: torch.randn(4, model.get_submodule(p).in_features, generator=gen(i)) for p in MERGE_TARGETS}
        with torch.no_grad():
            plain = {p: model.get_submodule(p)(x).double() for p, x in xs.items()}
            runtime = loraweave.apply(model, sd, mode="runtime", strict=True)
            for path, x in xs.items():
                got = model.get_submodule(path)(x).double() - plain[path]
                want = x.double() @ deltas[path].T
                assert abs(float((got * want).sum() / want.pow(2).sum()) - 1) <= 1e-4, (fmt, rel, path)
        runtime.remove()
        assert changed_bytes(model, before) == []


def test_float8_dynamic_activation_config_is_cuda_only():
    """docs/quantized-df.md names torchao's Float8DynamicActivationFloat8WeightConfig as CUDA-only (capability
    >= 8.9): checked here on torchao itself, so the claim fails the day torchao runs it on CPU."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_

    if torch.cuda.is_available():
        pytest.skip(
            "CUDA present: this test checks the CPU refusal only (the CUDA path is not verified here)"
        )
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with pytest.raises(AssertionError, match="CUDA compute capability"):
        quantize_(model, Float8DynamicActivationFloat8WeightConfig())
        model(torch.randn(2, 64))


def test_diffusers_refuses_a_gguf_tensor_of_the_wrong_block_count(folder):
    """Hostile input on the diffusers path: a GGUF file whose Q8_0 tensor holds 7 blocks per row where its
    layer takes 256 inputs (8 blocks). diffusers' own loader refuses it, naming the tensor, before a model
    exists, so no malformed GGUFLinear reaches loraweave through `from_single_file`."""
    import gguf
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    if not (folder / "config.json").is_file():
        saved_flux(folder)
    bad = "transformer_blocks.0.attn.to_q.weight"
    writer = gguf.GGUFWriter(str(folder / "bad.gguf"), arch="flux")
    for key, tensor in float_flux().state_dict().items():
        data = tensor.float().numpy()
        if key == bad:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(key, gguf.quants.quantize(data, q8)[:, : 7 * 34], raw_dtype=q8)
        else:
            writer.add_tensor(key, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=rf"{bad} has an expected shape of: torch.Size\(\[256, 256\]\)"):
        FluxTransformer2DModel.from_single_file(
            str(folder / "bad.gguf"),
            config=str(folder),
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        )


@pytest.mark.parametrize(
    ("mode", "extra", "why"),
    [
        ("auto", 0, r"GGUF Q8_0 blocks decode to \(32, 224\), the layer is \(32, 256\)"),
        ("runtime", 0, r"GGUF Q8_0 blocks decode to \(32, 224\), the layer is \(32, 256\)"),
        ("merge", 5, r"GGUF Q8_0 rows of 243 bytes are no whole number of 34-byte blocks"),
        ("auto", -1, r"unknown GGML type 999"),
    ],
)
def test_a_malformed_gguf_layer_is_refused_by_name(tmp_path, mode, extra, why):
    """A GGUFLinear built by hand (not through diffusers' loader, which refuses it) whose Q8_0 weight holds
    7 blocks per row for 256 inputs (or 7 blocks and 5 stray bytes): `apply` raises QuantizedWeightError
    naming the layer and what is wrong, in every mode, and no byte of the model changes. extra = -1: the
    weight names a GGML type that does not exist."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter

    from loraweave.errors import QuantizedWeightError

    w = torch.randn(32, 256, generator=gen(5)).numpy()
    q8 = gguf.GGMLQuantizationType.Q8_0
    blocks = gguf.quants.quantize(w, q8)[:, : 7 * 34]
    write_gguf_layer(tmp_path / "bad.gguf", "proj", blocks, "Q8_0", torch.zeros(32))
    model = torch.nn.Sequential()
    model.add_module("proj", gguf_linear(tmp_path / "bad.gguf", "proj", 256, 32))
    if extra == -1:
        model.proj.weight.quant_type = 999
    elif extra:
        padded = torch.cat([model.proj.weight.as_tensor(), torch.zeros(32, extra, dtype=torch.uint8)], 1)
        model.proj.weight = GGUFParameter(padded, requires_grad=False, quant_type=q8)
    sd = {"proj.lora_down.weight": torch.randn(4, 256), "proj.lora_up.weight": torch.randn(32, 4)}
    before = storage_bytes(model)
    with pytest.raises(QuantizedWeightError, match=r"proj: malformed gguf layer \(GGUFLinear\): " + why):
        loraweave.apply(model, sd, mode=mode)
    assert changed_bytes(model, before) == []
    assert not model.proj._forward_hooks and not model.proj._forward_pre_hooks
