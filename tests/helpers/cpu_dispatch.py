"""Which ATen CPU dispatches (ATEN_CPU_CAPABILITY values) this machine can run, and why not the others.

ATen's AVX2 kernels need AVX2 and FMA, its AVX-512 ones AVX-512 F/BW/VL/DQ (the flags of /proc/cpuinfo);
torch's own pick in this process (`torch.backends.cpu.get_cpu_capability()`, which ATEN_CPU_CAPABILITY
lowers) caps them. A dispatch the CPU lacks is never started: on a CPU without AVX-512 the `avx512` run
died of SIGILL."""

from __future__ import annotations

from pathlib import Path

DISPATCHES = ("default", "avx2", "avx512")
NEEDS = {"default": (), "avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq")}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's `flags` (x86); empty where the file or the line is missing."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def why_not(dispatch: str, flags: frozenset[str], torch_capability: str) -> str | None:
    """None when `dispatch` runs here; else why not (the missing flags, or torch's lower pick)."""
    if dispatch == "default":  # every CPU, every architecture
        return None
    missing = [f for f in NEEDS[dispatch] if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)} (/proc/cpuinfo flags)"
    picked = torch_capability.lower()
    if picked not in DISPATCHES or DISPATCHES.index(dispatch) > DISPATCHES.index(picked):
        return f"torch dispatches {torch_capability} here (its CPU check or ATEN_CPU_CAPABILITY)"
    return None


def plan(flags: frozenset[str], torch_capability: str) -> dict[str, str | None]:
    """{dispatch: None (runs) or why not}, in DISPATCHES order."""
    return {d: why_not(d, flags, torch_capability) for d in DISPATCHES}
