"""Start-up: `import loraweave` and `loraweave inspect FILE --no-coverage` never import torch (checked in
fresh child processes), and the torch-free header readers (dtype names, scalar alphas) agree with the torch
path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import loraweave
from loraweave.io.safetensors_file import SafetensorsFile

SRC = str(Path(loraweave.__file__).resolve().parents[1])
DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bool,
]


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_import_loraweave_does_not_import_torch():
    out = _python(
        "import sys, loraweave; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'));"
        "loraweave.parse_prompt; loraweave.AdapterSpec; print('torch' in sys.modules);"
        "loraweave.apply; print('torch' in sys.modules)"
    )
    assert out.split("\n")[:3] == ["[]", "False", "True"]  # a torch name read later imports it (lazily)


def _lora_file(path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i, dtype in enumerate([torch.float32, torch.float16, torch.bfloat16]):
        stem = f"lora_unet_down_blocks_0_attentions_0_proj_in_{i}"
        sd[f"{stem}.lora_down.weight"] = torch.randn(4, 8, generator=g).to(dtype)
        sd[f"{stem}.lora_up.weight"] = torch.randn(8, 4, generator=g).to(dtype)
        sd[f"{stem}.alpha"] = torch.tensor(2.5 + i, dtype=dtype)
    save_file(sd, path)
    return path


def test_inspect_without_coverage_does_not_import_torch(tmp_path):
    path = _lora_file(tmp_path / "lora.safetensors")
    code = (
        "import sys, io, contextlib\nfrom loraweave import cli\nbuf = io.StringIO()\n"
        f"sys.argv = ['loraweave', 'inspect', {str(path)!r}, '--no-coverage', '--json']\n"
        "with contextlib.redirect_stdout(buf):\n    rc = cli.main()\n"
        "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules, 'info': json.loads(buf.getvalue())}))"
    )
    res = json.loads(_python("import json\n" + code))
    assert res["rc"] in (0, None) and res["torch"] is False
    info = res["info"]
    assert info["coverage"]["checked"] is False and info["coverage"]["keys_total"] == 9
    assert info["dtypes"] == {"float32": 3, "float16": 3, "bfloat16": 3}
    assert info["alphas"] == {"2.5": 1, "3.5": 1, "4.5": 1}
    # the same facts as the torch path (full inspect, in this process)
    from loraweave.tools.inspect import inspect_adapter

    full = inspect_adapter(path)
    assert full["coverage"]["checked"] is True
    for key in ("dtypes", "alphas", "ranks", "layout", "families"):
        assert info[key] == full[key], key
    assert info["architecture"]["name"] == "unet" == full["architecture"]["name"]
    # `proj_in_0..2` are no UNet's modules: the fit lands 0 keys on each and names none (issue 42 item 9)
    assert full["architecture"]["evidence"][-1].endswith("-> none of them")


def test_inspect_strict_needs_coverage(tmp_path):
    path = _lora_file(tmp_path / "lora.safetensors")
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run(
        [sys.executable, "-m", "loraweave.cli", "inspect", str(path), "--no-coverage", "--strict"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and "--strict needs coverage" in proc.stderr


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_header_dtype_names_and_scalars_match_torch(tmp_path, dtype):
    value = torch.tensor([1.75 if dtype.is_floating_point else 1 if dtype == torch.bool else 7]).to(dtype)
    big = torch.zeros(3, 2).to(dtype)
    save_file({"s": value.reshape(()).clone(), "v": value, "big": big}, tmp_path / "t.safetensors")
    with SafetensorsFile(tmp_path / "t.safetensors") as f:
        for key in ("s", "v", "big"):
            assert f.dtype(key) == dtype and f.dtype_name(key) == str(dtype).removeprefix("torch.")
        assert f.scalar("big") is None  # more than one element
        got = f.scalar("s")
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bool):
            assert got is None  # no struct format: the caller falls back to the tensor
        else:
            assert got == float(f.get("s").float()) == float(f.scalar("v"))
