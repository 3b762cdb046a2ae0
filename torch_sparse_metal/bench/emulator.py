"""The emulator's speed, against PoCL: ``python -m torch_sparse_metal.bench emulator``.

Two kinds of rows:

* **twins**: kernels written twice with the same algorithm, memory layout and launch
  geometry, in MSL for the emulator (``shaders/bench/*.metal``) and in OpenCL C for PoCL
  (``shaders/bench/*.cl``): a 16x16 tiled matmul with two barriers per K step, a CSR
  product with no barrier, a tree reduction with a barrier per stage. ``ratio`` is
  emulator ms / PoCL ms. PoCL (CPU OpenCL: it turns the code between barriers into loops
  over the work-items and vectorises them) runs when ``pyopencl`` finds a PoCL CPU device;
  otherwise its cells say why not, and the run goes on.
* **the project's shaders** at realistic sizes (``tsm.mm`` per rung, ``sparse_linear``
  forward and backward, one k-means Lloyd iteration): emulator only, as they have no
  OpenCL twin.

Every row also runs the sanitized build: ``slowdown`` is sanitized ms / emulator ms.

Method: each implementation first runs once as a warm-up whose outputs (poisoned with NaN
beforehand) are checked against NumPy in float64, so a wrong answer is a failed row, not
a number. Then rounds: in each round every implementation runs once, in turn (the
sanitized one only in its first ``sanitized_repeats`` rounds), so a change in the
machine's load hits them alike; each reports its minimum over the rounds. A time is the
host's wall time of one dispatch with its inputs resident (for PoCL: enqueue, then
``finish``; for the emulator: the ``compile_shader``-style call, or the op's call).
"""
from __future__ import annotations

import contextlib
import csv
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import _backend
from ..emulator import load_shader_file, sanitize_by_default
from ..ops import kmeans as K
from ..ops import matmul as mmops
from ..ops.sparse_linear import CSRPattern, sparse_linear_pattern
from .kmeans import make_data
from .pocl import PoclDevice, find_pocl

BARRIER_HEAVY = "bench/barrier_heavy"   # .metal and .cl
CSR_FORWARD = "bench/csr_forward"
TWIN_PROGRAMS = (BARRIER_HEAVY, CSR_FORWARD)
IMPLEMENTATIONS = ("emulator", "pocl", "sanitized")
NO_TWIN = "no OpenCL twin"
CSV_FIELDS = ("kernel", "size", "emulator_ms", "pocl_ms", "ratio", "sanitized_ms", "slowdown",
              "ok", "emulator", "pocl", "sanitized")


@dataclass
class Impl:
    """One implementation of a row, ready to run: ``run`` is what is timed (one dispatch,
    or an op's dispatches); ``result`` reads its outputs back, untimed."""
    run: Callable[[], None]
    result: Callable[[], List[np.ndarray]]


@dataclass
class Case:
    """A row: how to build the emulator's implementation (plain or sanitized), PoCL's
    (None: no OpenCL twin), and the check of their outputs (None if right, else what is
    wrong)."""
    kernel: str
    size: str
    emulator: Callable[[bool], Impl]
    check: Callable[[Sequence[np.ndarray]], Optional[str]]
    pocl: Optional[Callable[[PoclDevice], Impl]] = None


# ---------------------------------------------------------------------------------------
# Checks against NumPy


def mismatch(got: np.ndarray, want: np.ndarray, atol: float, rtol: float = 1e-4) -> Optional[str]:
    """None when ``|got - want| <= atol + rtol * |want|`` everywhere (NaN fails), else
    where and by how much it is wrong."""
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    error = np.abs(got - want)
    bad = ~(error <= atol + rtol * np.abs(want))
    if not bad.any():
        return None
    i = np.unravel_index(np.argmax(np.where(bad, error, -1)), want.shape)  # a NaN, or the worst
    return (f"{int(bad.sum())} of {want.size} elements off, e.g. at {tuple(int(j) for j in i)}: "
            f"{float(got[i]):.7g}, expected {float(want[i]):.7g}")


def _all_right(*problems: Optional[str]) -> Optional[str]:
    wrong = [p for p in problems if p]
    return "; ".join(wrong) if wrong else None


def _poisoned(shape: Tuple[int, ...], dtype=np.float32) -> np.ndarray:
    return np.full(shape, np.nan, dtype=dtype)


def csr_product(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray,
                x: np.ndarray) -> np.ndarray:
    """``x @ W.T`` in float64, ``W`` (rows x cols) in CSR, ``x`` (batch, cols): prefix sums
    of the edges' products, differenced at the row boundaries (empty rows give 0)."""
    products = x.astype(np.float64)[:, indices] * values
    prefix = np.zeros((x.shape[0], len(indices) + 1))
    np.cumsum(products, axis=1, out=prefix[:, 1:])
    return prefix[:, indptr[1:]] - prefix[:, indptr[:-1]]


def random_csr(rows: int, cols: int, density: float,
               rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indptr, indices, values)`` int32, int32, float32: ``round(density * rows * cols)``
    distinct cells at random, columns sorted within a row."""
    cells = rng.choice(rows * cols, size=round(density * rows * cols), replace=False)
    cells.sort()
    indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(cells // cols, minlength=rows), out=indptr[1:])
    values = rng.standard_normal(len(cells), dtype=np.float32)
    return indptr.astype(np.int32), (cells % cols).astype(np.int32), values


# ---------------------------------------------------------------------------------------
# Twins: one MSL kernel and its OpenCL copy


def _twin(kernel: str, size: str, shader: str, args: Sequence[object], outputs: Sequence[int],
          threads: Tuple[int, ...], group: Tuple[int, ...],
          check: Callable[[Sequence[np.ndarray]], Optional[str]],
          local_memory: Sequence[int] = ()) -> Case:
    """A case for ``kernel`` of ``shaders/<shader>.metal`` and ``.cl``. ``args`` are NumPy
    arrays and scalars in binding order; each implementation gets its own copy of the
    ``outputs`` (poisoned with NaN by the caller)."""
    def own_outputs() -> List[object]:
        return [a.copy() if i in outputs else a for i, a in enumerate(args)]

    def emulator(sanitize: bool) -> Impl:
        k = getattr(load_shader_file(shader + ".metal", sanitize=sanitize), kernel)
        mine = own_outputs()
        return Impl(lambda: k(*mine, threads=threads, group_size=group,
                              threadgroup_memory=list(local_memory)),
                    lambda: [mine[i].copy() for i in outputs])

    def pocl(device: PoclDevice) -> Impl:
        return Impl(*device.prepare(shader, kernel, own_outputs(), outputs, threads, group,
                                    local_memory))

    return Case(kernel, size, emulator, check, pocl)


def tiled_matmul_case(n: int) -> Case:
    """C = A @ B, n x n float32: 16x16 threadgroups, two barriers per K step."""
    rng = np.random.default_rng(n)
    a, b = rng.standard_normal((2, n, n), dtype=np.float32)
    want = a.astype(np.float64) @ b
    grid = -(-n // 16) * 16
    return _twin("tiled_matmul", f"{n}^3", BARRIER_HEAVY, [a, b, _poisoned((n, n)), np.uint32(n)],
                 [2], (grid, grid), (16, 16), lambda out: mismatch(out[0], want, 1e-4 * n ** 0.5))


def tree_reduce_case(count: int, group: int = 256) -> Case:
    """One partial sum per threadgroup of ``group`` threads: log2(group) + 1 barriers."""
    rng = np.random.default_rng(count)
    x = rng.standard_normal(count, dtype=np.float32)
    groups = -(-count // group)
    padded = np.zeros(groups * group)
    padded[:count] = x
    want = padded.reshape(groups, group).sum(axis=1)
    return _twin("tree_reduce", f"{count:,} ({group}/group)", BARRIER_HEAVY,
                 [x, _poisoned((groups,)), np.uint32(count)], [1], (groups * group,), (group,),
                 lambda out: mismatch(out[0], want, 1e-4 * group ** 0.5),
                 local_memory=[4 * group])


def csr_forward_case(rows: int, cols: int, density: float, batch: int,
                     group: int = 256) -> Case:
    """``x @ W.T``, W in CSR, one thread per (row, batch element): no barrier."""
    rng = np.random.default_rng(rows + cols + batch)
    indptr, indices, values = random_csr(rows, cols, density, rng)
    x = rng.standard_normal((batch, cols), dtype=np.float32)
    want = csr_product(indptr, indices, values, x)
    return _twin("csr_forward", _sparse_size(rows, cols, density, batch), CSR_FORWARD,
                 [x, indptr, indices, values, _poisoned((batch, rows)), np.uint32(batch),
                  np.uint32(cols), np.uint32(rows)], [4],
                 (-(-batch * rows // group) * group,), (group,),
                 lambda out: mismatch(out[0], want, _sum_atol(indptr)))


def _sum_atol(indptr: np.ndarray) -> float:
    """The absolute tolerance of float32 sums over CSR rows of unit-scale terms."""
    return 1e-4 * max(1, int(np.diff(indptr).max(initial=0))) ** 0.5


def _sparse_size(rows: int, cols: int, density: float, batch: int) -> str:
    return f"{rows}x{cols} {100 * density:g}% b{batch}"


# ---------------------------------------------------------------------------------------
# The project's shaders, through their ops (emulator only)


@contextlib.contextmanager
def _package_kernels(sanitized: bool):
    """The package's own kernels run sanitized or not (``TSM_SANITIZE``) inside the block."""
    previous = os.environ.get("TSM_SANITIZE")
    os.environ["TSM_SANITIZE"] = "1" if sanitized else "0"
    try:
        if sanitize_by_default() != sanitized:  # inside emulator.instrumented()
            raise RuntimeError("the emulator benchmark cannot run the package's kernels "
                               "unsanitized inside emulator.instrumented()")
        with _backend.use_backend("emulator"):
            yield
    finally:
        if previous is None:
            os.environ.pop("TSM_SANITIZE", None)
        else:
            os.environ["TSM_SANITIZE"] = previous


def _op_case(kernel: str, size: str, op: Callable[[], Sequence[torch.Tensor]],
             check: Callable[[Sequence[np.ndarray]], Optional[str]]) -> Case:
    """A case for ``op``: a call of the package's ops returning the tensors to check."""
    def emulator(sanitize: bool) -> Impl:
        last: List[Sequence[torch.Tensor]] = []

        def run() -> None:
            with _package_kernels(sanitize):
                last[:] = [op()]

        return Impl(run, lambda: [t.detach().numpy().copy() for t in last[0]])
    return Case(kernel, size, emulator, check)


def mm_case(rung: str, n: int) -> Case:
    """``tsm.mm`` with the rung pinned, n x n float32."""
    g = torch.Generator().manual_seed(n)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    want = a.double().numpy() @ b.double().numpy()
    tol = 1e-4 * n ** 0.5
    return _op_case(f"tsm.mm[{rung}]", f"{n}^3", lambda: [mmops.mm(a, b, kernel=rung)],
                    lambda out: mismatch(out[0], want, tol, rtol=tol))


def _sparse_layer(rows: int, cols: int, density: float, batch: int, rng: np.random.Generator):
    """A layer's pattern, its CSR arrays, an input and a bias."""
    indptr, indices, values = random_csr(rows, cols, density, rng)
    x = rng.standard_normal((batch, cols), dtype=np.float32)
    bias = rng.standard_normal(rows, dtype=np.float32)
    pattern = CSRPattern(torch.from_numpy(indptr), torch.from_numpy(indices), cols)
    return pattern, indptr, indices, values, x, bias


def sparse_linear_forward_case(rows: int, cols: int, density: float, batch: int) -> Case:
    """``sparse_linear`` forward (one dispatch): ``x @ W.T + bias``."""
    rng = np.random.default_rng(rows * cols + batch)
    pattern, indptr, indices, values, x, bias = _sparse_layer(rows, cols, density, batch, rng)
    want = csr_product(indptr, indices, values, x) + bias
    xt, vt, bt = (torch.from_numpy(t) for t in (x, values, bias))

    def op() -> List[torch.Tensor]:
        with torch.no_grad():
            return [sparse_linear_pattern(xt, pattern, vt, bt)]
    return _op_case("sparse_linear_forward", _sparse_size(rows, cols, density, batch), op,
                    lambda out: mismatch(out[0], want, _sum_atol(indptr)))


def sparse_linear_backward_case(rows: int, cols: int, density: float, batch: int) -> Case:
    """``sparse_linear`` backward (one dispatch): the gradients of input, values and bias,
    through autograd on a graph kept from one forward."""
    rng = np.random.default_rng(rows * cols + batch)
    pattern, indptr, indices, values, x, bias = _sparse_layer(rows, cols, density, batch, rng)
    grad = rng.standard_normal((batch, rows), dtype=np.float32)
    # grad_input = grad @ W: a product with W's transpose, the CSR sorted by column.
    order = np.argsort(indices, kind="stable")
    t_indptr = np.searchsorted(indices[order], np.arange(cols + 1))
    row_ids = np.repeat(np.arange(rows), np.diff(indptr))
    want_input = csr_product(t_indptr, row_ids[order], values[order], grad)
    want_values = np.einsum("be,be->e", grad.astype(np.float64)[:, row_ids],
                            x.astype(np.float64)[:, indices])
    want_bias = grad.astype(np.float64).sum(axis=0)
    xt, vt, bt = (torch.from_numpy(t).requires_grad_() for t in (x, values, bias))
    gt = torch.from_numpy(grad)
    with _package_kernels(False):
        y = sparse_linear_pattern(xt, pattern, vt, bt)

    def op() -> Sequence[torch.Tensor]:
        return torch.autograd.grad(y, (xt, vt, bt), gt, retain_graph=True)

    def check(out: Sequence[np.ndarray]) -> Optional[str]:
        over_batch = 1e-4 * batch ** 0.5
        return _all_right(mismatch(out[0], want_input, _sum_atol(t_indptr)),
                          mismatch(out[1], want_values, over_batch),
                          mismatch(out[2], want_bias, over_batch))
    return _op_case("sparse_linear_backward", _sparse_size(rows, cols, density, batch), op, check)


def kmeans_iteration_case(n: int, d: int, k: int) -> Case:
    """One Lloyd iteration as ``tsm.KMeans.fit`` runs it (6 dispatches): distances through
    the GEMM and assignment, accumulation (zero + atomic sums), finalize, drift and norms."""
    x = make_data(n, d, k)
    centers = x[torch.randperm(n, generator=torch.Generator().manual_seed(1))[:k]].clone()
    xd, cd = x.double().numpy(), centers.double().numpy()
    with _package_kernels(False):
        x_sq, c_sq = K.sq_norms(x), K.sq_norms(centers)
    dist = np.stack([((xd - c) ** 2).sum(axis=1) for c in cd], axis=1)
    best = dist.min(axis=1)
    scale = 1e-4 * (xd ** 2).sum(axis=1) + 1e-4 * (cd ** 2).sum(axis=1).max()

    def op() -> List[torch.Tensor]:
        labels, min_dist = K.assign(x, centers, x_sq=x_sq, c_sq=c_sq)
        sums, counts = K.accumulate(x, labels, k)
        new = K.finalize(sums, counts, centers)
        shift, new_sq = K.drift_and_norms(centers, new)
        return [labels, min_dist, new, shift, new_sq]

    def check(out: Sequence[np.ndarray]) -> Optional[str]:
        labels, min_dist, new, shift, new_sq = out
        labels = labels.astype(np.int64)
        if labels.min() < 0 or labels.max() >= k:
            return f"labels outside [0, {k})"
        chosen = dist[np.arange(n), labels]
        # The kernels' float32 distances may break a near-tie the other way: a label is
        # right when its distance is the smallest up to that rounding.
        far = np.flatnonzero(chosen - best > scale)
        if far.size:
            i = far[0]
            return (f"{far.size} points not assigned to a nearest centroid, e.g. point {i}: "
                    f"label {labels[i]} at {chosen[i]:.7g}, nearest {best[i]:.7g}")
        counts = np.bincount(labels, minlength=k)
        sums = np.zeros((k, d))
        np.add.at(sums, labels, xd)
        want_new = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], cd)
        moved = ((want_new - cd) ** 2).sum(axis=1)
        return _all_right(mismatch(min_dist, chosen, scale.max()),
                          mismatch(new, want_new, 1e-4),
                          mismatch(shift, np.array([moved.max(), moved.sum()]), 1e-3),
                          mismatch(new_sq, (want_new ** 2).sum(axis=1), 1e-3))
    return _op_case("kmeans_iteration", f"n={n} d={d} k={k}", op, check)


# ---------------------------------------------------------------------------------------
# The default rows


MATMUL_SIZES = (128, 256, 512)
REDUCE_COUNT = 1 << 20
SPARSE = (4096, 4096, 0.01, 64)          # rows, cols, density, batch
MM_SIZES = (256, 512)
KMEANS = (20000, 32, 16)                 # n, d, k


def twin_cases(matmul_sizes: Sequence[int] = MATMUL_SIZES, sparse=SPARSE,
               reduce_count: int = REDUCE_COUNT) -> List[Case]:
    return ([tiled_matmul_case(n) for n in matmul_sizes] + [csr_forward_case(*sparse)]
            + [tree_reduce_case(reduce_count)])


def project_cases(mm_sizes: Sequence[int] = MM_SIZES, sparse=SPARSE, kmeans=KMEANS) -> List[Case]:
    return ([mm_case(rung, n) for n in mm_sizes for rung in mmops.KERNELS]
            + [sparse_linear_forward_case(*sparse), sparse_linear_backward_case(*sparse),
               kmeans_iteration_case(*kmeans)])


# ---------------------------------------------------------------------------------------
# Running


def _failure(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"error: {type(exc).__name__}" + (f": {lines[0]}" if lines else "")


def run_case(case: Case, pocl: Union[PoclDevice, str], repeats: int, sanitized_repeats: int,
             clock: Callable[[], float] = time.perf_counter) -> Dict[str, object]:
    """One row: statuses (``"ok"``, ``"wrong answer: ..."``, ``"error: ..."``, or why an
    implementation did not run) and the minimum ms of each implementation that ran right."""
    status: Dict[str, str] = {}
    makers: Dict[str, Callable[[], Impl]] = {"emulator": lambda: case.emulator(False)}
    if case.pocl is None:
        status["pocl"] = NO_TWIN
    elif isinstance(pocl, str):
        status["pocl"] = pocl
    else:
        makers["pocl"] = lambda: case.pocl(pocl)
    if sanitized_repeats > 0:
        makers["sanitized"] = lambda: case.emulator(True)
    else:
        status["sanitized"] = "not run"

    ready: Dict[str, Impl] = {}
    for name, make in makers.items():
        try:
            impl = make()
            impl.run()
            wrong = case.check(impl.result())
        except Exception as exc:  # noqa: BLE001 -- the row reports it; other rows still run
            status[name] = _failure(exc)
            continue
        status[name] = f"wrong answer: {wrong}" if wrong else "ok"
        if not wrong:
            ready[name] = impl

    best = {name: math.inf for name in ready}
    rounds = {name: sanitized_repeats if name == "sanitized" else repeats for name in ready}
    for round_ in range(max(rounds.values(), default=0)):
        for name, impl in list(ready.items()):
            if round_ >= rounds[name]:
                continue
            try:
                start = clock()
                impl.run()
                best[name] = min(best[name], clock() - start)
            except Exception as exc:  # noqa: BLE001
                status[name] = _failure(exc)
                del ready[name]

    ms = {name: 1e3 * best[name] if name in ready else None for name in IMPLEMENTATIONS}
    return {"kernel": case.kernel, "size": case.size,
            "emulator_ms": ms["emulator"], "pocl_ms": ms["pocl"],
            "ratio": _ratio(ms["emulator"], ms["pocl"]),
            "sanitized_ms": ms["sanitized"], "slowdown": _ratio(ms["sanitized"], ms["emulator"]),
            "ok": all(status[name] == "ok" for name in makers), **status}


def _ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return numerator / denominator if numerator is not None and denominator else None


def run(cases: Sequence[Case], repeats: int = 5, sanitized_repeats: int = 1,
        pocl: Union[PoclDevice, str, None] = None,
        progress: Optional[Callable[[str], None]] = None) -> Dict[str, object]:
    """Every case's row (:func:`run_case`), with PoCL from :func:`find_pocl` unless given."""
    if pocl is None:
        pocl = find_pocl(TWIN_PROGRAMS)
    rows = []
    for case in cases:
        if progress:
            progress(f"{case.kernel} {case.size}")
        rows.append(run_case(case, pocl, repeats, sanitized_repeats))
    return {"pocl": pocl if isinstance(pocl, str) else pocl.description,
            "pocl_available": not isinstance(pocl, str), "cpu_count": os.cpu_count(),
            "repeats": repeats, "sanitized_repeats": sanitized_repeats, "rows": rows}


# ---------------------------------------------------------------------------------------
# Output


_SHORT_STATUS = (("wrong answer", "WRONG"), ("error", "FAILED"), ("not installed", "not installed"),
                 ("unavailable", "unavailable"), (NO_TWIN, "emulator only"))


def _cell(ms: Optional[float], status: str) -> str:
    """A time, or what the table says instead."""
    if ms is not None:
        return f"{ms:.1f}" if ms < 1000 else f"{ms:,.0f}"
    return next((short for prefix, short in _SHORT_STATUS if status.startswith(prefix)), status)


def format_table(result: Dict[str, object]) -> str:
    rows: List[Dict[str, object]] = result["rows"]
    head = (f"{'kernel':<24}{'size':<24}{'emulator ms':>12}{'PoCL ms':>15}{'ratio':>8}"
            f"{'sanitized ms':>14}{'slowdown':>10}")
    lines = [f"PoCL: {result['pocl']}", head, "-" * len(head)]
    notes = []
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}"
        slowdown = "-" if r["slowdown"] is None else f"{r['slowdown']:.{int(r['slowdown'] < 10)}f}x"
        lines.append(f"{r['kernel']:<24}{r['size']:<24}{_cell(r['emulator_ms'], r['emulator']):>12}"
                     f"{_cell(r['pocl_ms'], r['pocl']):>15}{ratio:>8}"
                     f"{_cell(r['sanitized_ms'], r['sanitized']):>14}{slowdown:>10}")
        for name in IMPLEMENTATIONS:
            if r[name].startswith(("wrong answer", "error")):
                notes.append(f"{r['kernel']} {r['size']}, {name}: {r[name]}")
    lines.append(f"ms: wall time on this CPU ({result['cpu_count']} cores), minimum over "
                 f"{result['repeats']} interleaved rounds after a checked warm-up "
                 f"({result['sanitized_repeats']} for the sanitized build)")
    lines.append("ratio: emulator / PoCL; slowdown: sanitized / emulator")
    if notes:
        lines.append("FAILED rows:")
        lines.extend(f"  {n}" for n in notes)
    return "\n".join(lines)


def write_csv(result: Dict[str, object], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(result["rows"])


def main(args) -> Tuple[Dict[str, object], str]:
    """The result and its text table, for the CLI (``bench/__main__.py``)."""
    cases = twin_cases(args.matmul_sizes)
    if not args.twins_only:
        cases += project_cases(args.mm_sizes)
    result = run(cases, args.repeats, args.sanitized_repeats,
                 progress=lambda what: print(f"running {what}", file=sys.stderr, flush=True))
    if args.csv:
        write_csv(result, args.csv)
    return result, format_table(result)
