"""ComfyUI's own server (main.py) started from a source tree in place (helpers/comfy_env: v0.19.3, or the
newest one), headless on CPU, for the browser tests, with the web frontend that tree's requirements.txt pins.

Run as a script, this file is the server process: it imports diffusers and transformers, stubs torchvision as
`comfy_env` does (the PyPI wheel would pull a CUDA torch), then runs main.py with the arguments it was given.
`start_server` launches that process on a free port and waits until /object_info answers."""

from __future__ import annotations

import importlib.metadata
import json
import os
import runpy
import signal
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


def frontend_pin(comfyui: Path) -> str:
    """The comfyui-frontend-package version the tree's requirements.txt pins."""
    for line in (comfyui / "requirements.txt").read_text().splitlines():
        name, pinned, version = line.partition("==")
        if pinned and name.strip() == "comfyui-frontend-package":
            return version.strip()
    raise AssertionError(f"{comfyui / 'requirements.txt'} pins no comfyui-frontend-package")


def frontend_root(comfyui: Path) -> Path | None:
    """The static folder of the tree's pinned frontend: None where the venv's own package is that version
    (main.py finds it), else the copy scripts/setup.sh installs beside it (.venv/comfyui-frontend-<pin>)."""
    pin = frontend_pin(comfyui)
    if importlib.metadata.version("comfyui-frontend-package") == pin:
        return None
    static = Path(sys.prefix) / f"comfyui-frontend-{pin}" / "comfyui_frontend_package" / "static"
    # loud: an older frontend would test the pack's script against a page the tree's users never get
    assert (static / "index.html").is_file(), (
        f"{comfyui} pins comfyui-frontend-package=={pin}: missing {static} (scripts/setup.sh test installs)"
    )
    return static


def start_server(
    comfyui: Path, base: Path, log_path: Path, timeout: float = 90.0
) -> tuple[subprocess.Popen, str]:
    """(process, base URL) of `main.py --cpu` serving `base` (models, custom_nodes, user, ...) on a free
    port, with the frontend the tree pins (frontend_root)."""
    port = free_port()
    args = [sys.executable, str(HERE), str(comfyui / "main.py"), "--cpu", "--listen", "127.0.0.1",
            "--port", str(port), "--base-directory", str(base), "--disable-api-nodes",
            "--database-url", "sqlite:///:memory:", "--disable-auto-launch"]  # fmt: skip
    root = frontend_root(comfyui)
    if root is not None:
        args += ["--front-end-root", str(root)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
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
    stop(process)
    raise TimeoutError(f"ComfyUI did not answer within {timeout} s; log: {log_path}")


def stop(process: subprocess.Popen, grace: float = 10.0) -> None:
    """End `process` and its process group (it was started in a session of its own): SIGTERM, then SIGKILL
    after `grace` seconds; reaped either way."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:  # the group is gone already
            pass
        try:
            process.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(process.pid, signal.SIGKILL)  # children that outlived their leader
    except ProcessLookupError:
        pass


def processes_naming(text: str) -> list[str]:
    """Command lines of the live processes whose arguments contain `text` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


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
