"""The Ray Serve application: an HTTP ingress that checks requests, and renderer replicas that multiplex
adapters.

The ingress resolves adapter names in the folder (unknown names and paths outside it are refused there, 4xx)
and sends each request to the renderers with its adapter set as the `multiplexed_model_id`, so Ray routes it
to a replica that already holds those adapters. A renderer loads a set through `@serve.multiplexed` (LRU) and
renders the requests `@serve.batch` gathers in one pipeline call, each sample with its own adapters
(`Handle.batch`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import threading
import time
from dataclasses import dataclass

from ray import serve
from ray.exceptions import RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..errors import ServeRequestError
from .engine import AdapterFolder, Engine, ServeRequest, parse_request, replica_threads

log = logging.getLogger("loraweave")
RENDER_ATTEMPTS = 2  # a replica that dies mid-render: once more on another, then HTTP 503


@dataclass
class ServeOptions:
    model: str
    lora_dir: str
    replicas: int = 1
    max_adapters_per_replica: int = 8
    max_batch: int = 8
    batch_wait_s: float = 0.05
    threads: int | None = None  # torch threads per replica (None: this process's, as `generate` uses)
    cpus_per_replica: float = 1.0
    engine: str = (
        "loraweave.serve.engine:Engine"  # "module:Class" replicas build (an Engine subclass of yours)
    )


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Renderer:
    def __init__(self, options: ServeOptions) -> None:
        import torch

        torch.set_num_threads(replica_threads(options.threads))  # resolved by application() already
        self.engine = engine_class(options.engine)(
            options.model, options.lora_dir, options.max_adapters_per_replica
        )
        self.lock = threading.Lock()  # one thread touches the pipeline at a time (loads and renders)
        self.loaded: dict[str, int] = {}  # adapter set -> times loaded on this replica
        self.replica = _replica_id()
        # ray's hints for @serve.batch return the plain coroutine function, not its wrapper with these setters
        self.render_batch.set_max_batch_size(options.max_batch)  # type: ignore[attr-defined]
        self.render_batch.set_batch_wait_timeout_s(options.batch_wait_s)  # type: ignore[attr-defined]

        async def load(adapter_set: str) -> str:  # a closure: Ray keeps its LRU on the function object
            return await self._load(adapter_set)

        # Wired at init so that the LRU size is the configured one (Ray detects instance attributes too).
        self.get_adapters = serve.multiplexed(max_num_models_per_replica=options.max_adapters_per_replica)(
            load
        )

    def _ensure(self, names: list[str]) -> bool:
        with self.lock:
            return all(self.engine.store.ensure(names))

    async def _load(self, adapter_set: str) -> str:
        names = adapter_set.split("+") if adapter_set else []
        await asyncio.to_thread(self._ensure, names)
        self.loaded[adapter_set] = self.loaded.get(adapter_set, 0) + 1
        return adapter_set

    async def render(self, req: ServeRequest) -> dict:
        adapter_set = serve.get_multiplexed_model_id()  # "" (not multiplexed) for a request without adapters
        load = "none"
        if adapter_set:
            before = self.loaded.get(adapter_set, 0)
            try:
                await self.get_adapters(adapter_set)
            except ServeRequestError as exc:  # does not fit the model, or too many adapters at once
                return {"error": str(exc), "status": 422}
            load = "hit" if self.loaded.get(adapter_set, 0) == before else "miss"
        with _any_adapter_batch():
            result = await self.render_batch(req)
        result["metrics"] |= {"adapter_load": load, "replica": self.replica}
        return result

    def _run(self, reqs: list[ServeRequest]) -> list[dict]:
        with self.lock:
            return self.engine.run(reqs)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.05)
    async def render_batch(self, reqs: list[ServeRequest]) -> list[dict]:
        started = time.time()
        results = await asyncio.to_thread(self._run, reqs)
        seconds = time.time() - started
        for req, res in zip(reqs, results, strict=True):
            res["metrics"] = {
                "queue_s": round(started - req.received, 4),
                "batch_size": res.pop("batch_size"),
                "batch_sets": res.pop("batch_sets"),
                "render_s": round(seconds, 4),
                "batch_requests": len(reqs),
            }
        return results

    def health(self) -> dict:
        store = self.engine.store
        return {
            "replica": self.replica,
            "resident": list(store.resident),
            "capacity": store.capacity,
            "adapter_loads": store.loads,
        }


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Ingress:
    def __init__(self, renderer, lora_dir: str) -> None:
        self.renderer = renderer
        self.folder = AdapterFolder(lora_dir)

    async def __call__(self, request: Request) -> JSONResponse:
        if request.url.path.rstrip("/").endswith("/health"):
            replica = await self.renderer.health.remote()
            return JSONResponse({"status": "ok", "replica": replica})
        received = time.time()
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "the request body must be JSON"}, status_code=400)
        try:
            req = parse_request(body, self.folder)
        except ServeRequestError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        req.received = received
        result = await self._render(req)
        if "error" in result:
            return JSONResponse({"error": result["error"]}, status_code=result.get("status", 422))
        return JSONResponse(result)

    async def _render(self, req: ServeRequest) -> dict:
        """The replica's answer; a replica that died mid-render (a crash, an OOM kill) yields no image, so the
        request is rendered again from scratch on another replica (renders are deterministic: the same image),
        then a 503."""
        renderer = (
            self.renderer.options(multiplexed_model_id=req.adapter_set) if req.adapter_set else self.renderer
        )
        for attempt in range(1, RENDER_ATTEMPTS + 1):
            try:
                return await renderer.render.remote(req)
            except RayActorError as exc:
                log.warning(
                    "serve replica_died attempt=%d/%d error=%s", attempt, RENDER_ATTEMPTS, type(exc).__name__
                )
        return {
            "error": f"the renderer replica died while rendering this request ({RENDER_ATTEMPTS} attempts); "
            "no image was produced, retry later",
            "status": 503,
        }


@contextlib.contextmanager
def _any_adapter_batch():
    """Ray Serve splits `@serve.batch` batches by multiplexed model id; loraweave's per-sample batches mix
    adapter sets exactly, so the batch call is made without the id (routing and the adapter LRU still used
    it)."""
    from ray.serve import context as serve_context

    current = serve_context._get_serve_request_context()
    token = serve_context._serve_request_context.set(dataclasses.replace(current, multiplexed_model_id=""))
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)


def engine_class(path: str) -> type[Engine]:
    """The Engine (sub)class named "module:Class"."""
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name, None) if name else None
    except ImportError:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise ServeRequestError(
            f"engine {path!r}: expected 'module:Class' naming a loraweave.serve Engine subclass"
        )
    return cls


def _replica_id() -> str:
    context = serve.get_replica_context()
    replica = getattr(context, "replica_id", None)
    return getattr(replica, "unique_id", None) or str(getattr(context, "replica_tag", "?"))


def application(options: ServeOptions):
    """The bound application (ingress + renderers) for `serve.run`."""
    # Serve's default of 5 ongoing requests per replica would cap every batch below a larger max_batch.
    # ray's hints for @serve.deployment on a class return the class, not the Deployment it builds (twice here)
    # Resolved here, in the process that starts serving: Ray sets a replica's own default to 1 thread.
    options = dataclasses.replace(options, threads=replica_threads(options.threads))
    renderer = Renderer.options(  # type: ignore[attr-defined]
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.cpus_per_replica},
        max_ongoing_requests=max(5, options.max_batch),
    )
    return Ingress.bind(renderer.bind(options), options.lora_dir)  # type: ignore[attr-defined]
