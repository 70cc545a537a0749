"""A full-size SD1.5 UNet and text encoder in fp16 (diffusers/transformers classes from the real configs in
../shared/realdata/configs, seeded weights, ~2 GB) with every real adapter file in ../shared/realdata/lora that
fits SD1.5: plan, merge, runtime and remove(), bit-exact.

The files are picked by loraweave's own detection (SD1.x by its cross-attention width, or a UNet layout that names
no width: kohya LoKr, cloneofsimo positions) and named in SD15_FILES; a file detected otherwise (SD2, Flux) is
left out, one detected as SD1.5 and not listed fails the test, as does an empty list.

Values are checked on strided rows (every 97th, plus the last) of a few layers per file, the largest conv among
them (up_blocks.1 resnet conv1, 1280x2560x3x3 = 29.5M elements, past 2**24), against an fp64 formula read from the
file with the safetensors library: merged W' within one fp16 ulp of W + s·ΔW; runtime outputs within 2**-10·|y| +
2**-14·Σ|x||W| + 2**-9·s·Σ|x||ΔW| (fp16 output roundings, fp32 accumulation, the term's fp16 roundings), a
tolerance the adapter's own effect exceeds.
Peak RSS of the module (VmHWM, reset at its start) is logged and kept under 4 GiB."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REALDATA
from helpers.full_size import digests, sd15_text_encoder, sd15_unet
from helpers.real_files import REAL_FILES
from safetensors.torch import load_file

import loraweave
from loraweave.arch.detect import detect_architecture

pytestmark = pytest.mark.usefixtures("one_thread")  # 2 threads on 2 shared cores spin in OpenMP barriers
log = logging.getLogger("loraweave.tests")
LORA_DIR = REALDATA / "lora"
SD1_DETECTIONS = ("sd1", "unet")
SD15_FILES = {name for name, (kind, _, _) in REAL_FILES.items() if kind == "sd15"}  # each lands in full
STRENGTH = 0.75
GIB = 2**30
ATTN2_K = "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k"
ATTN1_Q = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
OUT = "up_blocks.3.attentions.2.transformer_blocks.0.attn1.to_out.0"
BIG_CONV = "up_blocks.1.resnets.0.conv1"
TE_Q = "encoder.layers.0.self_attn.q_proj"  # transformers 5 CLIPTextModel: no text_model level


def _sd15_files() -> list[Path]:
    found = []
    for path in sorted(LORA_DIR.glob("*.safetensors")):
        if detect_architecture(loraweave.load_adapter(path)).architecture in SD1_DETECTIONS:
            found.append(path)
    return found


FILES = _sd15_files()


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


@pytest.fixture(scope="module")
def rss():
    """Peak RSS over the module: VmHWM reset at its start (clear_refs 5), read and logged at its end."""
    Path("/proc/self/clear_refs").write_text("5")
    start = _status_bytes("VmRSS")
    yield start
    peak = _status_bytes("VmHWM")
    msg = f"realsize_sd15 peak_rss_gib={peak / GIB:.2f} start_rss_gib={start / GIB:.2f}"
    log.warning(msg)
    print(msg)
    assert peak - start < 4 * GIB, msg


@pytest.fixture(scope="module")
def sd15(rss):
    t0 = time.perf_counter()
    models = {"unet": sd15_unet(), "text_encoder": sd15_text_encoder()}
    log.info("realsize_sd15 build_s=%.1f", time.perf_counter() - t0)
    return models


@pytest.fixture(scope="module")
def originals(sd15):
    return {c: digests(m) for c, m in sd15.items()}


def _module(models: dict, name: str) -> torch.nn.Module:
    component = "text_encoder" if name.startswith("encoder.") else "unet"
    return models[component].get_submodule(name)


def _deltas(path: Path, models: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (ΔW, |ΔW| bound) in fp64 as (out, in·k), read with safetensors for a few layers of each layout."""
    t = {k: v.double() for k, v in load_file(str(path)).items()}
    out = {}
    if any(k.endswith(".lokr_w1_a") for k in t):  # kohya LoKr: scale alpha / rank, kron(w1a·w1b, w2a·w2b)
        for name in (ATTN2_K, BIG_CONV, TE_Q):
            p = ("lora_te_text_model_" if name == TE_Q else "lora_unet_") + name.replace(".", "_")
            w1a, w1b, w2a, w2b = (t[f"{p}.lokr_{n}"] for n in ("w1_a", "w1_b", "w2_a", "w2_b"))
            scale = float(t[f"{p}.alpha"]) / w1b.shape[0]
            delta = scale * torch.kron(w1a @ w1b, w2a @ w2b)
            bound = abs(scale) * torch.kron(w1a.abs() @ w1b.abs(), w2a.abs() @ w2b.abs())
            out[name] = (delta, bound)
        return out
    if "unet:0:up" in t:  # cloneofsimo: index 0 is the first Linear of the first Attention (to_q), scale 1
        pairs = {ATTN1_Q: (t["unet:0:up"], t["unet:0:down"])}
    elif any(".processor." in k for k in t):  # diffusers attention processors, with or without "unet."
        unet = "unet." if any(k.startswith("unet.") for k in t) else ""

        def proc(name: str, role: str) -> torch.Tensor:
            attn, proj = name.rsplit(".", 1) if not name.endswith("to_out.0") else (name[:-9], "to_out")
            return t[f"{unet}{attn}.processor.{proj}_lora.{role}.weight"]

        pairs = {n: (proc(n, "up"), proc(n, "down")) for n in (ATTN2_K, OUT)}
    else:  # diffusers "unet.<module>.lora.up/down.weight"
        pairs = {n: (t[f"unet.{n}.lora.up.weight"], t[f"unet.{n}.lora.down.weight"]) for n in (ATTN2_K, OUT)}
    return {n: (up @ down, up.abs() @ down.abs()) for n, (up, down) in pairs.items()}


def _rows(n: int) -> torch.Tensor:
    return torch.tensor(sorted({*range(0, n, 97), n - 1}))


def _ulp16(x: torch.Tensor) -> torch.Tensor:
    """One fp16 ulp at |x| (subnormals: 2**-24)."""
    return 2.0 ** (torch.floor(torch.log2(x.abs().clamp_min(2.0**-14))) - 10)


def _forward64(
    module: torch.nn.Module, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> torch.Tensor:
    if isinstance(module, torch.nn.Conv2d):
        return F.conv2d(x, w.view(module.weight.shape), b, module.stride, module.padding)
    return F.linear(x, w, b)


def _input(module: torch.nn.Module, g: torch.Generator) -> torch.Tensor:
    shape = (1, module.in_channels, 6, 6) if isinstance(module, torch.nn.Conv2d) else (3, module.in_features)
    return torch.randn(shape, generator=g).to(torch.float16)


def test_sd15_files_found():
    """Detection picks exactly the real SD1.5 files named in SD15_FILES (and at least one)."""
    assert FILES, f"no SD1.5 adapter file found in {LORA_DIR}"
    assert {p.name for p in FILES} == SD15_FILES


@pytest.mark.parametrize(
    "path", FILES, ids=lambda p: p.name.split("__")[0] + "_" + p.name.split("__")[-1][:18]
)
def test_plan_merge_runtime_remove(path, sd15, originals):
    report = loraweave.plan(sd15, path)
    assert report.unmatched == [] and report.keys_applied == report.keys_total > 0
    deltas = _deltas(path, sd15)
    before = {}
    for name in deltas:
        m = _module(sd15, name)
        w = m.weight.detach().reshape(m.weight.shape[0], -1)
        before[name] = (w.clone(), None if m.bias is None else m.bias.detach().clone())
    touched = {
        c: {f"{a.module}.{p}" for a in report.applied if a.component == c for p in ("weight", "bias")}
        for c in sd15
    }

    t0 = time.perf_counter()
    handle = loraweave.apply(sd15, path, mode="merge", strength=STRENGTH)
    merge_s = time.perf_counter() - t0
    assert handle.report.keys_applied == report.keys_total
    for name, (delta, _) in deltas.items():
        m, (w0, _) = _module(sd15, name), before[name]
        rows = _rows(w0.shape[0])
        ref = w0[rows].double() + STRENGTH * delta[rows]
        got = m.weight.detach().reshape(w0.shape)[rows].double()
        assert bool(((got - ref).abs() <= _ulp16(ref)).all()), f"{name}: merged rows off by more than 1 ulp"
        assert not torch.equal(got, w0[rows].double()), f"{name}: the merge left the sampled rows unchanged"
    t0 = time.perf_counter()
    handle.remove()
    remove_s = time.perf_counter() - t0
    for c, m in sd15.items():
        assert digests(m, touched[c]) == {k: originals[c][k] for k in touched[c] if k in originals[c]}

    g = torch.Generator().manual_seed(2)
    inputs = {name: _input(_module(sd15, name), g) for name in deltas}
    plain = {name: _module(sd15, name)(x) for name, x in inputs.items()}
    handle = loraweave.apply(sd15, path, mode="runtime", strength=STRENGTH)
    for name, (delta, bound) in deltas.items():
        m, (w0, b0), x = _module(sd15, name), before[name], inputs[name]
        with torch.no_grad():
            y = m(x).double()
        xd = x.double()
        ref = _forward64(m, xd, w0.double() + STRENGTH * delta, None if b0 is None else b0.double())
        b64 = None if b0 is None else b0.double()
        base_bound = _forward64(m, xd.abs(), w0.double().abs(), None if b0 is None else b64.abs())
        delta_bound = STRENGTH * _forward64(m, xd.abs(), bound, None)
        # fp16 output roundings (2**-11 of |y|, twice: base and sum), the base's fp32 blocked accumulation
        # (2**-14 of its bound) and fp16 roundings inside the adapter term (2**-9 of its bound)
        tol = 2.0**-10 * ref.abs() + 2.0**-14 * base_bound + 2.0**-9 * delta_bound
        assert bool(((y - ref).abs() <= tol).all()), f"{name}: runtime output off"
        effect = (ref - _forward64(m, xd, w0.double(), None if b0 is None else b0.double())).abs()
        assert bool((effect > tol).any()), f"{name}: the adapter's effect is below the tolerance"
    for c, m in sd15.items():  # runtime never writes the weights
        assert digests(m, touched[c]) == {k: originals[c][k] for k in touched[c] if k in originals[c]}
    handle.remove()
    for name, x in inputs.items():
        with torch.no_grad():
            assert torch.equal(_module(sd15, name)(x), plain[name])
    log.info(
        "realsize_sd15 file=%s layers=%d merge_s=%.2f remove_s=%.2f",
        path.name,
        len(report.applied),
        merge_s,
        remove_s,
    )


def test_lokr_compact_undo_on_the_largest_conv():
    """The real LoKr part of up_blocks.1.resnets.0.conv1 (29.5M elements, past 2**24) merged with undo="compact"
    into that conv alone, at full size: remove() restores it bit for bit (float32 witness positions once ran past
    the end here: this case and the whole-model falcon_4 case both failed with IndexError on 2cef893^)."""
    unet = torch.nn.Module()
    conv = torch.nn.Conv2d(2560, 1280, 3, padding=1, dtype=torch.float16).requires_grad_(False)
    unet.add_module("up_blocks", torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()]))
    unet.up_blocks[1].add_module("resnets", torch.nn.ModuleList([torch.nn.Module()]))
    unet.up_blocks[1].resnets[0].add_module("conv1", conv)
    g = torch.Generator().manual_seed(3)
    conv.weight.uniform_(-(23040**-0.5), 23040**-0.5, generator=g)
    before = conv.weight.clone()
    path = LORA_DIR / "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors"
    handle = loraweave.apply({"unet": unet}, path, mode="merge", undo="compact", allow_empty=True)
    assert [a.undo for a in handle.report.applied] == ["compact"]
    assert not torch.equal(conv.weight, before)
    handle.remove()
    assert torch.equal(conv.weight.view(torch.int16), before.view(torch.int16))
