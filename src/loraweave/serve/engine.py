"""The serving engine without Ray: one pipeline, an adapter store confined to a folder, and batches that mix
adapters.

A replica keeps one runtime handle on its pipeline holding every resident adapter at strength 1 (an LRU of at
most `capacity` adapters; loading one more is a `switch`). A batch of requests runs as pipeline calls with one
sample per request, each sample with its own adapters and strengths through `Handle.batch`: nothing is
re-applied per request."""

from __future__ import annotations

import base64
import io
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.decide import check_strengths
from ..errors import ArgumentError, LoraweaveError, ServeRequestError
from ..request.spec import AdapterSpec

if TYPE_CHECKING:
    from ..engine.handle import Handle

log = logging.getLogger("loraweave")
_SUFFIX = ".safetensors"


@dataclass
class ServeRequest:
    prompt: str
    negative: str = ""
    adapters: list[tuple[str, float]] = field(
        default_factory=list
    )  # (name in the store, strength), after tags
    steps: int = 20
    cfg: float = 7.0
    seed: int = 42
    width: int = 512
    height: int = 512
    received: float = 0.0  # time.time() when the ingress accepted it (queue time is measured from here)

    @property
    def adapter_set(self) -> str:
        """The multiplexing id: the request's adapter names, sorted and joined ("" for none)."""
        return "+".join(sorted({name for name, _ in self.adapters}))

    def group(self) -> tuple:
        """Requests of one group run in one pipeline call (same schedule, guidance and size)."""
        return (self.steps, self.cfg, self.width, self.height)


def _number(body: dict, key: str, kind, default):
    value = body.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and value != int(value))
    ):
        raise ServeRequestError(
            f"field {key!r} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
        )
    return kind(value)


def _check_ranges(req: ServeRequest) -> None:
    checks = [
        (1 <= req.steps <= 1000, f"'steps' must be in 1..1000, got {req.steps}"),
        (math.isfinite(req.cfg) and req.cfg >= 0, f"'cfg' must be finite and >= 0, got {req.cfg}"),
        (0 <= req.seed < 2**63, f"'seed' must be in 0..2**63-1, got {req.seed}"),
        (
            all(0 < s <= 4096 and s % 8 == 0 for s in (req.width, req.height)),
            f"'width' and 'height' must be multiples of 8 in 8..4096, got {req.width}x{req.height}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ServeRequestError(message)


def _listed_adapters(body: dict, store: AdapterFolder) -> list[tuple[str, float, None]]:
    """(name, strength, no text-encoder strength) for each entry of the request's `adapters` list."""
    extra = body.get("adapters", [])
    if not isinstance(extra, list):
        raise ServeRequestError("field 'adapters' must be a list of {'name': ..., 'strength': ...}")
    pairs = []
    for item in extra:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ServeRequestError(
                f"each of 'adapters' must be an object with a string 'name', got {item!r}"
            )
        pairs.append(
            (store.name_of(store.resolve(item["name"])), _number(item, "strength", float, 1.0), None)
        )
    return pairs


def _valid_strength(value: float) -> bool:
    """apply's strength rule (engine/decide.py): what apply would refuse is refused here, as a 4xx."""
    try:
        check_strengths(value)
    except ArgumentError:
        return False
    return True


def parse_request(body, store: AdapterFolder) -> ServeRequest:
    """A JSON request body -> ServeRequest: tags in the prompt and the explicit `adapters` list, resolved in
    the store."""
    from ..request.prompt import parse_prompt

    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        raise ServeRequestError("the request must be a JSON object with a string field 'prompt'")
    req = ServeRequest(
        prompt=body["prompt"],
        negative=str(body.get("negative", "") or ""),
        steps=_number(body, "steps", int, 20),
        cfg=_number(body, "cfg", float, 7.0),
        seed=_number(body, "seed", int, 42),
        width=_number(body, "width", int, 512),
        height=_number(body, "height", int, 512),
    )
    _check_ranges(req)
    try:
        req.prompt, specs = parse_prompt(req.prompt, store.root)
    except LoraweaveError as exc:
        raise ServeRequestError(str(exc)) from None
    pairs = [(store.name_of(s.source), s.strength, s.te_strength) for s in specs]
    pairs += _listed_adapters(body, store)
    for name, strength, te in pairs:
        if not _valid_strength(strength) or (te is not None and te != strength):
            raise ServeRequestError(
                f"adapter {name!r}: strength must be finite and the text-encoder strength the "
                f"same (per-request strengths are one number per adapter), got {strength}/{te}"
            )
    if len({n for n, _, _ in pairs}) != len(pairs):
        raise ServeRequestError("an adapter is named twice in one request")
    req.adapters = [(n, s) for n, s, _ in pairs]
    return req


class AdapterFolder:
    """Names of LoRA files in `root`, resolved as `<lora:...>` tags are (confined to the folder)."""

    def __init__(self, root: str | Path) -> None:
        try:
            self.root = Path(root).resolve(strict=True)
        except OSError:
            raise ServeRequestError(f"adapter folder {root}: no such folder") from None

    def resolve(self, name: str) -> Path:
        from ..request.prompt import resolve_adapter_name

        try:
            return resolve_adapter_name(name, self.root)
        except LoraweaveError as exc:
            raise ServeRequestError(str(exc)) from None

    def name_of(self, path) -> str:
        """The canonical name of a file in the folder: its path relative to the folder, without the suffix."""
        rel = Path(path).resolve().relative_to(self.root).as_posix()
        return rel[: -len(_SUFFIX)] if rel.lower().endswith(_SUFFIX) else rel


class AdapterStore(AdapterFolder):
    """Adapters resident on one pipeline: an LRU of at most `capacity` files of the folder on one runtime
    handle. Each adapter is checked once (strict: every key lands) before it is loaded."""

    def __init__(self, pipe, root: str | Path, capacity: int = 8) -> None:
        super().__init__(root)
        if capacity < 1:
            raise ServeRequestError(f"max adapters per replica must be >= 1, got {capacity}")
        self.pipe, self.capacity = pipe, capacity
        self.resident: OrderedDict[str, Path] = OrderedDict()
        self.reports: dict[str, dict] = {}
        self.handle: Handle | None = None
        self.loads = 0

    def _check(self, name: str, path: Path) -> None:
        from ..api import plan

        try:
            report = plan(self.pipe, [AdapterSpec(path, 1.0, name=name)])
        except LoraweaveError as exc:
            raise ServeRequestError(f"adapter {name!r}: {exc}") from None
        if report.keys_total == 0 or report.keys_applied < report.keys_total:
            raise ServeRequestError(
                f"adapter {name!r} does not fit this model: {report.keys_applied}/"
                f"{report.keys_total} keys land ({report.summary()})"
            )
        self.reports[name] = report.to_dict()

    def ensure(self, names: list[str], pinned: AbstractSet[str] = frozenset()) -> list[bool]:
        """Make `names` resident (least recently used ones evicted, never `pinned` or `names`); per name: was
        it a hit."""
        if len(set(names) | set(pinned)) > self.capacity:
            raise ServeRequestError(
                f"{len(set(names) | set(pinned))} adapters needed at once on a replica that "
                f"holds {self.capacity}; raise --max-adapters-per-replica"
            )
        hits = [n in self.resident for n in names]
        missing = [n for n in names if n not in self.resident]
        for name in missing:
            if name not in self.reports:
                self._check(name, self.resolve(name))
        for name in names:
            if name in self.resident:
                self.resident.move_to_end(name)
        keep = set(names) | set(pinned)
        while missing and len(self.resident) + len(missing) > self.capacity:
            old = next(n for n in self.resident if n not in keep)
            del self.resident[old]
        if missing:
            for name in missing:
                self.resident[name] = self.resolve(name)
            self._switch()
        return hits

    def _switch(self) -> None:
        from ..api import apply

        specs = [AdapterSpec(path, 1.0, name=name) for name, path in self.resident.items()]
        if self.handle is None:
            self.handle = apply(self.pipe, specs, mode="runtime", strict=True, progress=False)
        else:
            self.handle.switch(specs)
        self.loads += 1
        log.info("serve adapters_resident=%d names=%s", len(self.resident), list(self.resident))


def replica_threads(threads: int | None) -> int:
    """The torch threads a replica renders with: `threads`, else this process's count (the one `generate`
    uses here). CPU kernels split their sums by thread count, so only equal counts give equal images."""
    import torch

    return threads if threads is not None else torch.get_num_threads()


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class Engine:
    """One pipeline and its adapter store; `run` renders a batch of requests (in groups of equal settings)."""

    def __init__(
        self, model: str, lora_dir: str, max_adapters: int = 8, device: str = "cpu", dtype: str = "fp32"
    ):
        from ..tools.generate import GenerateRequest, load_pipeline, validate

        gen = GenerateRequest(model=model, prompt="", lora_dir=lora_dir, device=device, dtype=dtype)
        validate(gen)
        self.pipe = load_pipeline(gen)
        self.pipe.to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.store = AdapterStore(self.pipe, lora_dir, max_adapters)
        # Each sample's rows computed with its own set's ranks in its tag order: bit-equal to generate's
        # runtime arithmetic at the batch's size, whatever the companions (False: Handle.batch's gated
        # short-run form).
        self.exact = True

    def parse(self, body) -> ServeRequest:
        return parse_request(body, self.store)

    def run(self, requests: list[ServeRequest]) -> list[dict]:
        """One result per request: {"png_b64", "report", "batch_size"}; a ServeRequestError raised by one
        group's adapters is returned as that group's {"error"} (the others still run)."""
        out: dict[int, dict] = {}  # request index -> its result; every index lies in one group
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(req.group(), []).append(i)
        for idx in (chunk for group in groups.values() for chunk in self._chunks(requests, group)):
            try:
                images = self._render([requests[i] for i in idx])
            except ServeRequestError as exc:
                images = [exc] * len(idx)
            for i, image in zip(idx, images, strict=True):
                out[i] = self._result(requests[i], image, [requests[j] for j in idx])
        return [out[i] for i in range(len(requests))]

    def _chunks(self, requests: list[ServeRequest], idx: list[int]) -> list[list[int]]:
        """Consecutive runs of `idx` whose adapters fit the store at once."""
        chunks: list[list[int]] = []
        names: set[str] = set()
        for i in idx:
            mine = {n for n, _ in requests[i].adapters}
            if chunks and len(names | mine) <= self.store.capacity:
                chunks[-1].append(i)
                names |= mine
            else:
                chunks.append([i])
                names = set(mine)
        return chunks

    def _result(self, req: ServeRequest, image, chunk: list[ServeRequest]) -> dict:
        """`batch_size`: samples in the pipeline call this image came from; `batch_sets`: distinct adapter
        sets."""
        sizes = {"batch_size": len(chunk), "batch_sets": len({r.adapter_set for r in chunk})}
        if isinstance(image, Exception):
            return {"error": str(image), **sizes}
        return {
            "png_b64": base64.b64encode(png_bytes(image)).decode("ascii"),
            **sizes,
            "report": {name: self.store.reports[name] for name, _ in req.adapters},
        }

    def _render(self, reqs: list[ServeRequest], output_type: str = "pil"):
        import contextlib

        import torch

        names = list(dict.fromkeys(n for r in reqs for n, _ in r.adapters))
        self.store.ensure(names)
        first = reqs[0]
        kwargs = {
            "prompt": [r.prompt for r in reqs],
            "negative_prompt": [r.negative for r in reqs],
            "num_inference_steps": first.steps,
            "guidance_scale": first.cfg,
            "width": first.width,
            "height": first.height,
            "generator": [torch.Generator("cpu").manual_seed(r.seed) for r in reqs],
            "output_type": output_type,
        }
        handle = self.store.handle
        context: contextlib.AbstractContextManager[None, bool | None] = contextlib.nullcontext()
        if handle is not None:
            assign = [[n for n, _ in r.adapters] for r in reqs]
            context = handle.batch(assign, [[s for _, s in r.adapters] for r in reqs], exact=self.exact)
        started = time.perf_counter()
        with context:
            images = self.pipe(**kwargs).images
        log.info(
            "serve batch=%d adapters=%d seconds=%.3f", len(reqs), len(names), time.perf_counter() - started
        )
        return images
