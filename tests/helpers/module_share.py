"""`--module-share K/N`: run the K-th of N shares of the selected test modules (scripts/test.sh splits the
newest-tree comfy run over both of its processes, so neither waits ~9 minutes alone at the end).

Modules are dealt longest first to the share with the least time so far, from the seconds one run took per
module (module_seconds.json: --durations=0 on the newest tree at one thread); a module not listed counts its
tests at the median seconds per test. Every selected module lands in exactly one share."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

SECONDS = Path(__file__).with_name("module_seconds.json")


def parse_share(value: str) -> tuple[int, int]:
    """ "K/N" (1 <= K <= N) as (K, N); ValueError otherwise."""
    k, sep, n = value.partition("/")
    if not sep or not k.isdigit() or not n.isdigit() or not 1 <= int(k) <= int(n):
        raise ValueError(f"--module-share wants K/N with 1 <= K <= N, got {value!r}")
    return int(k), int(n)


def deal(tests_per_module: dict[str, int], shares: int, seconds: dict[str, float]) -> list[set[str]]:
    """The modules of each share: longest first, each to the share with the least time so far."""
    per_test = [seconds[m] / tests_per_module[m] for m in tests_per_module if m in seconds] or [1.0]
    typical = statistics.median(per_test)
    cost = {m: seconds.get(m, typical * count) for m, count in tests_per_module.items()}
    dealt: list[set[str]] = [set() for _ in range(shares)]
    load = [0.0] * shares
    for module in sorted(cost, key=lambda m: (-cost[m], m)):
        least = min(range(shares), key=lambda i: (load[i], i))
        dealt[least].add(module)
        load[least] += cost[module]
    return dealt


def share_of(modules: list[str], value: str) -> set[str]:
    """The modules of share K/N, dealt from every module of `modules` (one entry per selected test)."""
    k, n = parse_share(value)
    counts: dict[str, int] = {}
    for module in modules:
        counts[module] = counts.get(module, 0) + 1
    seconds = json.loads(SECONDS.read_text()) if SECONDS.exists() else {}
    return deal(counts, n, seconds)[k - 1]
