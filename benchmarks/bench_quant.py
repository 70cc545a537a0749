"""Adapters on quantized bases, every backend that runs here (SDNQ, bitsandbytes, torchao, optimum-quanto,
GGUF): apply time, extra memory, retention and step-time overhead per (backend, quant type, mechanism); then
hosted apply fresh vs factor-cache replay on a many-layer SDNQ model.

Part 1: one Linear(3072, 3072) with bias, quantized by each backend's own API (benchmarks/quantbuild.py),
input 4096 tokens x 3072, a rank-16 LoRA (scale 1) and, on SDNQ, a LoKr of the same layer (for runtime and
hosting). Per quant type the variants are separate copies of the same quantized layer: `alone` (no adapter)
and one per mechanism request:
  every backend   runtime      mode="runtime", LoRA (a forward hook beside the layer's own forward)
                  merge        mode="merge", LoRA (no side channel: requantize with the layer's own config)
  SDNQ also       auto         mode="auto", LoRA (the exact svd_up/svd_down side channel: "factor")
                  runtime lokr mode="runtime", LoKr
                  host lokr    mode="auto", quantized="host", host_rank=64, LoKr ("hosted": truncated SVD in
                               the side channel; on int8 the routing rule requantizes instead)
                  requantize   mode="merge", quantized="requantize", LoRA
Columns:
  mechanism     request -> what `handle.report.applied[0].mechanism` says was done
  apply ms      median wall time of `loraweave.apply` (remove untimed; a warm-up apply first; applies over 0.5
                s are timed twice)
  extra MiB     bytes of tensor storage that the applied layer, the handle and its hooks hold beyond the
                quantized layer and the adapter's own tensors, after apply and one forward (runtime factors
                and their caches, side-channel growth, or the original quantized tensors kept for the exact
                undo)
  retention     ρ = <applied Δ, intended Δ>/‖intended Δ‖² from the report (factor: 1; runtime is exact by
                construction, shown as "exact"); capture: energy of Δ a hosted truncation keeps
  step x        forward time with the adapter / forward time of the quantized layer alone. Sandwiched, as in
                bench_runtime.py: per round `alone V1 alone V2 alone ...` (order rotated), each sample divided
                by the mean of the two `alone` forwards beside it; 'step x' is the median over quiet samples
                (those neighbours within 3%; all samples when fewer than 3 are quiet), 'x all' the median over
                all, 'quiet' the count. No warm-up round: every model has run a forward since it last changed.
                Timed for runtime, factor and hosted rows; a requantized layer keeps the storage format and
                size of `alone`, so its forward is timed only with --requant-steps (that would add about a
                third to the run)
  alone ms      median forward of the quantized layer alone
  note          the report's `why` for the choice; for rows that did not run, the reason (the backend's
                `unavailable()` / `kind_unavailable()`, the capability a mechanism needs, or the apply
                refusal)
Forwards run under torch.no_grad(): quanto's qint4 forward raises under inference_mode ("Cannot set
version_counter for inference tensor").
Part 2: hosted apply of a LoKr on every layer of an N-layer stack of Linear(D, D) SDNQ uint4 layers (the only
backend with a side channel): fresh (cache miss, factors computed and written) vs replay (cache hit), and the
bit-identity of the two.

    .venv/bin/python benchmarks/bench_quant.py [--quick] [--rounds N] [--requant-steps] [--layers 60]
        [--dim 1024]

5 rounds by default (~3 min on the 2-core VM), --quick 1 round (~1.5 min, a smoke run: the ratios are then
noise). The objects that exist after the imports and probes are moved out of the collector's reach
(gc.freeze), so the gc.collect() before each timed call is cheap. Nothing here asserts a time.
"""

from __future__ import annotations

import gc
import importlib
import os
import shutil
import sys
import tempfile
import time
import types
import weakref

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import quantbuild
import torch
from benchutil import (
    THREADS,
    Variant,
    cpu_steal_s,
    header,
    interleaved,
    median,
    parse_args,
    sandwiched,
    table,
)

IN = OUT = 3072
TOKENS = 4096
RANK = 16
NOTE_WIDTH = 140
WEAKREFS = (weakref.ref, weakref.ProxyType, weakref.CallableProxyType)


def adapters(g: torch.Generator, name: str, dim: int) -> tuple[dict, dict]:
    lora = {
        f"{name}.lora_down.weight": torch.randn(RANK, dim, generator=g) / dim**0.5,
        f"{name}.lora_up.weight": torch.randn(dim, RANK, generator=g) * 0.01,
        f"{name}.alpha": torch.tensor(float(RANK)),
    }
    side = int(round(dim**0.5))
    side = next(s for s in range(side, 0, -1) if dim % s == 0)
    lokr = {
        f"{name}.lokr_w1": torch.randn(side, side, generator=g) * 0.05,
        f"{name}.lokr_w2": torch.randn(dim // side, dim // side, generator=g) * 0.05 / side,
    }
    return lora, lokr


def requests(backend: str, lora: dict, lokr: dict) -> list[tuple[str, dict, dict]]:
    """(label, adapter, apply kwargs) per mechanism request for `backend`."""
    out = [("runtime", lora, dict(mode="runtime"))]
    if backend == "sdnq":
        out += [
            ("auto", lora, dict(mode="auto")),
            ("runtime lokr", lokr, dict(mode="runtime")),
            ("host lokr", lokr, dict(mode="auto", quantized="host", host_rank=64)),
            ("requantize", lora, dict(mode="merge", quantized="requantize")),
        ]
    else:
        out.append(("merge", lora, dict(mode="merge")))
    return out


# ---------------------------------------------------------------- resident bytes


def storages(roots) -> dict[tuple[int, int], int]:
    """{(data_ptr, nbytes): nbytes} of every tensor storage reachable from `roots` through containers,
    objects, modules, closures and tensor-subclass attributes (not through function globals, classes or
    modules)."""
    out: dict[tuple[int, int], int] = {}
    seen: set[int] = set()
    stack = list(roots)
    skip = (
        type,
        types.ModuleType,
        types.CodeType,
        str,
        bytes,
        int,
        float,
        bool,
        type(None),
        torch.dtype,
        torch.device,
        torch.Size,
    )
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        t = type(o)
        if issubclass(t, skip) or issubclass(t, (types.BuiltinFunctionType, *WEAKREFS)):
            continue
        if issubclass(t, torch.Tensor):
            try:
                s = o.untyped_storage()
                if s.nbytes() and s.device.type != "meta":
                    out[(s.data_ptr(), s.nbytes())] = s.nbytes()
            except (RuntimeError, NotImplementedError, TypeError):
                pass  # wrapper subclasses (torchao, quanto) hold their data in attributes
            stack.extend(getattr(o, "__dict__", {}).values())
            continue
        if issubclass(t, types.FunctionType):
            stack.extend(c.cell_contents for c in (o.__closure__ or ()) if _filled(c))
            stack.extend(o.__defaults__ or ())
            continue
        if issubclass(t, types.MethodType):
            stack += [o.__self__, o.__func__]
            continue
        stack.extend(gc.get_referents(o))
    return out


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
        return True
    except ValueError:
        return False


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


# ---------------------------------------------------------------- part 1


def one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= NOTE_WIDTH else text[: NOTE_WIDTH - 3] + "..."


def refusal(exc: Exception) -> str:
    report = getattr(exc, "report", None)
    if report is not None and report.unmatched:
        return "apply refused: " + report.unmatched[0]["reason"]
    return f"apply failed: {type(exc).__name__}: {exc}"


def time_apply(model, sd, kw, rounds: int):
    """Warm-up apply (first-use probes and imports), then timed apply/remove pairs; returns (median s, handle
    of a final apply that stays on). Applies that take over 0.5 s are timed twice, not `rounds` times."""
    import loraweave

    t0 = time.perf_counter()
    loraweave.apply(model, sd, strict=True, **kw).remove()
    n = rounds if time.perf_counter() - t0 < 0.5 else min(2, rounds)
    live: list = []
    res = interleaved(
        [
            Variant(
                "apply",
                lambda: live.append(loraweave.apply(model, sd, strict=True, **kw)),
                cleanup=lambda: live.pop().remove(),
            )
        ],
        n,
        warmup=0,
        log=False,
    )
    return median(res["apply"]), loraweave.apply(model, sd, strict=True, **kw)


def fwd(m, x):
    def run():
        with torch.no_grad():
            return m(x)

    return run


def run_kind(backend: str, kind: str, base, lora, lokr, x, rounds: int, requant_steps: bool):
    """Rows for one quant type (in request order), and the layer's capabilities (for the side-channel row)."""
    import copy

    from loraweave.quant import BACKENDS

    t0 = time.perf_counter()
    alone = quantbuild.build(backend, kind, copy.deepcopy(base))
    layer0 = set(storages([alone[0]]))
    fwd(alone, x)()
    # bitsandbytes does work on the first forward (moves CB/SCB, repacks 4-bit for the CPU kernel): then every
    # copy gets one forward before apply, so that neither the extra bytes nor a timing include it
    first_forward_work = set(storages([alone[0]])) != layer0
    caps = BACKENDS[backend].capabilities(alone[0])
    print(
        f"{backend} {kind}: {type(alone[0]).__name__}, weight {type(alone[0].weight).__name__}, "
        f"first-forward work: {first_forward_work}",
        file=sys.stderr,
        flush=True,
    )
    variants, slots, handles = [], [], []
    for label, sd, kw in requests(backend, lora, lokr):
        model = quantbuild.build(backend, kind, copy.deepcopy(base))
        if first_forward_work:
            fwd(model, x)()
        layer = model[0]
        before = storages([layer, sd])
        try:
            apply_s, handle = time_apply(model, sd, kw, rounds)
        except Exception as exc:  # noqa: BLE001 - a refusal is a row of the table, with its reason
            slots.append((None, [backend, kind, f"{label} -> (none)", *"-" * 8, one_line(refusal(exc))]))
            continue
        handles.append(handle)
        fwd(model, x)()  # also the warm-up of this variant's timing
        gc.collect()
        after = storages([layer, sd, handle.runtime_paths, handle.quant_writes])
        extra = sum(v for k, v in after.items() if k not in before)
        entry = handle.report.applied[0]
        ret = (
            "exact"
            if entry.mechanism == "runtime"
            else "-"
            if entry.retention is None
            else f"{entry.retention:.4f}"
        )
        cap = "-" if entry.capture is None else f"{entry.capture:.4f}"
        if entry.mechanism != "requantize" or requant_steps:
            variants.append(Variant(label, fwd(model, x)))
        slots.append(
            (
                label,
                [
                    backend,
                    kind,
                    f"{label} -> {entry.mechanism}",
                    f"{apply_s * 1e3:.1f}",
                    mib(extra),
                    ret,
                    cap,
                    one_line(entry.why or entry.cost or ""),
                ],
            )
        )
    # every model has run a forward since its last change: no warm-up round
    res = sandwiched(Variant("alone", fwd(alone, x)), variants, rounds, warmup=0, log=True)
    alone_ms = f"{median(res.times['alone']) * 1e3:.0f}"
    rows = []
    for label, cells in slots:
        if label is None:
            rows.append(cells)
            continue
        if label not in res.ratios:
            rows.append([*cells[:-1], "-", "-", "-", alone_ms, cells[-1]])
            continue
        r = res.ratio(label)
        rows.append(
            [
                *cells[:-1],
                f"{r:.3f}",
                f"{median(res.ratios[label]):.3f}",
                res.quiet_count(label),
                alone_ms,
                cells[-1],
            ]
        )
    for h in handles:
        h.remove()
    print(f"  {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows, caps


def part1(rounds: int, requant_steps: bool) -> None:
    from loraweave.quant import broken

    g = torch.Generator().manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(IN, OUT))
    with torch.no_grad():
        base[0].weight.copy_(torch.randn(OUT, IN, generator=g) / IN**0.5)
        base[0].bias.copy_(torch.randn(OUT, generator=g) * 0.1)
    lora, lokr = adapters(g, "0", IN)
    x = torch.randn(TOKENS, IN, generator=g)
    rows: list[list[str]] = []
    wall0, steal0 = time.perf_counter(), cpu_steal_s()
    # every probe first: they import the packages before sdnq's import sets up logging on stdout
    blockers = {(b, k): quantbuild.blocker(b, k) for b, kinds in quantbuild.KINDS.items() for k in kinds}
    for module in (
        "sdnq",
        "diffusers.models.model_loading_utils",
    ):  # slow imports, not part of any measurement
        try:
            importlib.import_module(module)
        except ImportError:
            pass  # that backend's rows say why

    # ~500k objects from torch, diffusers and the quantization packages: out of the collector's way, so that
    # the gc.collect() before every timed call costs milliseconds instead of ~200 ms
    gc.collect()
    gc.freeze()
    for backend, kinds in quantbuild.KINDS.items():
        caps = None
        for kind in kinds:
            why = blockers[(backend, kind)]
            if why:
                rows.append([backend, kind, "(not run)", *"-" * 8, one_line(why)])
                continue
            try:
                kind_rows, kind_caps = run_kind(backend, kind, base, lora, lokr, x, rounds, requant_steps)
            except Exception as exc:  # noqa: BLE001 - a backend the probe passed but that fails at this size
                rows.append([backend, kind, "(failed)", *"-" * 8, one_line(f"{type(exc).__name__}: {exc}")])
                continue
            rows += kind_rows
            caps = caps or kind_caps
        if caps is not None and not caps.factor_channel:
            rows.append(
                [
                    backend,
                    "all",
                    "factor, hosted",
                    *"-" * 8,
                    one_line(f"no side channel ({caps.reason}): auto -> runtime, merge -> requantize"),
                ]
            )
    module_names = {"bnb": "bitsandbytes"}
    for module, why in broken().items():  # backend modules loraweave itself could not import
        if module_names.get(module, module) not in quantbuild.KINDS:
            rows.append([module, "-", "(not run)", *"-" * 8, one_line(why)])
    wall, steal = time.perf_counter() - wall0, cpu_steal_s() - steal0
    headers = [
        "backend",
        "type",
        "mechanism",
        "apply ms",
        "extra MiB",
        "retention",
        "capture",
        "step x",
        "x all",
        "quiet",
        "alone ms",
    ]
    lines = table(headers, [r[:-1] for r in rows]).split("\n")
    notes = ["note", "----", *(r[-1] for r in rows)]
    print(
        f"\nLinear({IN}, {OUT}) + bias, {TOKENS} tokens, LoRA rank {RANK}; rounds={rounds}; every forward "
        f"divided by the mean of the `alone` forwards just before and after it; 'step x' = median over quiet "
        f"samples (`alone` neighbours within 3%), 'x all' = median over all samples"
    )
    print("\n".join(f"{a}  {b}" for a, b in zip(lines, notes, strict=True)))
    print(
        f"part 1: {wall:.0f} s wall, CPU steal {steal:.2f} s (of {wall * THREADS:.0f} CPU-s; >5% means a "
        f"noisy host, rerun)"
    )


# ---------------------------------------------------------------- part 2


def part2(layers: int, dim: int) -> None:
    import loraweave
    from loraweave.mechanisms.runtime.factor_cache import FactorCache

    why = quantbuild.blocker("sdnq", "uint4")
    if why:
        print(f"\npart 2 not run: sdnq cannot run here: {why}")
        return
    g = torch.Generator().manual_seed(1)
    base = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    with torch.no_grad():
        for m in base:
            m.weight.copy_(torch.randn(dim, dim, generator=g) / dim**0.5)
    model = quantbuild.build("sdnq", "uint4", base)
    sd = {}
    for i in range(layers):
        sd |= adapters(g, str(i), dim)[1]
    root = tempfile.mkdtemp(prefix="loraweave-factor-cache-")
    print(
        f"\nhosted LoKr on {layers} SDNQ uint4 Linear({dim}, {dim}) layers, mode='merge', host_rank=64, "
        f"FactorCache"
    )
    try:
        out = {}
        for label in ("fresh", "replay"):
            t0 = time.perf_counter()
            handle = loraweave.apply(
                model, sd, mode="merge", host_rank=64, cache=FactorCache(root), strict=True
            )
            dt = time.perf_counter() - t0
            hits = sum(bool(m.cache_hit) for m in handle.report.applied)
            mech = handle.report.mechanisms()["hosted"]
            out[label] = [torch.cat([m.svd_up.flatten(), m.svd_down.flatten()]) for m in model]
            print(
                f"{label}: {dt:.2f} s for {layers} hosted layers ({dim}x{dim}), cache hits {hits}/{layers}, "
                f"capture median {mech['capture_median']:.4f} min {mech['capture_min']:.4f}"
            )
            handle.remove()
        same = all(torch.equal(a, b) for a, b in zip(out["fresh"], out["replay"], strict=True))
        size = sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root))
        print(f"replay bit-identical to fresh: {same}; cache on disk {size / 2**20:.2f} MiB")
    finally:
        shutil.rmtree(root)


def main() -> None:
    args = parse_args(
        __doc__,
        quick=1,
        full=5,
        extra=lambda ap: (
            ap.add_argument("--layers", type=int, default=60),
            ap.add_argument("--dim", type=int, default=1024),
            ap.add_argument(
                "--requant-steps", action="store_true", help="also time the forwards of requantized layers"
            ),
        ),
    )
    benchutil.setup_torch()
    header("loraweave on quantized layers: every backend that runs here")
    t0 = time.perf_counter()
    part1(args.rounds, args.requant_steps)
    part2(args.layers, args.dim)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
