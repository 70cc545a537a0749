"""Seeded mutations of the real adapter files in ../shared/realdata: header length, header JSON, dtypes,
offsets, shapes, tensor values, metadata and key names. For every mutated file, in merge, runtime and auto
mode:
- only loraweave's typed errors (LoraweaveError) escape, never a crash;
- no non-finite value is merged silently (weights finite before stay finite, or a typed error is raised);
- after an error the model is bit-identical and hook-free; after a success, remove() makes it so;
- `loraweave inspect FILE --json` prints valid JSON or one error line, never a traceback.

The target is the full-size SD1.5 UNet and text encoder on the meta device with a few of the layers each file
touches made real (seeded weights, fp32 or fp16): every other layer stays on meta and reports a miss.
LORAWEAVE_FUZZ_CASES sets the number of cases (CI: a small count; e.g. 3000 on demand)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import struct
import traceback
from pathlib import Path

import pytest
import torch
from conftest import REALDATA
from helpers.common import real_config

import loraweave
from loraweave import LoraweaveError
from loraweave.cli import main as cli_main
from loraweave.engine.install import resolve_set

CASES = int(os.environ.get("LORAWEAVE_FUZZ_CASES", "24"))
FILES = [  # SD1.5 files: diffusers/PEFT-named LoRA, cloneofsimo (metadata-driven), LyCORIS LoKr (kohya ss_*)
    "Haseebae__Synthetic_dataset_generator_with_stable_diffusion__pytorch_lora_weights.safetensors",
    "catundchat__stable-diffusion-v1.5-lora__pytorch_lora_weights.safetensors",
    "timohavdk__sd-lora__2100-lora.safetensors",
    "cloneofsimo__lora__analog_svd_rank4.safetensors",
    "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors",
    "KohakuBlueleaf__LyCORIS__smart_falcon_8_lokr.safetensors",
]
DTYPES = [
    "F64",
    "F32",
    "F16",
    "BF16",
    "I64",
    "I32",
    "I16",
    "I8",
    "U8",
    "BOOL",
    "U16",
    "U32",
    "U64",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E8M0",
    "C64",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
]
JUNK = [
    '{"r": [4], "lora_alpha": 4}',
    '{"r": 4, "lora_alpha": [1]}',
    '{"r": 1e400, "lora_alpha": 4}',
    '{"r": 4, "lora_alpha": 4, "alpha_pattern": {"(": 2}}',
    '{"r": 4, "rank_pattern": {"down": "x"}}',
    '{"r": -3, "lora_alpha": 4}',
    '{"lora_alpha": NaN}',
    '{"use_rslora": "yes", "lora_alpha": 1}',
    "[1, 2]",
    '{"a":',
    "nan",
    "1e999",
    "-0",
    "",
    "None",
    "\ud800",
    '["CLIPAttention", 3]',
    "7",
    '{"conv_alpha": "x"}',
    '{"r": 4, "lora_alpha": 1e30}',
    '{"r": 1, "lora_alpha": 1e-30}',
]
META_FIELDS = ["lora_adapter_metadata", "ss_network_alpha", "ss_network_args", "unet", "text_encoder"]


@pytest.fixture(scope="module")
def sd15(realdata):
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        return {
            "unet": UNet2DConditionModel.from_config(real_config("sd15__unet_config.json")),
            "text_encoder": CLIPTextModel(CLIPTextConfig(**real_config("sd15__text_encoder_config.json"))),
        }


def split(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(header: dict, data: bytes, pad: int = 0) -> bytes:
    text = json.dumps(header).encode() + b" " * pad
    return struct.pack("<Q", len(text)) + text + data


def tensors(header: dict) -> list[str]:
    return [k for k in header if k != "__metadata__"]


KINDS = ["header_length", "json", "dtype", "offsets", "shape", "values", "metadata", "keys"]


def mutate(raw: bytes, rng: random.Random, hot: list[str], kind: str) -> tuple[bytes, str]:
    """One seeded mutation of a safetensors file; `hot` are keys landing on real layers (values go there)."""
    header, data = split(raw)
    key = rng.choice(tensors(header))
    entry = header[key]
    if kind == "header_length":
        out = join(header, data, pad=rng.choice([0, 1, 7, 8]))
        n = struct.unpack("<Q", out[:8])[0]
        delta = rng.choice([-1, 1, -8, 8, -n, n * 3, 2**40, rng.randrange(-n, n)])
        return struct.pack("<Q", max(0, n + delta)) + out[8:], f"{kind} {delta:+d}"
    if kind == "json":
        text = bytearray(json.dumps(header).encode())
        pos = rng.randrange(len(text))
        how = rng.choice(["flip", "cut", "insert"])
        if how == "flip":
            text[pos] ^= 1 << rng.randrange(8)
        elif how == "cut":
            del text[pos:]
        else:
            text[pos:pos] = rng.choice([b"{", b"]", b'"', b",", b"\\u", b"\xff", b'"__metadata__": 1,'])
        return struct.pack("<Q", len(text)) + bytes(text) + data, f"{kind} {how}@{pos}"
    if kind == "dtype":
        entry["dtype"] = rng.choice([rng.choice(DTYPES), ["F32"], 7, None, "F9", {"F32": 1}])
        return join(header, data), f"{kind} {key} {entry['dtype']!r}"
    if kind == "offsets":
        b, e = entry["data_offsets"]
        other = header[rng.choice(tensors(header))]["data_offsets"]
        entry["data_offsets"] = rng.choice(
            [
                [b + 1, e + 1],
                [e, b],
                [b, e + 4],
                [-1, e],
                [float(b), float(e)],
                "x",
                [b],
                [b, e, e],
                list(other),
                [b - 2, e - 2],
            ]
        )
        return join(header, data), f"{kind} {key} {entry['data_offsets']!r}"
    if kind == "shape":
        shape = list(entry["shape"])
        entry["shape"] = rng.choice(
            [
                shape + [1],
                shape[:-1],
                [0] + shape,
                [10**30, 0],
                [-1] + shape[1:],
                [float(d) for d in shape],
                shape[::-1],
                [(shape[0] if shape else 1) * 2] + shape[1:],
                "x",
                None,
            ]
        )
        return join(header, data), f"{kind} {key} {entry['shape']!r}"
    if kind == "values":
        key = rng.choice(hot or tensors(header))
        entry = header[key]
        b, e = entry["data_offsets"]
        width = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}.get(entry["dtype"])
        if width is None or e == b:
            return join(header, data), f"{kind} {key} (not float: unchanged)"
        fmt = {4: "<f", 2: "<e", 8: "<d"}[width]
        big = {4: 3.0e38, 2: 65000.0, 8: 1.0e300}[width]
        value = rng.choice([float("nan"), float("inf"), -float("inf"), big, -big, big / 1e3])
        buf = bytearray(data)
        count = rng.choice([1, 3, (e - b) // width])
        for i in rng.sample(range((e - b) // width), min(count, (e - b) // width)):
            if entry["dtype"] == "BF16":
                buf[b + 2 * i : b + 2 * i + 2] = struct.pack("<f", value)[2:]
            else:
                buf[b + width * i : b + width * (i + 1)] = struct.pack(fmt, value)
        return join(header, bytes(buf)), f"{kind} {key} {value} x{count}"
    if kind == "metadata":
        meta = dict(header.get("__metadata__", {}))
        meta[rng.choice(META_FIELDS)] = rng.choice(JUNK)
        header["__metadata__"] = rng.choice([meta, meta, {"x": 1}, [], "s"])
        return join(header, data), f"{kind} {header['__metadata__']!r:.120}"
    new = rng.choice(
        [
            key + "\ud800",
            key.replace(".", "_", 1),
            key + ".alpha",
            key.replace("weight", "w"),
            "lora_te_" + key,
            key.upper(),
        ]
    )
    header[new] = header.pop(key)
    return join(header, data), f"keys {key!r} -> {new!r}"


def materialize(sd15: dict, path: Path, dtype: torch.dtype, rng: random.Random) -> tuple[list, list[str]]:
    """Make three of the smaller layers `path` touches real; returns them and the keys landing on them."""
    plan, _ = resolve_set(sd15, str(path), 1.0)
    by_layer: dict[tuple[str, str], list[str]] = {}
    for pp in plan.planned:
        for piece in pp.pieces:
            by_layer.setdefault((pp.component, piece.module), []).extend(pp.part.keys)
    size = {layer: sd15[layer[0]].get_submodule(layer[1]).weight.numel() for layer in by_layer}
    chosen = rng.sample(sorted(by_layer, key=size.get)[:40], 3)
    layers = []
    for comp, name in chosen:
        module = sd15[comp].get_submodule(name)
        if module.weight.device.type == "meta":
            module.to_empty(device="cpu")
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            with torch.no_grad():
                for p in module.parameters(recurse=False):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        module.to(dtype)
        layers.append((f"{comp}.{name}", module))
    return layers, sorted({k for layer in chosen for k in by_layer[layer]})


def snapshot(layers) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for _, m in layers]


def unchanged(layers, snap) -> bool:
    return all(
        m.state_dict().keys() == s.keys() and all(torch.equal(m.state_dict()[k], s[k]) for k in s)
        for (_, m), s in zip(layers, snap, strict=True)
    )


def no_hooks(sd15) -> bool:
    return all(
        not m._forward_hooks and "forward" not in m.__dict__ for root in sd15.values() for m in root.modules()
    )


def inspect_case(path: Path, label: str) -> str | None:
    """`loraweave inspect FILE --json`: a typed error is one line and exit code 2; otherwise valid JSON."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(["inspect", str(path), "--json"])
    except Exception:  # noqa: BLE001  a crash is what this test looks for
        return f"{label}: inspect crashed\n{traceback.format_exc(limit=6)}"
    if code == 0:
        try:
            json.loads(out.getvalue())
        except ValueError as exc:
            return f"{label}: inspect --json printed invalid JSON ({exc})"
    elif len(err.getvalue().strip().splitlines()) != 1:
        return f"{label}: inspect failed with {err.getvalue()!r}, not one line"
    return None


def run_case(
    sd15, raw: bytes, case: int, tmp_path: Path, layers, hot: list[str], mode: str, rng: random.Random
) -> str | None:
    """One mutated file through apply; returns a failure description or None."""
    mutated, what = mutate(raw, rng, hot, KINDS[case % len(KINDS)])
    path = tmp_path / f"case{case}.safetensors"
    path.write_bytes(mutated)
    failure = inspect_case(path, f"case {case} ({what})")
    if failure:
        return failure
    snap = snapshot(layers)
    finite = [{k: torch.isfinite(v.float()) for k, v in s.items()} for s in snap]
    try:
        handle = loraweave.apply(sd15, str(path), mode=mode)
    except LoraweaveError:
        if not unchanged(layers, snap) or not no_hooks(sd15):
            return f"case {case} ({mode}, {what}): model changed after a typed error"
        return None
    except Exception:  # noqa: BLE001  a crash is what this test looks for
        return f"case {case} ({mode}, {what}): crash\n{traceback.format_exc(limit=6)}"
    try:
        json.dumps(handle.report.to_dict())
        for (name, m), was in zip(layers, finite, strict=True):
            for k, v in m.state_dict().items():
                if bool((was[k] & ~torch.isfinite(v.float())).any()):
                    return f"case {case} ({mode}, {what}): non-finite values merged into {name}.{k}"
    finally:
        handle.remove()
    if not unchanged(layers, snap) or not no_hooks(sd15):
        return f"case {case} ({mode}, {what}): remove() did not restore the model"
    return None


def test_fuzz_real_files(sd15, tmp_path):
    assert CASES > 0
    failures = []
    per_file = max(1, -(-CASES // len(FILES)))
    for index, name in enumerate(FILES):
        rng = random.Random(1000 + index)
        path = REALDATA / "lora" / name
        raw = path.read_bytes()
        layers, hot = materialize(sd15, path, torch.float16 if index % 2 else torch.float32, rng)
        assert layers, name
        for case in range(per_file):
            mode = ("merge", "runtime", "auto")[case % 3]
            failure = run_case(sd15, raw, index * per_file + case, tmp_path, layers, hot, mode, rng)
            if failure:
                failures.append(failure)
    assert not failures, f"{len(failures)} of {per_file * len(FILES)} cases failed:\n" + "\n".join(
        failures[:10]
    )
