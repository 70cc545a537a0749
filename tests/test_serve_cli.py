"""`loraweave serve` from the command line: bad arguments exit 2 before Ray starts; a started server answers,
and Ctrl-C shuts it down (exit 130, as the CLI's exit-code table says). Bounded by timeouts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from helpers.serve_fixtures import SETTINGS, build

from loraweave.cli import main

pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'loraweave[serve]')")
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize(
    "args",
    [
        ["--lora-dir", "/nonexistent-folder"],
        ["--replicas", "0"],
        ["--port", "70000"],
    ],
)
def test_bad_arguments_exit_2(tmp_path, args):
    base = {"--model": str(tmp_path), "--lora-dir": str(tmp_path)}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = ["serve", *[x for pair in base.items() for x in pair]]
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(argv))
    assert exc.value.code == 2  # also: tmp_path is not a pipeline folder (no model_index.json)


def test_serves_then_ctrl_c_exits_130(tmp_path):
    pipe_dir, loras = build(tmp_path, adapters=1)
    env = {**os.environ, "PYTHONPATH": str(SRC), "SDNQ_USE_TORCH_COMPILE": "0"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loraweave",
            "serve",
            "--model",
            str(pipe_dir),
            "--lora-dir",
            str(loras),
            "--port",
            "8766",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
        # a SIGINT the runner ignores (a job a shell started in the background) would be ignored by the server
        # too
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        line = proc.stdout.readline()  # blocks until the URL is printed (or the process ends)
        assert line.startswith("serving on http://127.0.0.1:8766"), line
        body = json.dumps({**SETTINGS, "prompt": "a cat <lora:a0:1>"}).encode()
        request = urllib.request.Request(
            "http://127.0.0.1:8766/", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            assert answer.status == 200 and json.loads(answer.read())["metrics"]["adapter_load"] == "miss"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
