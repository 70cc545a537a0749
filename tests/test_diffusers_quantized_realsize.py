"""Real-size tier of test_diffusers_quantized: one full-width Flux layer, `transformer_blocks.0.ff.net.2`
(3072x12288, 37.7M weights), in torchao float8 and GGUF Q4_K, a rank-16 LoRA through `loraweave.apply`.

torchao: `quantize_(root, Float8WeightOnlyConfig())` on the seeded fp32 layer (the call diffusers'
TorchAoConfig makes per layer; the tiny tier goes through diffusers' own loader). GGUF: a .gguf file holding
the layer's Q4_K super-blocks, read by diffusers' `load_gguf_checkpoint` into its `GGUFLinear` (what
`from_single_file` does).

Checks, as the tiny tier: the output with the LoRA equals the base's own output plus x·(B·A)ᵀ in fp64, within
1e-5·max|term| + 4·eps32·max|y| (fp32 compute); the report names "runtime"; every stored byte (float8 data and
row scales, Q4_K blocks, bias) is unchanged while applied and after `remove()`, and the output after removal
is bit-equal to the base's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from helpers.diffusers_quant import changed_bytes, gguf_linear, q4k_blocks, storage_bytes, write_gguf_layer
from helpers.realsize import Holder, RealLayer, holder, layer_input, lora_for, lora_term64, materialized

import loraweave

pytestmark = [pytest.mark.realsize, pytest.mark.usefixtures("one_thread")]

FF2 = RealLayer("flux", "transformer_blocks.0.ff.net.2", (3072, 12288))
SEED = 11


@contextmanager
def _torchao() -> Iterator[Holder]:
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    root = holder(FF2)
    with materialized(root, ["layer"], torch.float32, SEED):  # back on meta afterwards
        quantize_(root, Float8WeightOnlyConfig())
        assert type(root.layer.weight).__name__ == "Float8Tensor"
        yield root


@contextmanager
def _gguf(tmp_path) -> Iterator[Holder]:
    out, fan_in = FF2.shape
    path = tmp_path / "ff2-q4k.gguf"
    bias = torch.randn(out, generator=torch.Generator().manual_seed(SEED)) * 0.01
    write_gguf_layer(path, "layer", q4k_blocks(out, fan_in, absmax=4 / fan_in**0.5, seed=SEED), "Q4_K", bias)
    root = Holder(gguf_linear(path, "layer", fan_in, out))
    assert type(root.layer).__name__ == "GGUFLinear" and int(root.layer.weight.quant_type) == 12  # Q4_K
    yield root


@pytest.mark.parametrize("fmt", ["torchao-float8", "gguf-Q4_K"])
def test_full_width_flux_layer_exact_and_untouched(fmt, tmp_path):
    lora = lora_for(FF2, rank=16, rel=0.05, seed=3)
    x = layer_input(FF2, torch.float32, seed=4)
    with _torchao() if fmt == "torchao-float8" else _gguf(tmp_path) as root, torch.no_grad():
        base = root(x)
        before = storage_bytes(root)
        handle = loraweave.apply(root, lora.state_dict("layer"), mode="auto", strict=True)
        (row,) = handle.report.applied
        assert row.mechanism == "runtime", row
        assert changed_bytes(root, before) == []
        y = root(x).double()
        term = lora_term64(FF2, x, lora)
        err = float((y - base.double() - term).abs().max())
        bound = 1e-5 * float(term.abs().max()) + 4 * torch.finfo(torch.float32).eps * float(y.abs().max())
        assert err <= bound, (fmt, err, bound)
        handle.remove()
        assert changed_bytes(root, before) == []
        assert torch.equal(root(x), base)


def test_full_width_float8_merge_reports_what_the_grid_kept():
    """mode="merge" on the full-width float8 layer requantizes it (per-row e4m3 scales re-derived): the
    report's retention equals ρ = ⟨ΔW_kept, ΔW⟩/‖ΔW‖² measured from torchao's own dequantize; remove() is
    bit-exact. The values for a LoRA of 1 % and 5 % of ‖W‖ are the real-size rows of docs/quantized-df.md."""
    with _torchao() as root, torch.no_grad():
        before = storage_bytes(root)
        w0 = root.layer.weight.dequantize().double()
        for rel in (0.01, 0.05):
            lora = lora_for(FF2, rank=16, rel=rel, seed=3)
            handle = loraweave.apply(root, lora.state_dict("layer"), mode="merge", strict=True)
            (row,) = handle.report.applied
            assert row.mechanism == "requantize", row
            intended = lora.b.double() @ lora.a.double()
            kept = root.layer.weight.dequantize().double() - w0
            rho = float((kept * intended).sum() / intended.pow(2).sum())
            assert abs(row.retention - rho) <= 1e-3, (rel, row.retention, rho)
            assert rho < 0.9 if rel == 0.01 else rho > 0.5, (rel, rho)
            handle.remove()
            assert changed_bytes(root, before) == []
