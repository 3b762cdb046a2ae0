"""A training step of a sparse MLP split by phase: forward, loss, backward, optimizer.

Per phase: wall time (median over steps) and kernel dispatches (``tsm.record()``); on
the emulator also the device bytes the kernels read and wrote, from one more step run
instrumented (``tsm.emulator.instrumented()``: the counters of the sanitized build). On MPS the
phases are separated by ``torch.mps.synchronize()``, so times are GPU-inclusive ms; on the
emulator they are CPU times of the emulated kernels plus the host code, useful to compare
variants on one machine and nothing else: never read them as Apple GPU numbers.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Dict, List, Optional

import torch

from .. import _metal_backend
from .._backend import use_backend
from ..emulator import instrumented, record
from ..nn import SparseLinear
from ..nn.functional import cross_entropy
from ..optim import AdamW
from . import roofline

PHASES = ("forward", "loss", "backward", "optimizer")


def run(widths=(784, 256, 128, 10), density: float = 0.1, batch: int = 128, steps: int = 5,
        backend: str = "auto", seed: int = 0) -> Dict[str, object]:
    """Time ``steps`` training steps (after one warm-up) and return rows per phase."""
    on_mps = backend in ("auto", "metal") and _metal_backend.is_available()
    if backend == "auto":
        backend = "metal" if on_mps else "emulator"
    device = torch.device("mps" if backend == "metal" else "cpu")
    sync = torch.mps.synchronize if device.type == "mps" else (lambda: None)
    g = torch.Generator().manual_seed(seed)
    layers = [SparseLinear(a, b, density=density, generator=g,
                           activation="relu" if i < len(widths) - 2 else None)
              for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]
    model = torch.nn.Sequential(*layers).to(device)
    opt = AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, widths[0], generator=g).to(device)
    y = torch.randint(0, widths[-1], (batch,), generator=g).to(device)

    times: Dict[str, List[float]] = {p: [] for p in PHASES}
    dispatches: Dict[str, int] = {}
    device_bytes: Dict[str, Optional[int]] = {p: None for p in PHASES}
    counted_step = steps + 1  # one more step, instrumented, for the emulator's counters
    with use_backend(backend):
        for step in range(steps + 1 + (backend == "emulator")):  # step 0 warms up
            opt.zero_grad()
            state: Dict[str, object] = {}
            counting = step == counted_step

            def phase(name, fn):
                sync()
                start = time.perf_counter()
                with record() as launches:
                    fn()
                sync()
                if counting:
                    device_bytes[name] = sum(roofline.device_bytes(l.counters)
                                             for l in launches)
                    return
                if step:
                    times[name].append(time.perf_counter() - start)
                dispatches[name] = len(launches)

            with instrumented() if counting else contextlib.nullcontext():
                phase("forward", lambda: state.update(logits=model(x)))
                phase("loss", lambda: state.update(loss=cross_entropy(state["logits"], y)))
                phase("backward", lambda: state["loss"].backward())
                phase("optimizer", opt.step)
    rows = [dict(phase=p, ms=1e3 * statistics.median(times[p]), dispatches=dispatches[p],
                 device_bytes=device_bytes[p]) for p in PHASES]
    total = sum(r["ms"] for r in rows)
    for r in rows:
        r["share"] = r["ms"] / total if total else 0.0
    return dict(backend=backend, device=str(device), widths=list(widths), density=density,
                batch=batch, nnz=[l.nnz for l in layers], steps=steps, rows=rows,
                step_ms=total, step_dispatches=sum(r["dispatches"] for r in rows))


def format_table(result: Dict[str, object]) -> str:
    where = ("Apple GPU (MPS), ms" if result["backend"] == "metal"
             else "Metal EMULATOR on the CPU: not GPU time, compare only on this machine")
    lines = [f"sparse MLP {result['widths']} at density {result['density']}, nnz "
             f"{result['nnz']}, batch {result['batch']}, median of {result['steps']} steps",
             f"timing: {where}",
             f"{'phase':<10} {'ms':>10} {'share':>7} {'dispatches':>11} {'device bytes':>13}"]
    for r in result["rows"]:
        counted = f"{r['device_bytes']:>13,d}" if r["device_bytes"] is not None else f"{'-':>13}"
        lines.append(f"{r['phase']:<10} {r['ms']:>10.3f} {r['share']:>7.1%} "
                     f"{r['dispatches']:>11d} {counted}")
    lines.append(f"{'step':<10} {result['step_ms']:>10.3f} {'':>7} "
                 f"{result['step_dispatches']:>11d}")
    return "\n".join(lines)
