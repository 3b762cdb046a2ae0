"""The matmul ladder benchmark: ``python -m torch_sparse_metal.bench matmul``.

Two modes:

* ``--device emulator`` (the default off a Mac): every rung runs once per shape on the
  emulator, instrumented; the row reports whether it matched a float64 product and the
  emulator's counters -- device bytes read and written, FMAs, threadgroup accesses, bank
  conflicts, barriers -- with the arithmetic intensity they imply (FLOPs per device byte).
  The counters are properties of the kernel's code, not of a machine: no time is reported
  as a performance figure (the emulator's wall time is given only as the cost of the run).
* ``--device mps`` (the default on a Mac with MPS): every rung, ``torch.mm`` and Apple's
  ``MPSMatrixMultiplication`` (through the extension's ``mps_matmul``) timed on square
  sizes 256-4096 and transformer shapes: ``--repeats`` calls back to back between two
  ``torch.mps.synchronize()``, so the time per call is the GPU's; TFLOP/s and percent of
  the chip's FP32 peak (:data:`FP32_PEAKS`, each figure with its source); an
  implementation that fails gets a row saying why; ``--csv`` and ``--plot`` write the
  table and a PNG.

``--json`` prints the rows as JSON in both modes.
"""
from __future__ import annotations

import csv
import math
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _backend
from ..emulator import instrumented, record
from ..ops import matmul as mmops
from . import roofline
from .dims import parse_dims
from .chips import FP32_PEAKS, Chip

Shape = Tuple[str, int, int, int]  # (label, M, N, K)

SQUARE_SIZES = (256, 512, 1024, 2048, 4096)
# Transformer shapes (sequence 2048, model width 1024, 16 heads of 64, MLP 4x):
TRANSFORMER_SHAPES: Tuple[Shape, ...] = (
    ("qk_t", 2048, 2048, 64),         # Q @ K^T of one head
    ("attn_v", 2048, 64, 2048),       # softmax(QK^T) @ V
    ("qkv_proj", 2048, 3072, 1024),   # x @ W_qkv^T
    ("mlp_up", 2048, 4096, 1024),
    ("mlp_down", 2048, 1024, 4096),
    ("skinny_decode", 16, 4096, 4096),  # a small decode batch
    ("matvec", 1, 4096, 4096),
)
# Emulator defaults: small, with partial edge tiles, and one transformer-like skinny shape.
EMULATOR_SHAPES: Tuple[Shape, ...] = (
    ("square_64", 64, 64, 64), ("square_128", 128, 128, 128), ("odd_97", 97, 65, 33),
    ("skinny", 8, 128, 128),
)

CSV_FIELDS = ("shape", "m", "n", "k", "dtype", "kernel", "ms", "tflops", "pct_peak", "ok",
              "error")


def parse_shape(spec: str) -> Shape:
    """``"MxNxK"``, or ``"S"`` for a square ``S x S x S``; every dimension a positive int."""
    dims = parse_dims(spec, "shape", "MxNxK")
    return (f"{dims[0]}x{dims[1]}x{dims[2]}", *dims)


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype=dtype, device=device)
    b = torch.randn(k, n, generator=g).to(dtype=dtype, device=device)
    return a, b


# ---------------------------------------------------------------------------------------
# Emulator: correctness and counters


def run_emulator(shapes: Optional[Sequence[Shape]] = None, kernels: Sequence[str] = mmops.KERNELS,
                 dtype: torch.dtype = torch.float32,
                 chips: Sequence[Chip] = ()) -> List[Dict[str, object]]:
    """One row per (shape, kernel): correctness, the emulator's counters and, per chip,
    the lower bound on the GPU time they imply (:mod:`.roofline`)."""
    rows = []
    for label, m, n, k in shapes or EMULATOR_SHAPES:
        a, b = _inputs(m, n, k, dtype, "cpu")
        expected = a.double() @ b.double()
        # Outputs stay alive for the whole shape: a recycled buffer holding an equal product
        # would make the emulator count its stores as reads (a store of the value already
        # in memory is invisible to it).
        keep = []
        for kernel in kernels:
            start = time.perf_counter()
            with _backend.use_backend("emulator"), instrumented(), record() as launches:
                out = mmops.mm(a, b, kernel=kernel)
            seconds = time.perf_counter() - start
            keep.append(out)
            counters = dict(launches[0].counters)
            moved = roofline.device_bytes(counters)
            flops = 2 * m * n * k
            tol = 1e-4 * math.sqrt(k) if dtype == torch.float32 else 2e-2 * math.sqrt(k)
            ok = bool(torch.allclose(out.double(), expected, rtol=tol, atol=tol))
            rows.append({"shape": label, "m": m, "n": n, "k": k, "dtype": str(dtype),
                         "kernel": launches[0].kernel, "rung": kernel, "ok": ok, **counters,
                         "flops": flops,
                         "flops_per_device_byte": flops / moved if moved else float("inf"),
                         "threadgroup_accesses_per_fma": counters["threadgroup_accesses"] /
                         max(counters["fmas"], 1),
                         **roofline.coalescing_columns(counters),
                         "bounds": [roofline.bound(counters, chip) for chip in chips],
                         "emulator_seconds": seconds})
    return rows


def format_emulator_table(rows: List[Dict[str, object]], chips: Sequence[Chip] = ()) -> str:
    head = (f"{'shape':<12}{'kernel':<26}{'ok':>4}{'dev read B':>12}{'dev write B':>12}"
            f"{'FMAs':>11}{'tg acc':>10}{'bank cf':>9}{'barriers':>9}{'FLOP/B':>8}"
            + roofline.header(chips))
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['shape']:<12}{r['kernel']:<26}{'yes' if r['ok'] else 'NO':>4}"
                     f"{r['device_bytes_read']:>12}{r['device_bytes_written']:>12}"
                     f"{r['fmas']:>11}{r['threadgroup_accesses']:>10}{r['bank_conflicts']:>9}"
                     f"{r['barriers']:>9}{r['flops_per_device_byte']:>8.2f}"
                     + roofline.cells(r, chips))
    lines.append("FLOP/B: 2*M*N*K over device bytes read + written, from the counters (no "
                 "cache model: what the kernel asks of memory). Emulator figures, not timings.")
    if chips:
        lines += roofline.footnote(chips)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# MPS: timings (a Mac with an Apple GPU; never run on the machines this was written on)


def time_per_call(fn: Callable[[], object], *, warmup: int, calls: int,
                  sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per call of ``fn``: ``calls`` calls back to back between two
    synchronisations, after ``warmup`` calls. The GPU's queue stays full, so this is the
    GPU's time per call (or the host's, if encoding is the slower), not one launch plus a
    wait for the GPU to drain each time."""
    for _ in range(warmup):
        fn()
    sync()
    start = clock()
    for _ in range(calls):
        fn()
    sync()
    return (clock() - start) / calls


def _mps_baseline():
    """The extension's MPSMatrixMultiplication entry point, or None if unavailable."""
    try:
        from .._metal_backend import _extension
        return getattr(_extension(), "mps_matmul", None)
    except Exception:  # noqa: BLE001 -- any failure just drops the baseline column
        return None


def run_mps(shapes: Optional[Sequence[Shape]] = None, kernels: Sequence[str] = mmops.KERNELS,
            dtype: torch.dtype = torch.float32, warmup: int = 3, repeats: int = 10,
            peak_tflops: Optional[float] = None, *, device: str = "mps", backend: str = "metal",
            caps: Optional[Dict[str, object]] = None, baseline: Optional[Callable] = None,
            sync: Optional[Callable[[], None]] = None,
            clock: Callable[[], float] = time.perf_counter) -> List[Dict[str, object]]:
    """One row per (shape, implementation): ms per call over ``repeats`` back-to-back calls
    (:func:`time_per_call`), TFLOP/s, % of the FP32 peak, and a correctness check. An
    implementation that fails gets a row with its ``error``; the others still run.

    ``baseline``: the extension's ``mps_matmul`` (:func:`_mps_baseline`) for an
    MPSMatrixMultiplication row. ``device``, ``backend``, ``caps``, ``sync`` and ``clock``
    default to the real MPS run (the device's capabilities, ``torch.mps.synchronize``);
    the tests pass CPU stand-ins.
    """
    if caps is None:
        from .._metal_backend import device_capabilities
        caps = device_capabilities()
    sync = sync or torch.mps.synchronize
    peak = peak_tflops if peak_tflops is not None else FP32_PEAKS.get(str(caps["name"]),
                                                                      (None, ""))[0]
    if shapes is None:
        shapes = [(f"square_{s}", s, s, s) for s in SQUARE_SIZES] + list(TRANSFORMER_SHAPES)
    rows = []
    for label, m, n, k in shapes:
        a, b = _inputs(m, n, k, dtype, device)
        reference = torch.mm(a.float(), b.float())
        impls: Dict[str, Callable[[], torch.Tensor]] = {"torch.mm": lambda: torch.mm(a, b)}
        for kernel in kernels:
            if mmops.RUNGS[kernel].needs_simdgroup_matrix and not caps["supports_apple7"]:
                continue
            impls[kernel] = (lambda kern: lambda: mmops.mm(a, b, kernel=kern))(kernel)
        if baseline is not None and dtype in (torch.float32, torch.float16):
            c = torch.empty(m, n, dtype=dtype, device=device)
            impls["MPSMatrixMultiplication"] = lambda: (baseline(a, b, c), c)[1]
        row = {"shape": label, "m": m, "n": n, "k": k, "dtype": str(dtype)}
        with _backend.use_backend(backend):
            for name, fn in impls.items():
                try:
                    out = fn()
                    sync()
                    ok = bool(torch.allclose(out.float(), reference, rtol=2e-2,
                                             atol=2e-2 * math.sqrt(k)))
                    seconds = time_per_call(fn, warmup=warmup, calls=repeats, sync=sync,
                                            clock=clock)
                except Exception as exc:  # noqa: BLE001 -- reported in the row, the rest run
                    rows.append({**row, "kernel": name, "ms": None, "tflops": None,
                                 "pct_peak": None, "ok": False,
                                 "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
                    continue
                tflops = 2 * m * n * k / seconds / 1e12
                rows.append({**row, "kernel": name, "ms": seconds * 1e3, "tflops": tflops,
                             "pct_peak": 100 * tflops / peak if peak else None, "ok": ok,
                             "error": None})
    return rows


def format_mps_table(rows: List[Dict[str, object]]) -> str:
    lines = [f"{'shape':<16}{'kernel':<26}{'ms':>10}{'TFLOP/s':>10}{'% peak':>8}{'ok':>5}"]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['shape']:<16}{r['kernel']:<26}  failed: {r['error']}")
            continue
        pct = f"{r['pct_peak']:.1f}" if r["pct_peak"] is not None else "-"
        lines.append(f"{r['shape']:<16}{r['kernel']:<26}{r['ms']:>10.3f}{r['tflops']:>10.3f}"
                     f"{pct:>8}{'yes' if r['ok'] else 'NO':>5}")
    lines.append("ms: per call, over back-to-back calls between two synchronisations.")
    return "\n".join(lines)


def write_csv(rows: List[Dict[str, object]], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_plot(rows: List[Dict[str, object]], path: str) -> None:
    """TFLOP/s per implementation, one group of bars per shape (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["kernel"] for r in rows))
    width = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(shapes)), 5))
    for i, impl in enumerate(impls):
        values = {r["shape"]: r["tflops"] or 0.0 for r in rows if r["kernel"] == impl}
        xs = [j + i * width for j, s in enumerate(shapes)]
        ax.bar(xs, [values.get(s, 0.0) for s in shapes], width, label=impl)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels(shapes, rotation=30, ha="right")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"matmul ladder vs torch.mm and MPSMatrixMultiplication ({rows[0]['dtype']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def default_device() -> str:
    from .._metal_backend import is_available
    return "mps" if is_available() else "emulator"


def main(args) -> Tuple[List[Dict[str, object]], str]:
    """Rows and their text table, for the CLI (``bench/__main__.py``)."""
    dtype = {"float32": torch.float32, "float16": torch.float16,
             "bfloat16": torch.bfloat16}[args.dtype]
    device = args.device or default_device()
    shapes = args.sizes  # parsed by parse_shape
    kernels = args.kernels or mmops.KERNELS
    if device == "emulator":
        chips = args.chip or ()
        rows = run_emulator(shapes, kernels, dtype, chips)
        return rows, format_emulator_table(rows, chips)
    rows = run_mps(shapes, kernels, dtype, warmup=args.warmup, repeats=args.repeats,
                   peak_tflops=args.peak_tflops, baseline=_mps_baseline())
    if args.csv:
        write_csv(rows, args.csv)
    if args.plot:
        write_plot(rows, args.plot)
    return rows, format_mps_table(rows)
