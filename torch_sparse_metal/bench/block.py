"""Block-sparse against dense: ``python -m torch_sparse_metal.bench block``.

One forward and one backward (every gradient) of a ``BlockSparseLinear`` at each block
sparsity (50, 75, 90 and 95% of the blocks empty by default) run instrumented on the
emulator, and so does the same layer dense, ``tsm.nn.Linear`` (the matmul ladder's
``simdgroup_matrix`` kernel, forward and its two backward products). Per row: device bytes,
FMAs, transactions and, per ``--chip``, the lower bound on the GPU time the counters imply
(:mod:`.roofline`), and that bound against the dense layer's: where it falls under 1 the
block form pays. Counters and bounds, not timings.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .. import _backend
from ..emulator import instrumented, record
from ..nn import BlockSparseLinear, Linear
from . import roofline
from .chips import Chip

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _phases(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor):
    """The counters of one forward and one backward, summed per phase (the dense layer's
    backward is two products)."""
    with _backend.use_backend("emulator"), instrumented():
        with record() as forward:
            y = layer(x)
        with record() as backward:
            y.backward(grad)
    sums = {}
    for phase, launches in (("forward", forward), ("backward", backward)):
        total: Dict[str, int] = {}
        for launch in launches:
            for key, value in launch.counters.items():
                total[key] = total.get(key, 0) + value
        sums[phase] = (total, [launch.kernel for launch in launches])
    return sums


def run(size: int = 1024, batch: int = 64, block: int = 16,
        sparsities: Sequence[float] = (0.5, 0.75, 0.9, 0.95), dtype: str = "float32",
        chips: Sequence[Chip] = (), seed: int = 0) -> List[Dict[str, object]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, size, generator=g).to(DTYPES[dtype]).requires_grad_()
    grad = torch.randn(batch, size, generator=g).to(DTYPES[dtype])
    layers = [("dense", 0.0, Linear(size, size, dtype=DTYPES[dtype]))]
    layers += [(f"block {block}", s, BlockSparseLinear(size, size, block, density=1 - s,
                                                      generator=g).to(DTYPES[dtype]))
               for s in sparsities]
    rows, dense_bounds = [], {}
    for form, sparsity, layer in layers:
        for phase, (c, kernels) in _phases(layer, x, grad).items():
            bounds = [roofline.bound(c, chip) for chip in chips]
            if form == "dense":
                dense_bounds[phase] = [b["bound_us"] for b in bounds]
            rows.append({"form": form, "sparsity": sparsity, "phase": phase, "size": size,
                         "batch": batch, "dtype": dtype, "kernels": kernels,
                         "counters": c, "bounds": bounds,
                         "against_dense": [b["bound_us"] / d for b, d in
                                           zip(bounds, dense_bounds[phase])]})
    return rows


def format_table(rows: List[Dict[str, object]], chips: Sequence[Chip]) -> str:
    head = (f"{'form':<10}{'empty':>7} {'phase':<9}{'bytes':>12}{'FMAs':>13}"
            f"{'transactions':>14}" + "".join(f"{'bound us ' + roofline.short_name(c):>18}"
                                              f"{'x dense':>9}" for c in chips))
    lines = [head, "-" * len(head)]
    for r in rows:
        c = r["counters"]
        cells = "".join(f"{b['bound_us']:>18.2f}{ratio:>9.2f}"
                        for b, ratio in zip(r["bounds"], r["against_dense"]))
        lines.append(f"{r['form']:<10}{r['sparsity']:>7.0%} {r['phase']:<9}"
                     f"{roofline.device_bytes(c):>12}{c['fmas']:>13}"
                     f"{c['device_transactions']:>14}" + cells)
    if rows:
        r = rows[0]
        lines.append(f"{r['size']} x {r['size']}, batch {r['batch']}, {r['dtype']}; dense: "
                     "tsm.nn.Linear (forward and its two backward products); x dense: the "
                     "bound against the dense layer's in the same phase")
    if chips:
        lines += roofline.footnote(chips)
    return "\n".join(lines)
