"""Serving many users' adapters with Ray Serve (`pip install loraweave[serve]`): `loraweave.serve.app` holds
the deployments, `loraweave.serve.engine` the Ray-free engine they run (pipeline, adapter store, mixed
batches).

Nothing else in loraweave imports Ray; importing this package does not either (the app module does)."""

from ..errors import ServeRequestError
from .engine import AdapterFolder, AdapterStore, Engine, ServeRequest, parse_request

__all__ = [
    "AdapterFolder",
    "AdapterStore",
    "Engine",
    "ServeRequest",
    "ServeRequestError",
    "parse_request",
    "start",
]


def start(options, address: str | None = None, port: int = 8000, route_prefix: str = "/"):
    """Start (or join, with `address`) Ray, deploy the app and return (handle, url). Local Ray gets this
    package's source folder on PYTHONPATH so replicas import the same loraweave."""
    import os
    from pathlib import Path

    import ray
    from ray import serve

    from .app import application

    if not ray.is_initialized():
        if address is None:
            src = str(Path(__file__).resolve().parents[2])
            path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
            ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
        else:
            ray.init(address=address)
    serve.start(http_options={"host": "127.0.0.1" if address is None else "0.0.0.0", "port": port})
    handle = serve.run(application(options), name="loraweave", route_prefix=route_prefix)
    return handle, f"http://127.0.0.1:{port}{route_prefix.rstrip('/')}"
