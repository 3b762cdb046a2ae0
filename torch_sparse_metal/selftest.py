"""``python -m torch_sparse_metal.selftest``: every kernel on this machine, against the reference.

On a Mac with the Metal extension it runs on the GPU (MPS tensors, backend "metal");
elsewhere on the Metal emulator (CPU tensors), so CI runs the very same code. It runs:

* every kernel the ops can launch, in every dtype this backend has, forward and backward,
  against the plain-torch reference computed in float64 from the same inputs, with a
  tolerance from the dtype's epsilon and the reduction length (the report gives the
  largest error of each check and its bound), and checks that every kernel ran;
* ``torch.autograd.gradcheck`` through the kernels, on the emulator (float64; Metal has no
  double, so on the GPU the gradients are compared with the float64 reference instead);
* a short training of the demo's sparse MLP (scikit-learn's digits when installed), with
  the host-device synchronisations of a steady-state step counted (expected: none);
* a small benchmark: sparse layer and dense product times (GPU ms on MPS; CPU times of the
  emulator elsewhere, which say nothing about a GPU).

The report (Markdown: chip, OS, torch, pass/fail per check, errors, times) goes to stdout
and to ``--output``: paste it into an issue. Exit status 0 when every check passed.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import _metal_backend
from ._kernel_catalog import kernels_by_shader
from ._version import __version__
from .emulator import record

Tensors = Sequence[Optional[torch.Tensor]]


@dataclass
class Check:
    name: str
    ok: bool
    error: float = 0.0     # the largest error, relative to the result's scale
    bound: float = 0.0
    seconds: float = 0.0
    detail: str = ""
    kernels: Tuple[str, ...] = ()   # what it launched, failed or not


@dataclass
class Machine:
    backend: str           # "metal" or "emulator"
    device: torch.device
    dtypes: Tuple[torch.dtype, ...]            # what the k-means kernels take
    dtypes_with_half: Tuple[torch.dtype, ...]  # the others' (matmul, sparse, loss, AdamW)

    def sync(self) -> None:
        if self.device.type == "mps":
            torch.mps.synchronize()


def machine() -> Machine:
    from ._validation import KERNEL_DTYPES, KERNEL_DTYPES_WITH_HALF
    if _metal_backend.is_available():
        with_half = KERNEL_DTYPES_WITH_HALF["metal"]
        if not _metal_backend.device_capabilities()["supports_bfloat"]:
            with_half = tuple(d for d in with_half if d != torch.bfloat16)
        return Machine("metal", torch.device("mps"), KERNEL_DTYPES["metal"], with_half)
    return Machine("emulator", torch.device("cpu"), KERNEL_DTYPES["emulator"],
                   KERNEL_DTYPES_WITH_HALF["emulator"])


def bound(dtype: torch.dtype, reduction: int) -> float:
    """What a kernel may be off by, relative to the result's scale: the output's rounding
    and a reduction of ``reduction`` terms accumulated in float32 (float64 for double)."""
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    return 4 * torch.finfo(dtype).eps + 8 * math.sqrt(reduction) * torch.finfo(accumulate).eps


def scaled_error(got: Tensors, want: Tensors) -> float:
    """max |got - want| / max(1, max |want|) over each pair, on the CPU in float64."""
    worst = 0.0
    for g, w in zip(got, want):
        if g is None and w is None:
            continue
        g, w = g.detach().double().cpu(), w.detach().double().cpu()
        scale = max(1.0, float(w.abs().max())) if w.numel() else 1.0
        worst = max(worst, float((g - w).abs().max()) / scale if w.numel() else 0.0)
    return worst


def leaves(m: Machine, dtype: torch.dtype, *tensors: torch.Tensor) -> List[torch.Tensor]:
    """``tensors`` (made on the CPU in float64) rounded to ``dtype`` on the machine's
    device, requiring grad."""
    return [t.to(dtype).to(m.device).requires_grad_() for t in tensors]


def reference_of(*tensors: torch.Tensor) -> List[torch.Tensor]:
    """The same values, on the CPU in float64, requiring grad: the reference's inputs."""
    return [t.detach().double().cpu().requires_grad_() for t in tensors]


def compare_with_grads(m: Machine, dtype: torch.dtype, reduction: int, inputs: List[torch.Tensor],
                       run: Callable, reference: Callable) -> Tuple[float, float]:
    """Run ``run(*inputs)`` on the machine and ``reference(*inputs in float64)``, then the
    gradients of the same weighted sum of each: the largest scaled error and its bound."""
    ref_inputs = reference_of(*inputs)
    out = run(*inputs)
    want = reference(*ref_inputs)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(7),
                          dtype=torch.float64)
    (out * weights.to(out.dtype).to(out.device)).sum().backward()
    (want * weights).sum().backward()
    m.sync()
    error = scaled_error([out] + [t.grad for t in inputs], [want] + [t.grad for t in ref_inputs])
    return error, bound(dtype, reduction)


# ---- the checks ----------------------------------------------------------------------------
def _sparse_linear(m: Machine, dtype: torch.dtype, batch: int, activation: Optional[str],
                   deterministic: bool) -> Tuple[float, float]:
    from . import sparse_linear
    from .nn.sparse_linear import random_csr_pattern
    from .reference import sparse_linear_reference
    g = torch.Generator().manual_seed(batch)
    out_f, in_f = 24, 40
    indptr, indices = random_csr_pattern(in_f, out_f, 0.3, generator=g)
    x, values, bias = (torch.randn(*s, generator=g, dtype=torch.float64)
                       for s in ((batch, in_f), (indices.numel(),), (out_f,)))
    fan_in = int((indptr[1:] - indptr[:-1]).max())
    pattern = [t.to(m.device) for t in (indptr, indices)]
    return compare_with_grads(
        m, dtype, max(fan_in, batch), leaves(m, dtype, x, values, bias),
        lambda x, v, b: sparse_linear(x, *pattern, v, b, activation=activation,
                                      deterministic=deterministic),
        lambda x, v, b: sparse_linear_reference(x, indptr, indices, v, b, activation=activation))


def _block_sparse_linear(m: Machine, dtype: torch.dtype, block: int,
                         kernel: str) -> Tuple[float, float]:
    """A 2-block-column layer of three block rows (one empty), batch 11 (a partial tile)."""
    from .ops.block_sparse_linear import block_sparse_linear, block_sparse_linear_reference
    g = torch.Generator().manual_seed(block)
    mask = torch.rand(3, 2, generator=g) < 0.7
    mask[1] = False
    crow = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)]).int()
    col = mask.nonzero()[:, 1].int()
    x, values, bias = (torch.randn(*s, generator=g, dtype=torch.float64)
                       for s in ((11, 2 * block), (col.numel(), block, block), (3 * block,)))
    pattern = [t.to(m.device) for t in (crow, col)]
    return compare_with_grads(
        m, dtype, 2 * block + 1, leaves(m, dtype, x, values, bias),
        lambda x, v, b: block_sparse_linear(x, *pattern, v, b, kernel=kernel),
        lambda x, v, b: block_sparse_linear_reference(x, crow, col, v, b))


def _matmul(m: Machine, dtype: torch.dtype, rung: str) -> Tuple[float, float]:
    """Each of the four transposes forward (a transposed view is read in place), and the
    gradients, which run the rung on flipped transposes."""
    from . import addmm, mm
    g = torch.Generator().manual_seed(1)
    worst = (0.0, bound(dtype, 70))
    for ta in (False, True):
        for tb in (False, True):
            a = torch.randn(70, 33, generator=g, dtype=torch.float64)
            b = torch.randn(33, 66, generator=g, dtype=torch.float64)
            a, b = (a.t().contiguous().t() if ta else a), (b.t().contiguous().t() if tb else b)
            error, _ = compare_with_grads(m, dtype, 70, leaves(m, dtype, a, b),
                                          lambda a, b: mm(a, b, kernel=rung),
                                          lambda a, b: a @ b)
            worst = (max(worst[0], error), worst[1])
    bias = torch.randn(66, generator=g, dtype=torch.float64)
    a, b = torch.randn(20, 33, generator=g, dtype=torch.float64), torch.randn(33, 66, generator=g,
                                                                             dtype=torch.float64)
    error, _ = compare_with_grads(
        m, dtype, 70, leaves(m, dtype, bias, a, b),
        lambda bias, a, b: addmm(bias, a, b, alpha=0.5, activation="gelu", kernel=rung),
        lambda bias, a, b: torch.nn.functional.gelu(torch.addmm(bias, a, b, alpha=0.5),
                                                    approximate="tanh"))
    return max(worst[0], error), worst[1]


def _cross_entropy(m: Machine, dtype: torch.dtype) -> Tuple[float, float]:
    from .nn.functional import cross_entropy
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(50, 7, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 7, (50,), generator=g)
    labels[3] = -100
    return compare_with_grads(
        m, dtype, 50, leaves(m, dtype, logits),
        lambda x: cross_entropy(x, labels.to(m.device)).reshape(1),
        lambda x: torch.nn.functional.cross_entropy(x, labels).reshape(1))


def _adamw(m: Machine, dtype: torch.dtype) -> Tuple[float, float]:
    """Three steps of tsm.optim.AdamW against torch.optim.AdamW in float64 from the same
    parameters and gradients (amsgrad in one group, maximize in the other)."""
    from .optim import AdamW
    g = torch.Generator().manual_seed(3)
    shapes = ((40,), (7, 5), (1,))
    start = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
    mine = [torch.nn.Parameter(p.to(dtype).to(m.device)) for p in start]
    ref = [torch.nn.Parameter(p.to(dtype).double()) for p in start]
    groups = lambda ps: [{"params": ps[:2], "amsgrad": True}, {"params": ps[2:], "maximize": True}]
    opt, ref_opt = AdamW(groups(mine), lr=0.05), torch.optim.AdamW(groups(ref), lr=0.05)
    for _ in range(3):
        for p, q in zip(mine, ref):
            grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.grad, q.grad = grad.to(dtype).to(m.device), grad.to(dtype).double()
        opt.step()
        ref_opt.step()
    m.sync()
    return scaled_error(mine, ref), 16 * torch.finfo(dtype).eps


def _kmeans(m: Machine, dtype: torch.dtype) -> Tuple[float, float]:
    """Every k-means step on the machine against the reference backend from the same
    inputs: distances, assignment, the three accumulations, finalize, drift, assign_one,
    k-means++'s update and partial_fit's update of the clusters a batch touched."""
    from .ops import kmeans as K
    g = torch.Generator().manual_seed(4)
    x64 = torch.randn(300, 6, generator=g, dtype=torch.float64)
    c64 = x64[:5].clone() + 0.1
    x, c = x64.to(dtype).to(m.device), c64.to(dtype).to(m.device)
    xr, cr = x.double().cpu(), c.double().cpu()
    results: List[Tuple[Tensors, Tensors]] = []

    def both(fn, mine, ref):
        results.append((fn(*mine, backend=m.backend), fn(*ref, backend="reference")))

    both(lambda a, **kw: (K.sq_norms(a, **kw),), (x,), (xr,))
    labels, _ = K.assign(x, c, backend=m.backend)
    both(lambda a, b, **kw: K.assign(a, b, **kw)[1:], (x, c), (xr, cr))
    modes = ("atomic", "deterministic") + (("cas",) if dtype == torch.float32 else ())
    for mode in modes:
        results.append((K.accumulate(x, labels, 5, mode=mode, backend=m.backend),
                        K.accumulate(xr, labels.cpu(), 5, mode=mode, backend="reference")))
    sums, counts = K.accumulate(x, labels, 5, backend=m.backend)
    sums_r, counts_r = sums.double().cpu(), counts.cpu()
    both(lambda s, n, o, **kw: (K.finalize(s, n, o, **kw),), (sums, counts, c),
         (sums_r, counts_r, cr))
    both(lambda o, n, **kw: K.drift_and_norms(o, n, **kw), (c, c * 1.5), (cr, cr * 1.5))
    both(lambda p, cc, **kw: K.assign_one(p, cc, **kw)[1:], (x[7], c), (xr[7], cr))
    inf = torch.full((300,), math.inf, dtype=torch.float64)
    both(lambda a, ch, d, **kw: (K.pp_update(a, ch, d, **kw),), (x, c[0], inf.to(dtype).to(m.device)),
         (xr, cr[0], inf))
    both(lambda cc, n, s, bn, **kw: K.update_affected(cc, n, s, bn, **kw),
         (c, counts, sums, counts), (cr, counts_r, sums_r, counts_r))
    m.sync()
    error = max(scaled_error(got, want) for got, want in results)
    return error, bound(dtype, 300)


def _gradcheck(m: Machine) -> Tuple[float, float]:
    """torch.autograd.gradcheck through the kernels: float64, so the emulator only."""
    from . import mm, sparse_linear
    from .nn.functional import cross_entropy
    g = torch.Generator().manual_seed(5)
    opts = dict(dtype=torch.float64, requires_grad=True)
    indptr, indices = torch.tensor([0, 2, 2, 5]), torch.tensor([0, 3, 1, 2, 0])
    for batch in (2, 4):
        x, v, b = (torch.randn(*s, generator=g, **opts) for s in ((batch, 4), (5,), (3,)))
        for deterministic in (False, True):
            assert torch.autograd.gradcheck(
                lambda x, v, b: sparse_linear(x, indptr, indices, v, b, activation="tanh",
                                              deterministic=deterministic), (x, v, b))
    a, b = torch.randn(5, 4, generator=g, **opts), torch.randn(4, 3, generator=g, **opts)
    assert torch.autograd.gradcheck(mm, (a, b))
    logits = torch.randn(6, 4, generator=g, **opts)
    assert torch.autograd.gradcheck(lambda z: cross_entropy(z, torch.tensor([0, 3, 1, 2, 2, 1])),
                                    (logits,))
    return 0.0, 0.0


def checks(m: Machine, quick: bool) -> Iterator[Tuple[str, Callable[[], Tuple[float, float]]]]:
    from .ops.matmul import RUNGS, capabilities
    from .ops.sparse_linear import lanes_along_batch
    simdgroup = capabilities(m.backend)["supports_simdgroup_matrix"]
    for dtype in m.dtypes_with_half:
        name = str(dtype).replace("torch.", "")
        for batch, deterministic, activation in ((1, False, "relu"), (40, False, "gelu"),
                                                 (5, True, "tanh"), (3, False, None)):
            family = "deterministic" if deterministic else \
                "batch lanes" if lanes_along_batch(batch) else "lane per element"
            yield (f"sparse_linear {name} {family} batch {batch} {activation}",
                   lambda d=dtype, b=batch, a=activation, det=deterministic:
                   _sparse_linear(m, d, b, a, det))
        for block in (8, 16, 32):
            for kernel in ("simdgroup", "shuffle") if simdgroup else ("shuffle",):
                yield (f"block_sparse_linear {name} {kernel} block {block}",
                       lambda d=dtype, b=block, k=kernel: _block_sparse_linear(m, d, b, k))
        yield f"cross_entropy {name}", lambda d=dtype: _cross_entropy(m, d)
        yield f"AdamW {name}", lambda d=dtype: _adamw(m, d)
    for dtype in m.dtypes:
        yield f"k-means {str(dtype).replace('torch.', '')}", lambda d=dtype: _kmeans(m, d)
    for dtype in m.dtypes_with_half:
        for rung in RUNGS.values():
            if rung.needs_simdgroup_matrix and not simdgroup:
                continue
            yield (f"mm/addmm {str(dtype).replace('torch.', '')} {rung.name}",
                   lambda d=dtype, r=rung.name: _matmul(m, d, r))
    if m.backend == "emulator":
        yield "gradcheck float64 (sparse_linear, mm, cross_entropy)", lambda: _gradcheck(m)


def run_checks(m: Machine, quick: bool) -> List[Check]:
    """Every check, each with the kernels it launched."""
    results = []
    for name, fn in checks(m, quick):
        start = time.perf_counter()
        with record() as launches:
            try:
                error, limit = fn()
                check = Check(name, error <= limit, error, limit)
            except Exception as exc:  # noqa: BLE001 -- a failing kernel is a finding to report
                check = Check(name, False, math.nan, math.nan,
                              detail=f"{type(exc).__name__}: {exc}".splitlines()[0])
                if "--traceback" in sys.argv:
                    traceback.print_exc()
        check.seconds = time.perf_counter() - start
        check.kernels = tuple(dict.fromkeys(l.kernel for l in launches))
        results.append(check)
    return results


def per_kernel(results: Sequence[Check], expected: Dict[str, Tuple[str, ...]]
               ) -> Dict[str, Dict[str, List[str]]]:
    """shader -> {"pass": kernels, "FAIL": kernels, "not run": kernels}: a kernel passes
    when every check that launched it passed."""
    verdicts: Dict[str, bool] = {}
    for check in results:
        for kernel in check.kernels:
            verdicts[kernel] = verdicts.get(kernel, True) and check.ok
    table = {}
    for shader, names in expected.items():
        rows: Dict[str, List[str]] = {"pass": [], "FAIL": [], "not run": []}
        for name in names:
            rows["not run" if name not in verdicts else "pass" if verdicts[name] else "FAIL"
                 ].append(name)
        table[shader] = rows
    return table


# ---- training, synchronisations, benchmark -------------------------------------------------
def training(m: Machine, quick: bool) -> Dict[str, object]:
    """The demo's model (64-256-128-10 at 10%, relu, SET every 50 steps) for a few epochs,
    on scikit-learn's digits if installed (random data otherwise, accuracy meaningless)."""
    from . import check_errors, syncs
    from .nn import SparseLinear, prune_and_regrow
    from .nn.functional import cross_entropy
    from .optim import AdamW
    try:
        from sklearn.datasets import load_digits
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16
        y = torch.tensor(digits.target)
        data = "scikit-learn digits"
    except ImportError:
        g = torch.Generator().manual_seed(0)
        x, y = torch.rand(1797, 64, generator=g), torch.randint(0, 10, (1797,), generator=g)
        data = "random data (scikit-learn not installed)"
    x, y = x.to(m.device), y.to(m.device)
    split = 1347
    g = torch.Generator().manual_seed(0)
    widths = (64, 256, 128, 10)
    model = torch.nn.Sequential(*[
        SparseLinear(a, b, density=0.1, generator=g, activation="relu" if i < 2 else None)
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]).to(m.device)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=1e-4)
    epochs = 3 if quick else 20
    step, step_syncs = 0, []
    start = time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(split, generator=g).to(m.device)
        for batch in order.split(64):
            with syncs.watch() as watched:
                opt.zero_grad()
                cross_entropy(model(x[batch]), y[batch]).backward()
                opt.step()
            if step >= 2:   # the first steps build the optimizer's state
                step_syncs.append(len(watched.events))
            step += 1
            if step % 50 == 0:
                for layer in model:
                    prune_and_regrow(layer, 0.1, optimizer=opt)
        check_errors()
    m.sync()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        accuracy = float((model(x[split:]).argmax(1) == y[split:]).float().mean())
    return {"data": data, "epochs": epochs, "steps": step, "seconds": seconds,
            "test accuracy": accuracy, "syncs per step": max(step_syncs, default=0)}


def _timed(m: Machine, fn: Callable[[], object], repeat: int) -> float:
    fn()
    m.sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    m.sync()
    return (time.perf_counter() - start) / repeat * 1e3


def benchmark(m: Machine, quick: bool) -> List[Tuple[str, float, Optional[float]]]:
    """(what, ms of ours, ms of torch's own where it has one)."""
    from . import mm
    from .nn import SparseLinear
    small = quick or m.backend == "emulator"
    n, batch, size = (512, 32, 128) if small else (4096, 64, 1024)
    repeat = 3 if small else 20
    g = torch.Generator().manual_seed(0)
    layer = SparseLinear(n, n, density=0.01, generator=g).to(m.device)
    x = torch.randn(batch, n, generator=g).to(m.device).requires_grad_()
    rows = [(f"SparseLinear {n}x{n} 1% batch {batch}, forward + backward",
             _timed(m, lambda: layer(x).sum().backward(), repeat), None)]
    a, b = (torch.randn(size, size, generator=g).to(m.device) for _ in range(2))
    rows.append((f"mm {size}^3 float32 (against torch.mm)", _timed(m, lambda: mm(a, b), repeat),
                 _timed(m, lambda: torch.mm(a, b), repeat)))
    return rows


# ---- the report ----------------------------------------------------------------------------
def environment(m: Machine) -> Dict[str, str]:
    env = {"torch_sparse_metal": __version__, "torch": torch.__version__,
           "Python": platform.python_version(), "OS": platform.platform(),
           "backend": f"{m.backend} ({m.device})"}
    if m.backend == "metal":
        caps = _metal_backend.device_capabilities()
        env["chip"] = str(caps.get("name"))
        env["macOS"] = platform.mac_ver()[0]
        env["Metal language"] = str(caps.get("metal_language_version"))
    else:
        env["chip"] = f"none: the Metal emulator on the CPU ({platform.machine()})"
    return env


def format_report(env, results: List[Check], kernels: Dict[str, Dict[str, List[str]]], train,
                  bench) -> str:
    passed = sum(c.ok for c in results)
    lines = ["# torch_sparse_metal selftest", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", f"## Kernels against the float64 reference: {passed} of {len(results)} passed",
              "", "| check | result | largest error | bound | time |", "| --- | --- | --- | --- | --- |"]
    for c in results:
        lines.append(f"| {c.name} | {'pass' if c.ok else 'FAIL'} | {c.error:.2e} | {c.bound:.2e} "
                     f"| {c.seconds:.2f} s |" + (f" {c.detail}" if c.detail else ""))
    lines += ["", "## Per kernel (a kernel passes when every check that launched it passed)", "",
              "| shader | kernels | pass | FAIL | not run |", "| --- | --- | --- | --- | --- |"]
    for shader, rows in kernels.items():
        lines.append(f"| {shader} | {sum(map(len, rows.values()))} | {len(rows['pass'])} | "
                     f"{', '.join(rows['FAIL']) or 0} | {', '.join(rows['not run']) or 0} |")
    missing = [k for rows in kernels.values() for k in rows["not run"]]
    lines += ["", "Every kernel ran." if not missing else
              f"Kernels no check ran ({len(missing)}): {', '.join(missing)}"]
    lines += ["", "## Training (the demo's sparse MLP)", ""]
    lines += [f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in train.items()]
    where = "GPU" if env["backend"].startswith("metal") else "CPU time of the emulator, not a GPU figure"
    lines += ["", f"## Benchmark ({where})", "", "| what | ms | torch's own, ms |", "| --- | --- | --- |"]
    lines += [f"| {what} | {ours:.3f} | {'-' if theirs is None else f'{theirs:.3f}'} |"
              for what, ours, theirs in bench]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_sparse_metal.selftest",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a short training and a small benchmark (what CI runs)")
    parser.add_argument("--output", type=Path, default=Path("tsm-selftest-report.md"),
                        help="where to write the report (default: %(default)s)")
    parser.add_argument("--traceback", action="store_true", help="print each failure's traceback")
    args = parser.parse_args(argv)
    m = machine()
    print(f"torch_sparse_metal selftest on {m.backend} ({m.device}); the first run compiles "
          "every shader library", flush=True)
    with _backend_for(m):
        results = run_checks(m, args.quick)
        kernels = per_kernel(results, kernels_by_shader(m.backend))
        try:
            train = training(m, args.quick)
        except Exception as exc:  # noqa: BLE001
            train = {"failed": f"{type(exc).__name__}: {exc}"}
        bench = benchmark(m, args.quick)
    text = format_report(environment(m), results, kernels, train, bench)
    print(text)
    args.output.write_text(text)
    print(f"report written to {args.output.resolve()}")
    ok = all(c.ok for c in results) and "failed" not in train \
        and not any(rows["not run"] or rows["FAIL"] for rows in kernels.values()) \
        and train.get("syncs per step") == 0
    return 0 if ok else 1


@contextlib.contextmanager
def _backend_for(m: Machine):
    from ._backend import use_backend
    with use_backend(m.backend):
        yield


if __name__ == "__main__":
    sys.exit(main())
