"""A full-size SD1.5 UNet and text encoder in fp16 (diffusers/transformers classes from the real configs in
../shared/realdata/configs, seeded weights, ~2 GB) with every real adapter file in ../shared/realdata/lora
that fits SD1.5: plan, merge, runtime and remove(), bit-exact.

The files are picked by loraweave's own detection (SD1.x by its cross-attention width, or a UNet layout that
names no width: kohya LoKr, cloneofsimo positions) and named in SD15_FILES; a file detected otherwise (SD2,
Flux) is left out, one detected as SD1.5 and not listed fails the test, as does an empty list.

Values are checked on strided rows (every 97th, plus the last) of a few layers per file, the largest conv
among them (up_blocks.1 resnet conv1, 1280x2560x3x3 = 29.5M elements, past 2**24), against an fp64 formula
read from the file with the safetensors library: merged W' within one fp16 ulp of W + s·ΔW; runtime outputs
within 2**-10·|y| + 2**-14·Σ|x||W| + 2**-9·s·Σ|x||ΔW| (fp16 output roundings, fp32 accumulation, the term's
fp16 roundings), a tolerance the adapter's own effect exceeds.
Peak RSS of the module (VmHWM, reset at its start) is logged and kept under 4 GiB."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REALDATA
from helpers.full_size import assert_seeded_params, sd15_text_encoder, sd15_unet
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
SEEDS = {"unet": 0, "text_encoder": 1}  # the models' seeded_ seeds
CHANNELS = 128  # output channels per fp64 runtime reference chunk (of the 29.5M conv: 24 MB per fp64 copy)
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
    models = {
        "unet": sd15_unet(seed=SEEDS["unet"]),
        "text_encoder": sd15_text_encoder(seed=SEEDS["text_encoder"]),
    }
    log.info("realsize_sd15 build_s=%.1f", time.perf_counter() - t0)
    return models


def assert_original(models: dict, touched: dict[str, set[str]], what: str) -> None:
    """The touched parameters hold their seeded bits again (regenerated, not hashed: a copy-speed compare)."""
    for c, m in models.items():
        assert_seeded_params(m, SEEDS[c], touched[c], f"{what} {c}")


def _module(models: dict, name: str) -> torch.nn.Module:
    component = "text_encoder" if name.startswith("encoder.") else "unet"
    return models[component].get_submodule(name)


RowsOf = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _lokr_rows(w1a, w1b, w2a, w2b, scale: float) -> RowsOf:
    """Rows of scale·kron(w1a·w1b, w2a·w2b) and of its bound (row i·b + k is w1[i] ⊗ w2[k], b = w2's rows):
    the products torch.kron forms, for the asked rows only (a whole 1280x23040 fp64 ΔW and bound were 472
    MB)."""
    w1, w2 = w1a @ w1b, w2a @ w2b
    m1, m2 = w1a.abs() @ w1b.abs(), w2a.abs() @ w2b.abs()

    def rows(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, k = idx // w2.shape[0], idx % w2.shape[0]

        def kron(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return (u[i][:, :, None] * v[k][:, None, :]).reshape(len(idx), -1)

        return scale * kron(w1, w2), abs(scale) * kron(m1, m2)

    return rows


def _lora_rows(up: torch.Tensor, down: torch.Tensor) -> RowsOf:
    return lambda idx: (up[idx] @ down, up[idx].abs() @ down.abs())


def _deltas(path: Path, models: dict) -> dict[str, RowsOf]:
    """module -> rows -> (ΔW, |ΔW| bound) on those rows in fp64 as (rows, in·k), from the factors read with
    safetensors for a few layers of each layout."""
    t = {k: v.double() for k, v in load_file(str(path)).items()}
    out = {}
    if any(k.endswith(".lokr_w1_a") for k in t):  # kohya LoKr: scale alpha / rank, kron(w1a·w1b, w2a·w2b)
        for name in (ATTN2_K, BIG_CONV, TE_Q):
            p = ("lora_te_text_model_" if name == TE_Q else "lora_unet_") + name.replace(".", "_")
            w1a, w1b, w2a, w2b = (t[f"{p}.lokr_{n}"] for n in ("w1_a", "w1_b", "w2_a", "w2_b"))
            out[name] = _lokr_rows(w1a, w1b, w2a, w2b, float(t[f"{p}.alpha"]) / w1b.shape[0])
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
    return {n: _lora_rows(up, down) for n, (up, down) in pairs.items()}


def _rows(n: int) -> torch.Tensor:
    return torch.tensor(sorted({*range(0, n, 97), n - 1}))


def _ulp16(x: torch.Tensor) -> torch.Tensor:
    """One fp16 ulp at |x| (subnormals: 2**-24)."""
    return 2.0 ** (torch.floor(torch.log2(x.abs().clamp_min(2.0**-14))) - 10)


def _forward64(
    module: torch.nn.Module, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> torch.Tensor:
    """The layer's forward with (some of its output channels') weight `w` flattened to (channels, in·k)."""
    if isinstance(module, torch.nn.Conv2d):
        return F.conv2d(x, w.view(-1, *module.weight.shape[1:]), b, module.stride, module.padding)
    return F.linear(x, w, b)


def _check_runtime(name, m, x, y, w0, b0, rows_of: RowsOf) -> None:
    """The runtime output `y` within the fp16/fp32 bound of the fp64 formula on every output channel, CHANNELS
    at a time; and the adapter's effect exceeds that tolerance somewhere (so the check could fail)."""
    xd = x.double()
    effect_seen = False
    for lo in range(0, w0.shape[0], CHANNELS):
        rows = slice(lo, lo + CHANNELS)
        delta, bound = rows_of(torch.arange(w0.shape[0])[rows])
        w, b = w0[rows].double(), None if b0 is None else b0[rows].double()
        ref = _forward64(m, xd, w + STRENGTH * delta, b)
        base_bound = _forward64(m, xd.abs(), w.abs(), None if b is None else b.abs())
        delta_bound = STRENGTH * _forward64(m, xd.abs(), bound, None)
        # fp16 output roundings (2**-11 of |y|, twice: base and sum), the base's fp32 blocked accumulation
        # (2**-14 of its bound) and fp16 roundings inside the adapter term (2**-9 of its bound)
        tol = 2.0**-10 * ref.abs() + 2.0**-14 * base_bound + 2.0**-9 * delta_bound
        got = y[:, rows] if isinstance(m, torch.nn.Conv2d) else y[..., rows]
        assert bool(((got - ref).abs() <= tol).all()), f"{name}: runtime output off (channels {lo}+)"
        effect = (ref - _forward64(m, xd, w, b)).abs()
        effect_seen |= bool((effect > tol).any())
    assert effect_seen, f"{name}: the adapter's effect is below the tolerance"


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
def test_plan_merge_runtime_remove(path, sd15):
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
    for name, rows_of in deltas.items():
        m, (w0, _) = _module(sd15, name), before[name]
        rows = _rows(w0.shape[0])
        ref = w0[rows].double() + STRENGTH * rows_of(rows)[0]
        got = m.weight.detach().reshape(w0.shape)[rows].double()
        assert bool(((got - ref).abs() <= _ulp16(ref)).all()), f"{name}: merged rows off by more than 1 ulp"
        assert not torch.equal(got, w0[rows].double()), f"{name}: the merge left the sampled rows unchanged"
    t0 = time.perf_counter()
    handle.remove()
    remove_s = time.perf_counter() - t0
    assert_original(sd15, touched, "after the merge's remove()")

    g = torch.Generator().manual_seed(2)
    inputs = {name: _input(_module(sd15, name), g) for name in deltas}
    plain = {name: _module(sd15, name)(x) for name, x in inputs.items()}
    handle = loraweave.apply(sd15, path, mode="runtime", strength=STRENGTH)
    for name, rows_of in deltas.items():
        m, (w0, b0), x = _module(sd15, name), before[name], inputs[name]
        with torch.no_grad():
            y = m(x).double()
        _check_runtime(name, m, x, y, w0, b0, rows_of)
    assert_original(sd15, touched, "runtime never writes the weights:")
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
    """The real LoKr part of up_blocks.1.resnets.0.conv1 (29.5M elements, past 2**24) merged with
    undo="compact" into that conv alone, at full size: remove() restores it bit for bit (float32 witness
    positions once ran past the end here: this case and the whole-model falcon_4 case both failed with
    IndexError on 2cef893^)."""
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
