"""What the sanitizer costs: barrier-heavy kernels timed plain and sanitized on the emulator.

Both runs must agree with a float64 reference, so the benchmark is also a check that the
sanitizer changes nothing about what the kernels compute. Sanitized dispatches are timed as
tests run them, and again inside ``tsm.record()``, where they also count SIMD-group
instructions (transactions, bank conflicts, active lanes) for the launches it collects.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List

import numpy as np
import torch

from ..emulator import load_shader_file, record

SHADER = "bench/barrier_heavy.metal"


def _best_of(repeats: int, fn: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _matmul_case(n: int) -> Dict[str, object]:
    g = torch.Generator().manual_seed(n)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    expected = (a.double() @ b.double()).float()
    grid = ((n + 15) // 16 * 16,) * 2

    def run(sanitize: bool) -> torch.Tensor:
        c = torch.empty(n, n)
        load_shader_file(SHADER, sanitize=sanitize).tiled_matmul(a, b, c, n, threads=grid, group_size=(16, 16))
        return c

    barriers = 2 * ((n + 15) // 16) * grid[0] * grid[1]
    return {"kernel": "tiled_matmul", "size": f"{n}x{n}x{n}", "run": run, "expected": expected,
            "atol": 1e-3 * n ** 0.5, "barrier_waits": barriers}


def _reduce_case(count: int, group: int = 256) -> Dict[str, object]:
    x = torch.randn(count, generator=torch.Generator().manual_seed(count))
    groups = (count + group - 1) // group
    expected = x.double().reshape(-1)

    def run(sanitize: bool) -> torch.Tensor:
        partial = torch.empty(groups)
        load_shader_file(SHADER, sanitize=sanitize).tree_reduce(
            x, partial, count, threads=groups * group, group_size=group, threadgroup_memory=[4 * group])
        return partial.sum().reshape(1)

    stages = int(np.log2(group)) + 1
    return {"kernel": "tree_reduce", "size": f"{count}", "run": run,
            "expected": expected.sum().float().reshape(1), "atol": 1e-3 * count ** 0.5,
            "barrier_waits": stages * groups * group}


def _counted(run: Callable[[bool], torch.Tensor]) -> torch.Tensor:
    with record():
        return run(True)


def run(sizes: List[int], repeats: int = 3) -> List[Dict[str, object]]:
    """One row per (kernel, size): seconds plain, sanitized and sanitized with the counters
    counted, and the slowdowns of the two over plain."""
    rows = []
    cases = [_matmul_case(n) for n in sizes] + [_reduce_case(n * n) for n in sizes]
    for case in cases:
        timings = {}
        builds = {"plain": lambda: case["run"](False), "sanitized": lambda: case["run"](True),
                  "counted": lambda: _counted(case["run"])}
        for build, fn in builds.items():
            out = fn()  # compiles, and checks the answer
            torch.testing.assert_close(out, case["expected"], atol=case["atol"], rtol=1e-4)
            timings[build] = _best_of(repeats, fn)
        rows.append({"kernel": case["kernel"], "size": case["size"],
                     "barrier_waits": case["barrier_waits"],
                     "plain_s": timings["plain"], "sanitized_s": timings["sanitized"],
                     "counted_s": timings["counted"],
                     "slowdown": timings["sanitized"] / timings["plain"],
                     "counted_slowdown": timings["counted"] / timings["plain"]})
    return rows


def format_table(rows: List[Dict[str, object]]) -> str:
    lines = [f"{'kernel':<14}{'size':>14}{'barrier waits':>15}{'plain ms':>11}{'sanitized ms':>14}{'slowdown':>10}"
             f"{'counted ms':>12}{'slowdown':>10}"]
    for r in rows:
        lines.append(f"{r['kernel']:<14}{r['size']:>14}{r['barrier_waits']:>15,}{1e3 * r['plain_s']:>11.1f}"
                     f"{1e3 * r['sanitized_s']:>14.1f}{r['slowdown']:>9.1f}x"
                     f"{1e3 * r['counted_s']:>12.1f}{r['counted_slowdown']:>9.1f}x")
    lines.append("(emulator on this CPU; every build uses one worker per 8K threads, up to the core count;")
    lines.append(" counted: sanitized inside tsm.record(), which also counts SIMD-group instructions)")
    return "\n".join(lines)
