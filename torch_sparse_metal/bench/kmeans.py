"""k-means: time per Lloyd iteration and points/s, against scikit-learn on the CPU.

Rows (each a fit from the same initial centroids, ``tol=0``, time divided by iterations):

* ``sklearn``: ``sklearn.cluster.KMeans`` (CPU, its own threads);
* ``reference-cpu``: this package's plain-torch backend on CPU tensors;
* on a Mac with MPS: ``metal`` (the kernels, accumulate mode "auto") and ``reference-mps``
  (the same algorithm in plain torch ops on MPS tensors), each synchronised before the
  clock stops — written, but not yet run on an Apple GPU;
* elsewhere: ``emulator`` (the kernels on the CPU through the emulator: a correctness
  vehicle, not a performance claim), plus the dispatches of one iteration, and, from one
  sanitized iteration on a subset, the emulator's counters per kernel (atomics issued,
  device bytes read and written).
"""
from __future__ import annotations

import collections
import os
import time
from typing import Dict, List, Optional, Sequence

import torch

from .. import _backend
from .._record import record
from ..cluster import KMeans
from . import roofline
from .chips import CHIPS, Chip


def make_data(n: int, d: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centers = 8 * torch.randn(k, d, generator=g)
    labels = torch.randint(0, k, (n,), generator=g)
    return (centers[labels] + torch.randn(n, d, generator=g)).contiguous()


def _row(name: str, seconds: float, iters: int, n: int, inertia: float,
         extra: Optional[Dict[str, object]] = None) -> Dict[str, object]:
    per_iter = seconds / max(iters, 1)
    row = {"impl": name, "iterations": iters, "ms_per_iter": 1e3 * per_iter,
           "points_per_s": n / per_iter if per_iter > 0 else float("inf"), "inertia": inertia}
    row.update(extra or {})
    return row


def _fit(x: torch.Tensor, init: torch.Tensor, iters: int, backend: str,
         sync=lambda: None, **kwargs) -> Dict[str, object]:
    km = KMeans(init.shape[0], init=init, max_iter=iters, tol=0.0, **kwargs)
    with _backend.use_backend(backend):
        km.fit(x)  # warm-up: compiles / caches the kernels
        sync()
        start = time.perf_counter()
        km.fit(x)
        sync()
        elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "iters": km.n_iter_, "inertia": km.inertia_}


def _emulator_counters(x: torch.Tensor, init: torch.Tensor) -> Dict[str, Dict[str, int]]:
    """Per kernel, the sanitized emulator's counters over one Lloyd iteration."""
    previous = os.environ.get("TSM_SANITIZE")
    os.environ["TSM_SANITIZE"] = "1"
    try:
        with _backend.use_backend("emulator"), record() as launches:
            KMeans(init.shape[0], init=init, max_iter=1).fit(x)
    finally:
        if previous is None:
            os.environ.pop("TSM_SANITIZE", None)
        else:
            os.environ["TSM_SANITIZE"] = previous
    totals: Dict[str, Dict[str, int]] = {}
    for launch in launches:
        entry = totals.setdefault(launch.kernel, collections.Counter(dispatches=0))
        entry["dispatches"] += 1
        entry.update(launch.counters)
    return {k: dict(v) for k, v in totals.items()}


def run(n: int = 20000, d: int = 32, k: int = 16, iters: int = 10,
        counter_points: int = 2000, chips: Sequence[Chip] = ()) -> Dict[str, object]:
    x = make_data(n, d, k)
    init = x[torch.randperm(n, generator=torch.Generator().manual_seed(1))[:k]].clone()
    rows: List[Dict[str, object]] = []
    try:
        from sklearn.cluster import KMeans as SKKMeans
        sk = SKKMeans(k, init=init.numpy(), n_init=1, max_iter=iters, tol=0.0)
        sk.fit(x.numpy())
        start = time.perf_counter()
        sk.fit(x.numpy())
        rows.append(_row("sklearn", time.perf_counter() - start, sk.n_iter_, n, float(sk.inertia_)))
    except ImportError:
        pass
    r = _fit(x, init, iters, "reference")
    rows.append(_row("reference-cpu", r["seconds"], r["iters"], n, r["inertia"]))

    result: Dict[str, object] = {"n": n, "d": d, "k": k, "rows": rows}
    from .. import _metal_backend
    if _metal_backend.is_available():
        xm, im = x.to("mps"), init.to("mps")
        sync = torch.mps.synchronize
        caps = _metal_backend.device_capabilities()
        r = _fit(xm, im, iters, "metal", sync)
        rows.append(_row("metal", r["seconds"], r["iters"], n, r["inertia"],
                         {"accumulate": "atomic" if caps["supports_metal3"] else "cas"}))
        r = _fit(xm, im, iters, "reference", sync)
        rows.append(_row("reference-mps", r["seconds"], r["iters"], n, r["inertia"]))
    else:
        previous = os.environ.get("TSM_SANITIZE")
        os.environ["TSM_SANITIZE"] = "0"
        try:
            r = _fit(x, init, iters, "emulator")
            with _backend.use_backend("emulator"), record() as launches:
                KMeans(k, init=init, max_iter=1).fit(x)
        finally:
            if previous is None:
                os.environ.pop("TSM_SANITIZE", None)
            else:
                os.environ["TSM_SANITIZE"] = previous
        rows.append(_row("emulator", r["seconds"], r["iters"], n, r["inertia"]))
        result["dispatches_one_iteration_fit"] = [l.kernel for l in launches]
        sub = x[:counter_points].contiguous()
        counters = _emulator_counters(sub, sub[:k].clone())
        result["counters_one_iteration"] = counters
        result["counter_points"] = sub.shape[0]
        result["chips"] = [c.name for c in chips]
        result["bounds_one_iteration"] = {kernel: [roofline.bound(c, chip) for chip in chips]
                                          for kernel, c in counters.items()}
    return result


def format_report(result: Dict[str, object]) -> str:
    lines = [f"k-means, n={result['n']} d={result['d']} k={result['k']} (same initial centroids)",
             f"{'impl':<15}{'iters':>7}{'ms/iter':>11}{'Mpoints/s':>11}{'inertia':>16}"]
    for r in result["rows"]:
        lines.append(f"{r['impl']:<15}{r['iterations']:>7}{r['ms_per_iter']:>11.2f}"
                     f"{r['points_per_s'] / 1e6:>11.2f}{r['inertia']:>16.6g}")
    if "dispatches_one_iteration_fit" in result:
        names = collections.Counter(result["dispatches_one_iteration_fit"])
        lines.append("")
        lines.append("dispatches of fit(max_iter=1) (one iteration + ||x||^2 + final labels): "
                     + ", ".join(f"{k} x{v}" for k, v in names.items()))
        lines.append(f"emulator counters, one sanitized iteration on {result['counter_points']} points:")
        chips = [CHIPS[name] for name in result["chips"]]
        lines.append(f"  {'kernel':<34}{'atomics':>9}{'atom cf':>9}{'bytes read':>12}{'written':>10}"
                     f"{'barriers':>10}" + roofline.header(chips))
        for kernel, c in result["counters_one_iteration"].items():
            lines.append(f"  {kernel:<34}{c['atomics']:>9}{c['atomic_conflicts']:>9}"
                         f"{c['device_bytes_read']:>12}{c['device_bytes_written']:>10}"
                         f"{c['barriers']:>10}" + roofline.cells(c, chips))
        lines += ["  " + line for line in roofline.footnote(chips)] if chips else []
        lines.append("(the emulator runs on this CPU: its times are not GPU times)")
    return "\n".join(lines)
