"""ComfyUI's own server (main.py) started from the v0.19.3 source in place, headless on CPU, for the browser test.

Run as a script, this file is the server process: it imports diffusers and transformers, stubs torchvision as
`comfy_env` does (the PyPI wheel would pull a CUDA torch), then runs main.py with the arguments it was given.
`start_server` launches that process on a free port and waits until /object_info answers."""

from __future__ import annotations

import json
import os
import runpy
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve()
SRC = HERE.parents[2] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def start_server(
    comfyui: Path, base: Path, log_path: Path, timeout: float = 90.0
) -> tuple[subprocess.Popen, str]:
    """(process, base URL) of `main.py --cpu` serving `base` (models, custom_nodes, user, ...) on a free port."""
    port = free_port()
    args = [sys.executable, str(HERE), str(comfyui / "main.py"), "--cpu", "--listen", "127.0.0.1",
            "--port", str(port), "--base-directory", str(base), "--disable-api-nodes",
            "--database-url", "sqlite:///:memory:", "--disable-auto-launch"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    log = open(log_path, "wb")  # noqa: SIM115  (the process writes it until the test stops it)
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ComfyUI exited with {process.returncode}; log: {log_path}")
        try:
            get_json(f"{url}/system_stats", timeout=2)
            return process, url
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"ComfyUI did not answer within {timeout} s; log: {log_path}")


def _serve() -> None:
    """The server process: stubs first, then ComfyUI's main.py as __main__ with the remaining arguments."""
    sys.path.insert(0, str(HERE.parents[1]))  # tests/, for helpers.comfy_env
    import diffusers  # noqa: F401  (before the stub: both probe torchvision once at import; Inspect needs them)
    import transformers  # noqa: F401

    from helpers.comfy_env import _install_stubs

    _install_stubs()
    main = Path(sys.argv[1])
    sys.argv = [str(main), *sys.argv[2:]]
    sys.path.insert(0, str(main.parent))
    runpy.run_path(str(main), run_name="__main__")


if __name__ == "__main__":
    _serve()
