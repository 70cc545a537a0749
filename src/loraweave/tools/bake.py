"""`bake`: merge adapters into a checkpoint on disk, tensor by tensor, without building or loading the model.

Keys resolve against a shadow module tree made from the checkpoint's tensor names and shapes; each changed
tensor is read alone, merged exactly as `apply(mode="merge")` does (fp32 accumulation, one rounding), and
written to a temp file (or folder) next to the target, renamed into place only when everything succeeded.
Unchanged tensors are copied byte for byte. Peak memory: the largest changed tensor (plus its fp32 copy) and
the adapters."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..arguments import strength as check_strength
from ..errors import ArgumentError, EmptyOutputError
from ..families.contribution import add_contribution, bias_of, coefficient
from ..io.output import check_folder_name, check_output
from ..io.safetensors_file import read_safetensors_header
from ..io.write import StreamingWriter, atomic_path
from ..report.coverage import miss_kind
from ..report.miss import Unmatched
from ..request.adapters import warn_repeated
from ..resolve.planner import Plan
from ..resolve.stacking import Contribution
from .bake_plan import layout_hint, plan_adapters, tensor_plan
from .bake_record import (
    METADATA_KEY,
    adapter_records,
    index_with_sizes,
    provenance,
    rewrite_entry,
    with_count,
)
from .checkpoint import Checkpoint, open_checkpoint

log = logging.getLogger("loraweave")
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class BakeResult:
    output: Path
    tensors: int = 0
    tensors_changed: int = 0
    bytes_written: int = 0
    keys_total: int = 0
    keys_applied: int = 0
    unmatched: list[Unmatched] = field(default_factory=list)
    adapters: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        out = dict(vars(self))
        out["output"] = str(self.output)
        out["unmatched"] = [u.to_dict() for u in self.unmatched]
        return out


def _reasons(unmatched: list) -> str:
    kinds = Counter(miss_kind(u) for u in unmatched).most_common(3)
    return ", ".join(f"{n} x {k}" for k, n in kinds) or "no keys"


def merged_weight(weight: torch.Tensor, contribs: list[Contribution], out_dtype: torch.dtype) -> torch.Tensor:
    """W + Σ coeff·ΔW, accumulated as `MergedModule.write` does (same ops, same order: bit-identical)."""
    acc = weight.reshape(weight.shape[0], -1).to(torch.promote_types(weight.dtype, torch.float32), copy=True)
    base_rows = weight.reshape(weight.shape[0], -1)
    for pp, piece in contribs:
        add_contribution(acc[piece.dst_start : piece.dst_start + piece.length], pp, piece, base_rows)
    return acc.to(out_dtype).view(weight.shape)


def merged_bias(bias: torch.Tensor, contribs: list[Contribution], out_dtype: torch.dtype) -> torch.Tensor:
    acc = bias.to(torch.promote_types(bias.dtype, torch.float32), copy=True)
    for pp, piece in contribs:
        b = bias_of(pp, piece, bias)
        if b is not None:
            acc[piece.dst_start : piece.dst_start + piece.length].add_(b, alpha=coefficient(pp))
    return acc.to(out_dtype)


def _read(fd: int, dtype: torch.dtype, shape: tuple[int, ...], offset: int, length: int) -> torch.Tensor:
    buf = bytearray(length)
    view = memoryview(buf)
    done = 0
    while done < length:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read at byte {offset + done}")
        done += n
    if length == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def _bake_shard(
    src: Path,
    dst: Path,
    work: dict,
    dtype: torch.dtype | None,
    metadata_extra: dict[str, str],
    bar,
    result: BakeResult,
) -> int:
    header, metadata, data_start = read_safetensors_header(src)

    def out_dtype(d: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and d.is_floating_point else d

    entries = [(k, out_dtype(d), shape) for k, (d, shape, _, _) in header.items()]
    writer = StreamingWriter(dst, entries, {**metadata, **metadata_extra})
    fd = os.open(src, os.O_RDONLY)
    try:
        for name, (d, shape, begin, end) in header.items():
            if name in work or out_dtype(d) != d:
                t = _read(fd, d, shape, data_start + begin, end - begin)
                if name in work:
                    kind, contribs = work[name]
                    before = t.to(out_dtype(d))
                    t = (merged_weight if kind == "weight" else merged_bias)(t, contribs, out_dtype(d))
                    result.tensors_changed += not _same_bits(before, t.to(out_dtype(d)))
                    del before
                writer.write(name, t.to(out_dtype(d)))
                del t
            else:
                writer.copy_raw(name, fd, data_start + begin, end - begin)
            result.tensors += 1
            bar.update(end - begin)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        os.close(fd)
    return writer.bytes_written


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (torch.equal calls -0.0 and 0.0 equal, and a NaN unequal to itself)."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _refuse_unchanged(result: BakeResult, model, allow_empty: bool) -> None:
    """EmptyOutputError (inside `atomic_path`: the temp output is removed) when no tensor's bits changed."""
    if result.tensors_changed == 0 and not allow_empty:
        raise EmptyOutputError(
            f"the adapters change no tensor of {model} (strength 0, or changes below the checkpoint's "
            "precision): the output would be an unchanged copy; nothing written (--allow-empty writes it "
            "anyway)",
            result,
        )


def bake(
    model: str | os.PathLike,
    adapters: list[tuple[str, float]],
    output: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    strict: bool = False,
    overwrite: bool = False,
    progress: bool = False,
    allow_empty: bool = False,
    allow_pickle: bool = False,
) -> BakeResult:
    """Merge `adapters` [(path, strength)] into the checkpoint at `model`, writing `output` atomically.

    Refuses (EmptyOutputError, nothing written) when no tensor would change, unless `allow_empty`."""
    t0 = time.perf_counter()
    dtype = _dtype_arg(dtype)
    adapters = [(a, check_strength(s, f"strength of {a}")) for a, s in adapters]
    warn_repeated(adapters)
    ckpt = open_checkpoint(model)
    out = check_output(
        output, [model, *(a for a, _ in adapters)], overwrite=overwrite, folder=ckpt.kind != "file"
    )
    if ckpt.kind != "file":
        check_folder_name(output, f"{model} is a folder, so the baked model is a folder")
    try:
        plan, spans = plan_adapters(ckpt, adapters, allow_pickle)
        work = tensor_plan(ckpt, plan, spans)
        hint = "" if work else layout_hint(ckpt, plan, model)
    finally:
        ckpt.close()
    result = _planned_result(out, plan)
    _refuse_incomplete(result, work, model, strict, allow_empty, hint)
    result.adapters = adapter_records(plan, adapters)
    entry = provenance(model, result.adapters, dtype)
    total = sum(os.path.getsize(f) for f in ckpt.files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="bake", disable=not progress) as bar:
        if ckpt.kind == "file":
            with atomic_path(out) as tmp:
                _bake_shard(ckpt.root, tmp, work, dtype, {METADATA_KEY: entry}, bar, result)
                _refuse_unchanged(result, model, allow_empty or dtype is not None)
                rewrite_entry(tmp, entry, with_count(entry, result.tensors_changed))
        else:  # a --dtype cast is an effect of its own
            _bake_folder(ckpt, out, work, dtype, entry, bar, result, model, allow_empty or dtype is not None)
    if ckpt.kind == "file":  # a folder counts its own files before they join the output folder's others
        result.bytes_written = out.stat().st_size
    result.seconds = time.perf_counter() - t0
    log.info(
        "bake output=%s tensors=%d changed=%d keys_applied=%d/%d unmatched=%d seconds=%.3f",
        out,
        result.tensors,
        result.tensors_changed,
        result.keys_applied,
        result.keys_total,
        len(result.unmatched),
        result.seconds,
    )
    return result


def _dtype_arg(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ArgumentError(f"--dtype must be one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    return dtype


def _planned_result(out: Path, plan: Plan) -> BakeResult:
    result = BakeResult(out)
    result.keys_total = sum(a.keys_total for a in plan.adapters)
    result.keys_applied = sum(len(pp.part.keys) for pp in plan.planned)
    result.unmatched = list(plan.unmatched)
    return result


def _refuse_incomplete(
    result: BakeResult, work: dict, model, strict: bool, allow_empty: bool, hint: str = ""
) -> None:
    """StrictApplyError when some key would not land under `strict`; EmptyOutputError when nothing changes."""
    if strict and result.unmatched:
        from ..errors import StrictApplyError

        raise StrictApplyError(f"strict: {len(result.unmatched)} keys would not land; nothing written", None)
    if not work and not allow_empty:
        raise EmptyOutputError(
            f"no key of the adapters lands on {model} ({result.keys_applied}/{result.keys_total} "
            f"keys; {_reasons(result.unmatched)}{hint}): the output would be an unchanged copy; nothing "
            "written (--allow-empty writes it anyway)",
            result,
        )


def _bake_folder(
    ckpt: Checkpoint,
    out: Path,
    work: dict,
    dtype: torch.dtype | None,
    entry: str,
    bar,
    result: BakeResult,
    model,
    allow_empty: bool,
) -> None:
    """A component or pipeline folder: shards baked, indexes rewritten with the new sizes, other files copied.
    Each shard's entry gets the count of changed tensors once all are written."""
    shards = set(ckpt.files)
    indexes = {c.index_file: c for c in ckpt.components if c.index_file is not None}
    with atomic_path(out, folder=True) as tmp:
        sizes: dict[Path, dict[str, int]] = {}
        for src in sorted(p for p in ckpt.root.rglob("*") if p.is_file()):
            rel = src.relative_to(ckpt.root)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            if src in shards:
                written = _bake_shard(src, tmp / rel, work, dtype, {METADATA_KEY: entry}, bar, result)
                sizes.setdefault(src.parent, {})[src.name] = written
            elif src not in indexes:
                shutil.copyfile(src, tmp / rel)  # contents only: the mode comes from the umask
        _refuse_unchanged(result, model, allow_empty)
        counted = with_count(entry, result.tensors_changed)
        for src in shards:
            rewrite_entry(tmp / src.relative_to(ckpt.root), entry, counted)
        for index_file in indexes:
            index_with_sizes(
                index_file,
                tmp / index_file.relative_to(ckpt.root),
                sizes.get(index_file.parent, {}),
                {METADATA_KEY: counted},
            )
        result.bytes_written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
