"""`loraweave generate`: prompt (with `<lora:name:w[:te]>` tags) -> image, stable-diffusion.cpp style.

Load a diffusers pipeline (folder, or a single-file checkpoint with its architecture), optionally quantize the
denoiser (SDNQ), apply the prompt's and the command line's adapters with loraweave (merge / runtime / auto,
one report), optionally stream the denoiser under a memory budget, sample, and write a PNG whose `parameters`
text chunk is A1111's infotext plus a `loraweave` chunk with the report, and a JSON sidecar beside it."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
import random
import re
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..arguments import MAX_CFG, MAX_SIDE, MAX_STEPS
from ..errors import GenerateError, LoraweaveError
from ..modes import APPLY_MODES, ApplyMode
from ..request.spec import AdapterSpec
from . import infotext as it

log = logging.getLogger("loraweave")

DTYPES = ("fp32", "fp16", "bf16")
# --quantize value -> sdnq_post_load_quant keyword arguments (backends that run on CPU and CUDA alike).
QUANTIZE = {"sdnq-int8": {"weights_dtype": "int8"}, "sdnq-uint4": {"weights_dtype": "uint4"}}
# --arch -> diffusers pipeline class for a single-file checkpoint.
SINGLE_FILE_PIPELINES = {
    "sd1": "StableDiffusionPipeline",
    "sd2": "StableDiffusionPipeline",
    "sdxl": "StableDiffusionXLPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
    "flux-schnell": "FluxPipeline",
    "chroma": "ChromaPipeline",
    "z-image": "ZImagePipeline",
    "qwen-image": "QwenImagePipeline",
}
# Scheduler class -> A1111 sampler name (others are shown by class name).
SAMPLERS = {
    "EulerDiscreteScheduler": "Euler",
    "EulerAncestralDiscreteScheduler": "Euler a",
    "FlowMatchEulerDiscreteScheduler": "Euler",
    "DDIMScheduler": "DDIM",
    "PNDMScheduler": "PLMS",
    "DPMSolverMultistepScheduler": "DPM++ 2M",
    "LMSDiscreteScheduler": "LMS",
    "HeunDiscreteScheduler": "Heun",
    "LCMScheduler": "LCM",
    "UniPCMultistepScheduler": "UniPC",
}
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30}


@dataclass
class GenerateRequest:
    model: str
    prompt: str
    output: str = "output.png"
    negative: str = ""
    lora_dir: str | None = None
    loras: list[tuple[str, float]] = field(default_factory=list)
    # per-modality strengths (audio-video models) of every adapter that sets none of its own
    modality_strengths: dict[str, float] | None = None
    apply_mode: ApplyMode = "auto"
    quantize: str | None = None
    budget: str | None = None
    steps: int = 20
    cfg: float = 7.0
    seed: int = 42
    width: int = 512
    height: int = 512
    device: str = "cpu"
    dtype: str = "fp32"
    threads: int | None = None  # torch threads while sampling (None: torch's default; serve's replicas' too)
    arch: str | None = None
    config: str | None = None
    strict: bool = False
    progress: bool = False
    overwrite: bool = False  # replace an existing PNG and its sidecar
    allow_empty: bool = False  # sample even when an adapter lands no key
    allow_other_arch: bool = False  # apply a file of another architecture than the model's (said loudly)


@dataclass
class GenerateResult:
    output: str
    sidecar: str
    seed: int
    prompt: str  # what the text encoders saw (tags stripped)
    parameters: str  # the infotext written into the PNG
    report: dict | None  # loraweave apply report (None: no adapter)
    seconds: dict[str, float]
    quantized_layers: int | None = None  # with --quantize: layers SDNQ quantized (0: all under its floor)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_budget(text: str | None) -> int | str | None:
    """ "auto", bytes, or a size with a unit (512M, 4G, 4GB); None stays None."""
    if text is None:
        return None
    if text == "auto":
        return "auto"
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise GenerateError(f"--budget must be 'auto' or a positive size like 512M or 4G, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def check_png(output: str | os.PathLike) -> None:
    """The image is a PNG: for another suffix PIL writes a JPEG or WebP and drops the parameters text
    chunk."""
    if Path(output).suffix.lower() != ".png":
        raise GenerateError(
            f"{output}: the output must be a .png file (its text chunk holds the parameters: prompt, seed, "
            "adapters)"
        )


def check_outputs(req: GenerateRequest) -> None:
    """The PNG and its sidecar: refused before anything loads when one exists (no --force) or is an input."""
    from ..io.output import check_output

    inputs = [req.model, *(path for path, _ in req.loras)]
    for target in (Path(req.output), Path(req.output).with_suffix(".json")):
        check_output(target, inputs, overwrite=req.overwrite)


def validate(req: GenerateRequest) -> None:
    """Every argument checked before anything heavy is loaded; GenerateError names the flag."""
    checks = [
        (1 <= req.steps <= MAX_STEPS, f"--steps must be from 1 to {MAX_STEPS}, got {req.steps}"),
        (
            math.isfinite(req.cfg) and 0 <= req.cfg <= MAX_CFG,
            f"--cfg must be a finite number from 0 to {MAX_CFG:g}, got {req.cfg}",
        ),
        (
            0 < req.width <= MAX_SIDE and req.width % 8 == 0,
            f"-W must be a positive multiple of 8 up to {MAX_SIDE}, got {req.width}",
        ),
        (
            0 < req.height <= MAX_SIDE and req.height % 8 == 0,
            f"-H must be a positive multiple of 8 up to {MAX_SIDE}, got {req.height}",
        ),
        (req.dtype in DTYPES, f"--dtype must be one of {DTYPES}, got {req.dtype!r}"),
        (req.threads is None or req.threads >= 1, f"--threads must be at least 1, got {req.threads}"),
        (
            req.apply_mode in APPLY_MODES,
            f"--lora-apply-mode must be one of {APPLY_MODES}, got {req.apply_mode!r}",
        ),
        (
            req.quantize in (None, *QUANTIZE),
            f"--quantize must be one of {tuple(QUANTIZE)}, got {req.quantize!r}",
        ),
        (
            req.arch is None or req.arch in SINGLE_FILE_PIPELINES,
            f"--arch must be one of {tuple(SINGLE_FILE_PIPELINES)}, got {req.arch!r}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise GenerateError(message)
    if (
        Path(req.output).suffix.lower() != ".png"
    ):  # PIL would write a JPEG or WebP and drop the parameters text
        raise GenerateError(
            f"-o {req.output}: the output must be a .png file (its text chunk holds the parameters: prompt, "
            "seed, adapters)"
        )
    check_outputs(req)
    for path, strength in req.loras:
        if not math.isfinite(strength):
            raise GenerateError(f"--lora {path}: strength must be finite, got {strength}")
        if not Path(path).exists():
            raise GenerateError(f"--lora {path}: no such file")
    if "<lora:" in req.prompt.lower() or "<lyco:" in req.prompt.lower():
        if req.lora_dir is None:
            raise GenerateError(
                "the prompt has <lora:...> tags: pass --lora-dir, the folder their names are in"
            )
    parse_budget(req.budget)
    model = Path(req.model)
    if not model.exists():
        raise GenerateError(f"--model {req.model}: no such file or folder")
    if model.is_dir() and not (model / "model_index.json").is_file():
        raise GenerateError(f"--model {req.model}: not a diffusers pipeline folder (no model_index.json)")
    if model.is_file() and req.arch is None:
        raise GenerateError(f"--model {req.model} is a single file: say which architecture it is with --arch")


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _device(name: str):
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise GenerateError(f"--device {name!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GenerateError(f"--device {name}: CUDA is not available here")
    return device


@contextlib.contextmanager
def loading_bars(show: bool):
    """diffusers' and transformers' loading bars follow `show` (they ignore whether stderr is a terminal)."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    before = (dlog.is_progress_bar_enabled(), tlog.is_progress_bar_enabled())
    for lib in (dlog, tlog):
        lib.enable_progress_bar() if show else lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib, was in zip((dlog, tlog), before, strict=True):
            lib.enable_progress_bar() if was else lib.disable_progress_bar()


def load_pipeline(req: GenerateRequest):
    """The diffusers pipeline of `--model` (offline: nothing is downloaded)."""
    import diffusers

    dtype = _torch_dtype(req.dtype)
    try:
        with loading_bars(req.progress), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch_dtype.*deprecated", category=FutureWarning)
            if Path(req.model).is_dir():
                return diffusers.DiffusionPipeline.from_pretrained(
                    req.model, torch_dtype=dtype, local_files_only=True
                )
            assert req.arch is not None  # a single file: the request check required --arch
            cls = getattr(diffusers, SINGLE_FILE_PIPELINES[req.arch])
            extra = {"config": req.config} if req.config else {}
            return cls.from_single_file(req.model, torch_dtype=dtype, local_files_only=True, **extra)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        hint = (
            "" if req.config or Path(req.model).is_dir() else " (single files need --config FOLDER offline)"
        )
        raise GenerateError(
            f"--model {req.model}: cannot load the pipeline{hint}: {type(exc).__name__}: {exc}"
        ) from None


def adapter_specs(req: GenerateRequest) -> tuple[str, list[AdapterSpec]]:
    """(prompt without tags, adapters): the prompt's tags (resolved in --lora-dir) then each --lora."""
    from ..request.prompt import parse_prompt

    if req.lora_dir is not None:
        clean, specs = parse_prompt(req.prompt, req.lora_dir)
    else:
        clean, specs = req.prompt, []
    specs += [AdapterSpec(source=Path(p).resolve(), strength=s, name=Path(p).stem) for p, s in req.loras]
    if req.modality_strengths:
        specs = [
            s if s.modality_strengths else replace(s, modality_strengths=req.modality_strengths)
            for s in specs
        ]
    return clean, specs


def denoiser_of(pipe):
    """The pipeline's UNet or transformer."""
    for name in ("transformer", "unet"):
        module = getattr(pipe, name, None)
        if module is not None:
            return module
    raise GenerateError(f"{type(pipe).__name__} has no unet or transformer to quantize or stream")


def quantize(pipe, kind: str) -> int:
    """Quantize the denoiser's Linear/Conv layers in place with SDNQ (its own size floor applies: layers under
    16384 weights stay float); returns how many layers were quantized."""
    from sdnq import sdnq_post_load_quant

    sdnq_post_load_quant(denoiser_of(pipe), add_skip_keys=False, **QUANTIZE[kind])
    layers = sum(type(m).__name__.startswith("SDNQ") for m in denoiser_of(pipe).modules())
    log.info("generate quantize=%s layers=%d", kind, layers)
    return layers


def _call_kwargs(pipe, req: GenerateRequest, prompt: str, generator) -> dict:
    wanted = {
        "prompt": prompt,
        "negative_prompt": req.negative or None,
        "num_inference_steps": req.steps,
        "guidance_scale": req.cfg,
        "height": req.height,
        "width": req.width,
        "generator": generator,
    }
    accepted = inspect.signature(pipe.__call__).parameters
    dropped = [k for k, v in wanted.items() if k not in accepted and v is not None]
    if dropped:
        log.info("generate pipeline=%s ignores=%s", type(pipe).__name__, dropped)
    return {k: v for k, v in wanted.items() if k in accepted}


def sample(pipe, req: GenerateRequest, prompt: str, seed: int):
    """One image (PIL) from the pipeline with a seeded CPU generator (same seed, same image on any device)."""
    import torch

    pipe.set_progress_bar_config(disable=not req.progress, desc="steps", unit="step")
    generator = torch.Generator("cpu").manual_seed(seed)
    try:
        return pipe(**_call_kwargs(pipe, req, prompt, generator)).images[0]
    except (ValueError, RuntimeError, TypeError) as exc:
        raise GenerateError(
            f"sampling failed in {type(pipe).__name__}: {type(exc).__name__}: {exc}"
        ) from None


def _adapter_hashes(specs: list[AdapterSpec]) -> list[tuple[str, str | None]]:
    from ..formats.adapter import load_adapter

    out = []
    for spec in specs:
        path = Path(spec.source)
        try:
            metadata = load_adapter(path).metadata
        except LoraweaveError:
            metadata = {}
        out.append((spec.name or path.stem, it.addnet_hash(path, metadata)))
    return out


def parameters(req: GenerateRequest, pipe, seed: int, specs: list[AdapterSpec], report) -> str:
    """The A1111 infotext for this image, with the loraweave report summary as an extra parameter."""
    from .. import __version__

    sampler = type(pipe.scheduler).__name__
    params = {
        "Steps": req.steps,
        "Sampler": SAMPLERS.get(sampler, sampler),
        "CFG scale": req.cfg,
        "Seed": seed,
        "Size": f"{req.width}x{req.height}",
        "Model hash": it.model_hash(req.model),
        "Model": Path(req.model).stem,
        "Lora hashes": it.lora_hashes(_adapter_hashes(specs)),
        "Loraweave": report.summary() if report is not None else None,
        "Version": f"loraweave {__version__}",
    }
    # --lora files as the tags A1111 reads back (its "Lora hashes" alone applies nothing on re-use)
    flagged = [f"<lora:{Path(path).stem}:{strength:g}>" for path, strength in req.loras]
    return it.infotext(" ".join([req.prompt, *flagged]).strip(), req.negative, params)


def write_outputs(image, out: Path, text: str, sidecar: dict) -> Path:
    """PNG with `parameters` (infotext) and `loraweave` (JSON) text chunks, and `<out>.json` beside it."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("parameters", text)  # tEXt when latin-1 encodable, otherwise iTXt (as A1111)
    info.add_text("loraweave", json.dumps(sidecar.get("report"), separators=(",", ":")))
    side = out.with_suffix(".json")
    tmp_png, tmp_side = out.with_name(f".{out.name}.tmp"), side.with_name(f".{side.name}.tmp")
    try:  # both written aside, then renamed: a reader never sees half a file
        image.save(tmp_png, format="PNG", pnginfo=info)
        tmp_side.write_text(json.dumps(sidecar, indent=2))
        os.replace(tmp_png, out)
        os.replace(tmp_side, side)
    finally:
        tmp_png.unlink(missing_ok=True)
        tmp_side.unlink(missing_ok=True)
    return side


def _sample_maybe_streamed(pipe, req: GenerateRequest, prompt: str, seed: int, device, budget):
    """(image, streaming summary or None): with a budget the denoiser streams its blocks, the rest is moved
    whole."""
    if budget is None:
        return sample(pipe, req, prompt, seed), None
    from ..streaming import stream

    denoiser = denoiser_of(pipe)
    for module in pipe.components.values():
        if hasattr(module, "to") and module is not denoiser:
            module.to(device)
    streamer = stream(denoiser, budget=budget, device=device)
    try:
        image = sample(pipe, req, prompt, seed)
    finally:
        streamer.close()
    rep = streamer.report
    assert rep is not None  # set on the denoiser's first forward, which sampling ran
    return image, {
        "summary": rep.summary(),
        "blocks": rep.blocks,
        "forwards": rep.forwards,
        "peak_bytes": rep.peak_bytes,
        "bytes_copied": rep.total.bytes_copied,
    }


def generate(req: GenerateRequest) -> GenerateResult:
    """Run one request end to end. Raises GenerateError (bad input), PromptAdapterError (unknown tag name) or
    StrictApplyError (--strict and some key did not land: nothing is written)."""
    validate(req)
    with _torch_threads(req.threads):
        return _generate(req)


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    """torch's thread count for one request, put back after (CPU kernels round by thread count)."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _generate(req: GenerateRequest) -> GenerateResult:
    from ..api import apply

    device = _device(req.device)
    budget = parse_budget(req.budget)
    clean, specs = adapter_specs(req)
    seed = req.seed if req.seed >= 0 else random.randrange(2**32)
    t = {"start": time.perf_counter()}
    pipe = load_pipeline(req)
    t["load"] = time.perf_counter()
    quantized = quantize(pipe, req.quantize) if req.quantize else 0
    t["quantize"] = time.perf_counter()
    if budget is None:
        pipe.to(device)
    handle = (
        apply(
            pipe,
            specs,
            mode=req.apply_mode,
            strict=req.strict,
            allow_empty=req.allow_empty,
            allow_other_arch=req.allow_other_arch,
            progress=False,
        )
        if specs
        else None
    )
    report = handle.report if handle is not None else None
    t["apply"] = time.perf_counter()
    image, streaming = _sample_maybe_streamed(pipe, req, clean, seed, device, budget)
    t["sample"] = time.perf_counter()
    text = parameters(req, pipe, seed, specs, report)
    seconds = {
        k: round(t[k] - t[p], 4)
        for p, k in zip(
            ("start", "load", "quantize", "apply"), ("load", "quantize", "apply", "sample"), strict=True
        )
    }
    out = Path(req.output)
    sidecar = {
        "parameters": text,
        "request": asdict(req),
        "seed": seed,
        "prompt_encoded": clean,
        "adapters": [
            {"name": s.name, "path": str(s.source), "strength": s.strength, "te_strength": s.te_strength}
            for s in specs
        ],
        "report": report.to_dict() if report is not None else None,
        "streaming": streaming,
        "quantized_layers": quantized,
        "seconds": seconds,
    }
    side = write_outputs(image, out, text, sidecar)
    seconds["write"] = round(time.perf_counter() - t["sample"], 4)
    log.info("generate output=%s seed=%d adapters=%d seconds=%s", out, seed, len(specs), seconds)
    layers = quantized if req.quantize else None
    return GenerateResult(str(out), str(side), seed, clean, text, sidecar["report"], seconds, layers)
