"""Shared benchmark plumbing: malloc hygiene (re-exec), thread count, command line, interleaved timing,
medians, tables, RSS (and its measurement in child processes), the one-Linear model of the runtime benchmarks.

Importing this module re-executes the running script with the glibc malloc settings below when they are not
already in the environment, so import it before torch (the settings are read once, at process start; this
module imports torch only after that check).

  MALLOC_MMAP_THRESHOLD_=4 GiB   large tensors come from the heap, not from a fresh mmap per allocation
  MALLOC_TRIM_THRESHOLD_=64 GiB  freed memory is kept, so a re-allocation does not page-fault again
  MALLOC_TOP_PAD_=1 GiB          the heap grows in big steps

Without them every 36-50 MB temporary is a fresh mmap whose page faults (zeroing) get timed, which adds noise
and penalises whichever variant allocates more. Set LORAWEAVE_BENCH_NO_REEXEC=1 to keep the current
environment (used by the memory-measuring child processes, which want glibc's default behaviour).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "4294967296",
    "MALLOC_TRIM_THRESHOLD_": "68719476736",
    "MALLOC_TOP_PAD_": "1073741824",
}
NO_REEXEC = "LORAWEAVE_BENCH_NO_REEXEC"
THREADS = 2


def ensure_malloc_env() -> None:
    """Re-exec the current script with MALLOC_ENV unless it is already set (or re-exec is disabled)."""
    if os.environ.get(NO_REEXEC) == "1":
        return
    if all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()):
        return
    env = {**os.environ, **MALLOC_ENV}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


ensure_malloc_env()

import torch  # noqa: E402  (after the re-exec: glibc reads the malloc settings at process start)

DEFAULT_THREADS = torch.get_num_threads()  # torch's default (a thread a core), before any script sets one
LOAD_SECONDS = 4 * 3600  # a background load process ends by itself after this, whatever happens to its parent
_BUSY = """
import os, sys, time
parent, end = os.getppid(), time.monotonic() + float(sys.argv[1])
while time.monotonic() < end and os.getppid() == parent:
    for _ in range(200000):
        pass
"""


def malloc_env_line() -> str:
    state = "set" if all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()) else "NOT set"
    return "malloc env " + state + ": " + " ".join(f"{k}={os.environ.get(k, '-')}" for k in MALLOC_ENV)


def setup_torch():
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    return torch


def positive_int(text: str) -> int:
    """argparse `type` for a count (threads, rounds, repeats): an integer >= 1, else argparse's usage
    error."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def add_clock_args(ap: argparse.ArgumentParser) -> None:
    """--threads / --clock for benchmarks whose target is a few percent: one thread on the CPU-time clock by
    default (a descheduled process accrues no CPU time; wall time with 2 threads on the shared host swings by
    5-30%)."""
    ap.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch threads (default 1: CPU time then ignores descheduling)",
    )
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: time.process_time (default); wall: time.perf_counter",
    )


def use_clock_args(args: argparse.Namespace) -> Callable[[], float]:
    """Set torch's thread count from `add_clock_args`' options and return the clock they name."""
    torch.set_num_threads(args.threads)
    return time.process_time if args.clock == "cpu" else time.perf_counter


def thread_counts(text: str) -> list[int]:
    """argparse `type` of --threads lists: "1,default" -> [1, DEFAULT_THREADS] (duplicates dropped)."""
    out: list[int] = []
    for part in text.split(","):
        n = DEFAULT_THREADS if part.strip() == "default" else positive_int(part.strip())
        if n not in out:
            out.append(n)
    return out


def add_load_arg(ap: argparse.ArgumentParser) -> None:
    """--load N: N busy processes run beside the benchmark for its duration (a reproducible busy host)."""
    ap.add_argument(
        "--load",
        type=int,
        choices=range(0, 4 * (os.cpu_count() or 1) + 1),
        default=0,
        metavar="N",
        help="N busy background processes for the whole run, started and stopped by the benchmark",
    )


class BackgroundLoad:
    """`with BackgroundLoad(n):` n processes spinning on a core each; stopped on exit, and each one ends by
    itself when its parent is gone or after LOAD_SECONDS (a killed benchmark leaves no spinner behind)."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def __enter__(self) -> BackgroundLoad:
        cmd = [sys.executable, "-c", _BUSY, str(LOAD_SECONDS)]
        self.procs = [subprocess.Popen(cmd, stdin=subprocess.DEVNULL) for _ in range(self.n)]
        if self.n:
            time.sleep(0.5)  # the spinners are running before the first sample
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []

    def line(self) -> str:
        return f"background load: {self.n} busy processes; loadavg {os.getloadavg()[0]:.2f}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo): GEMM speeds, and so every ratio to a base GEMM, depend on it."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def header(title: str) -> None:
    import platform

    print(f"== {title}")
    print(
        f"python {platform.python_version()}  torch {torch.__version__}  threads={torch.get_num_threads()}  "
        f"cpus={os.cpu_count()}  cpu={cpu_model()!r}  isa={torch.backends.cpu.get_cpu_capability()}"
    )
    print(malloc_env_line())


def parse_args(
    doc: str,
    quick: int,
    full: int,
    mem: bool = False,
    extra: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.Namespace:
    """The common command line: --quick (`quick` rounds instead of `full`), --rounds N and, with `mem`,
    --no-mem and the hidden --mem-child NAME (see `mem_children`); `extra(parser)` adds a script's own
    options. `args.rounds` comes back resolved (--rounds, else quick or full)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{quick} rounds instead of {full}")
    ap.add_argument("--rounds", type=int, default=None)
    if mem:
        ap.add_argument("--no-mem", action="store_true", help="skip the peak-RSS child processes")
        ap.add_argument("--mem-child", default=None, help=argparse.SUPPRESS)
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    args.rounds = args.rounds or (quick if args.quick else full)
    return args


# ---------------------------------------------------------------- the one-Linear model (runtime benchmarks)


class Wrap(torch.nn.Module):
    """A one-layer model, so every library addresses the Linear by the name `proj` (kohya key stem
    lora_unet_proj)."""

    def __init__(self, lin: torch.nn.Linear) -> None:
        super().__init__()
        self.proj = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def linear_model(in_features: int, out_features: int, g: torch.Generator) -> Wrap:
    """Wrap(Linear(in, out)) with weight ~ N(0, 1/in) and bias ~ N(0, 0.01), drawn from `g` in that order."""
    base = Wrap(torch.nn.Linear(in_features, out_features))
    with torch.no_grad():
        base.proj.weight.copy_(torch.randn(out_features, in_features, generator=g) / in_features**0.5)
        base.proj.bias.copy_(torch.randn(out_features, generator=g) * 0.1)
    return base


def linear_lora(in_features: int, out_features: int, tokens: int, rank: int, alpha: float):
    """(Wrap(Linear), kohya state dict of a rank-`rank` LoRA on it, x of `tokens` tokens), seeded with 0."""
    g = torch.Generator().manual_seed(0)
    base = linear_model(in_features, out_features, g)
    sd = {
        "lora_unet_proj.lora_down.weight": torch.randn(rank, in_features, generator=g) / in_features**0.5,
        "lora_unet_proj.lora_up.weight": torch.randn(out_features, rank, generator=g) / rank**0.5,
        "lora_unet_proj.alpha": torch.tensor(float(alpha)),
    }
    return base, sd, torch.randn(1, tokens, in_features, generator=g)


def inference_forward(m: torch.nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A Variant `run`: one forward of `m` on `x` under inference_mode."""

    def run():
        with torch.inference_mode():
            return m(x)

    return run


# ---------------------------------------------------------------- memory


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_mib() -> float:
    kb = _status_kb("VmRSS")
    return (kb or 0) / 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM, also what getrusage reports) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    kb = _status_kb("VmHWM")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    return kb / 1024


class PeakRss:
    """Peak RSS growth over a block: `with PeakRss() as m: ...; m.delta_mib`.

    Uses /proc/self/clear_refs to reset the peak first; without it (other kernels) the delta is only the
    growth above the process's previous peak, so it is exact only when the block sets a new peak."""

    def __enter__(self) -> PeakRss:
        gc.collect()
        self.reset = reset_peak_rss()
        self.start = rss_mib()
        self.start_peak = peak_rss_mib()
        return self

    def __exit__(self, *exc) -> None:
        self.end_peak = peak_rss_mib()
        base = self.start if self.reset else self.start_peak
        self.delta_mib = max(0.0, self.end_peak - base)


def mem_children(script: str, names: Sequence[str]) -> dict[str, dict]:
    """Run `script --mem-child NAME` once per name, each in a fresh process with glibc's default malloc (the
    settings removed, no re-exec), and return {name: the JSON record the child printed last}."""
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    env[NO_REEXEC] = "1"
    out = {}
    for name in names:
        res = subprocess.run(
            [sys.executable, os.path.abspath(script), "--mem-child", name],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def forward_peak_child(name: str, build: Callable[[tuple[str, ...]], tuple]) -> None:
    """A --mem-child body: peak RSS growth of one steady-state forward (after a warm-up forward) of variant
    `name` from `build((name,))` -> (modules, input, kept objects), printed as JSON."""
    torch.set_num_threads(THREADS)
    mods, x, _ = build((name,))
    m = mods[name]
    with torch.inference_mode():
        y = m(x)
        del y
        with PeakRss() as pk:
            y = m(x)
        del y
    print(json.dumps({"name": name, "peak_mib": pk.delta_mib, "reset": pk.reset}))


# ---------------------------------------------------------------- timing


def cpu_steal_s() -> float:
    """CPU time the hypervisor gave to others (all CPUs, seconds): a direct measure of VM noise."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


LAST_RUN: dict[str, float] = {}


@dataclass
class Variant:
    """One thing to time. `prepare` and `cleanup` run around every timed `run`, untimed."""

    name: str
    run: Callable[[], object]
    prepare: Callable[[], object] | None = None
    cleanup: Callable[[], object] | None = None


def _timed(v: Variant, collect: bool = True, clock: Callable[[], float] = time.perf_counter) -> float:
    """One sample of `v` in seconds of `clock` (wall by default; time.process_time: CPU time of this
    process)."""
    if v.prepare is not None:
        v.prepare()
    if collect:
        gc.collect()
    gc.disable()
    try:
        t0 = clock()
        out = v.run()
        dt = clock() - t0
    finally:
        gc.enable()
    del out
    if v.cleanup is not None:
        v.cleanup()
    return dt


def interleaved(
    variants: Sequence[Variant], rounds: int, warmup: int = 1, log: bool = True, collect: bool = True
) -> dict[str, list[float]]:
    """Time every variant once per round, round-robin, rotating the order each round (no position bias).

    collect=False skips the full gc.collect() before each sample (the collector is still paused during it):
    with ~400k tracked objects one full collection costs ~200 ms, far more than a 20 ms sample.
    Returns {name: [seconds per round]} with index i = round i, so per-round ratios pair up."""
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    n = len(variants)
    steal0, wall0 = cpu_steal_s(), time.perf_counter()
    for r in range(-warmup, rounds):
        for v in [variants[(i + r) % n] for i in range(n)]:
            dt = _timed(v, collect)
            if r >= 0:
                times[v.name].append(dt)
        if log and r >= 0:
            done = " ".join(f"{v.name}={times[v.name][-1] * 1e3:.1f}ms" for v in variants)
            print(f"  round {r + 1}/{rounds}: {done}", file=sys.stderr, flush=True)
    LAST_RUN.update(wall_s=time.perf_counter() - wall0, steal_s=cpu_steal_s() - steal0)
    return times


@dataclass
class Sandwich:
    """Result of `sandwiched`: per-round times, and per-sample ratios to the reference runs either side."""

    times: dict[str, list[float]]
    ratios: dict[str, list[float]]  # every sample: t / mean(ref before, ref after)
    quiet: dict[str, list[float]]  # only samples whose two reference neighbours agree within `tol`
    tol: float

    def ratio(self, name: str) -> float:
        """Median ratio over quiet samples (all samples when fewer than 3 were quiet)."""
        use = self.quiet[name] if len(self.quiet[name]) >= 3 else self.ratios[name]
        return statistics.median(use)

    def quiet_count(self, name: str) -> str:
        return f"{len(self.quiet[name])}/{len(self.ratios[name])}"

    def interval(self, name: str, level: float = 0.9, resamples: int = 2000) -> tuple[float, float]:
        """A percentile-bootstrap interval of `ratio(name)` (the same samples): how far the median could
        move."""
        import random

        use = self.quiet[name] if len(self.quiet[name]) >= 3 else self.ratios[name]
        rng = random.Random(0)
        meds = sorted(statistics.median(rng.choices(use, k=len(use))) for _ in range(resamples))
        lo = int((1 - level) / 2 * resamples)
        return meds[lo], meds[resamples - 1 - lo]


def sandwiched(
    ref: Variant,
    variants: Sequence[Variant],
    rounds: int,
    warmup: int = 1,
    tol: float = 0.03,
    log: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> Sandwich:
    """Round-robin like `interleaved`, but with the reference timed between every two variants:
    ref V1 ref V2 ref ... Vn ref (variant order rotated each round).

    Each variant sample is divided by the mean of its two neighbouring reference samples. On a VM whose speed
    jumps (noisy neighbours: 2x slow-downs lasting seconds are common on shared hosts), a sample counts as
    quiet when those two neighbours agree within `tol`; the ratio reported is the median over quiet samples.
    `clock=time.process_time` times CPU seconds instead of wall (with one thread: immune to being
    descheduled)."""
    names = [ref.name, *(v.name for v in variants)]
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {v.name: [] for v in variants}
    quiet: dict[str, list[float]] = {v.name: [] for v in variants}
    n = len(variants)
    steal0, wall0 = cpu_steal_s(), time.perf_counter()
    for r in range(-warmup, rounds):
        before = _timed(ref, clock=clock)
        if r >= 0:
            times[ref.name].append(before)
        for v in [variants[(i + r) % n] for i in range(n)]:
            dt = _timed(v, clock=clock)
            after = _timed(ref, clock=clock)
            if r >= 0:
                times[v.name].append(dt)
                times[ref.name].append(after)
                ratio = dt / ((before + after) / 2)
                ratios[v.name].append(ratio)
                if abs(before - after) <= tol * min(before, after):
                    quiet[v.name].append(ratio)
            before = after
        if log and r >= 0:
            done = " ".join(f"{name}={times[name][-1] * 1e3:.1f}ms" for name in names)
            print(f"  round {r + 1}/{rounds}: {done}", file=sys.stderr, flush=True)
    LAST_RUN.update(wall_s=time.perf_counter() - wall0, steal_s=cpu_steal_s() - steal0)
    return Sandwich(times, ratios, quiet, tol)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def ratio_median(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of per-round ratios num[i]/den[i] (paired, so slow rounds cancel)."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def spread(xs: Sequence[float]) -> float:
    """Half the inter-quartile range relative to the median (a rough +-)."""
    if len(xs) < 4:
        return float("nan")
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / 2 / statistics.median(xs)


def reference_cells(res: Sandwich, name: str) -> list[str]:
    """Table cells of a `sandwiched` run's reference: median ms, IQR/2, ratio 1, and "-" for ratio all, quiet,
    overhead."""
    t = res.times[name]
    return [f"{median(t) * 1e3:.1f}", f"+-{spread(t) * 100:.1f}%", "1.0000", "-", "-", "-"]


def variant_cells(res: Sandwich, name: str) -> list[str]:
    """Table cells of one variant of a `sandwiched` run: median ms, IQR/2, ratio (quiet samples), ratio all,
    quiet, overhead (ratio - 1)."""
    t, r = res.times[name], res.ratio(name)
    return [
        f"{median(t) * 1e3:.1f}",
        f"+-{spread(t) * 100:.1f}%",
        f"{r:.4f}",
        f"{median(res.ratios[name]):.4f}",
        res.quiet_count(name),
        f"{(r - 1) * 100:+.2f}%",
    ]


def print_legend(rounds: int, res: Sandwich, ref: str = "base", extra: str = "") -> None:
    """The line that says how a `sandwiched` run's ratios were formed (`extra` appended), then
    `noise_line()`."""
    print(
        f"rounds={rounds}; every sample divided by the mean of the {ref} runs just before and after it; "
        f"'ratio' = median over quiet samples ({ref} neighbours within {res.tol * 100:.0f}%), "
        f"'ratio all' = median over all samples{extra}"
    )
    print(noise_line())


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def noise_line() -> str:
    """One line on how much CPU the hypervisor took during the last `interleaved` run."""
    if not LAST_RUN:
        return ""
    return (
        f"timing loop: {LAST_RUN['wall_s']:.1f} s wall, CPU steal {LAST_RUN['steal_s']:.2f} s "
        f"(of {LAST_RUN['wall_s'] * THREADS:.1f} CPU-s; >5% means a noisy host, rerun)"
    )
