"""The sparse layer's kernels on the emulator: ``python -m torch_sparse_metal.bench sparse``.

For each size and dtype (float32 and float16 by default), one forward and one backward of a
``SparseLinear`` (random pattern, every gradient needed) run instrumented; a row per kernel
reports the device bytes, FMAs, the
device transactions against their minimum (coalescing efficiency), the lanes active per
memory instruction, the atomics' serialisation and, per ``--chip``, the lower bound on
the GPU time those counters imply (:mod:`.roofline`). Counters, not timings.
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Sequence, Tuple

import torch

from .. import _backend
from ..emulator import instrumented, record
from ..nn import SparseLinear
from . import roofline
from .chips import Chip

Size = Tuple[int, int]  # (in_features, out_features)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def run(sizes: Sequence[Size] = ((4096, 4096),), density: float = 0.01, batch: int = 64,
        chips: Sequence[Chip] = (), seed: int = 0,
        dtypes: Sequence[str] = ("float32", "float16")) -> List[Dict[str, object]]:
    rows = []
    for (in_features, out_features), dtype in itertools.product(sizes, dtypes):
        g = torch.Generator().manual_seed(seed)
        layer = SparseLinear(in_features, out_features, density=density, generator=g)
        layer.to(DTYPES[dtype])
        x = torch.randn(batch, in_features, generator=g).to(DTYPES[dtype]).requires_grad_()
        grad = torch.randn(batch, out_features, generator=g).to(DTYPES[dtype])
        with _backend.use_backend("emulator"), instrumented():
            with record() as forward:
                y = layer(x)
            with record() as backward:
                y.backward(grad)
        for phase, launches in (("forward", forward), ("backward", backward)):
            for launch in launches:
                c = launch.counters
                rows.append({"size": f"{in_features}x{out_features}", "in_features": in_features,
                             "out_features": out_features, "dtype": dtype,
                             "density": density, "batch": batch,
                             "nnz": layer.nnz, "phase": phase, "kernel": launch.kernel,
                             "threads": launch.threads[0], "counters": dict(c),
                             **roofline.coalescing_columns(c),
                             "bounds": [roofline.bound(c, chip) for chip in chips]})
    return rows


def format_table(rows: List[Dict[str, object]], chips: Sequence[Chip]) -> str:
    head = (f"{'size':<11}{'phase':<9}{'kernel':<38}{'bytes':>11}{'FMAs':>10}"
            + roofline.header(chips))
    lines = [head, "-" * len(head)]
    for r in rows:
        c = r["counters"]
        lines.append(f"{r['size']:<11}{r['phase']:<9}{r['kernel']:<38}"
                     f"{roofline.device_bytes(c):>11}{c['fmas']:>10}"
                     + roofline.cells(c, chips))
    if rows:
        lines.append(f"density {rows[0]['density']}, batch {rows[0]['batch']}; transactions of "
                     "128 B against the minimum for the bytes each SIMD-group instruction used; "
                     "lanes: active lanes per memory instruction")
    if chips:
        lines += roofline.footnote(chips)
    return "\n".join(lines)
