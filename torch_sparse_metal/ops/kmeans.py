"""k-means steps on the GPU: host code of ``shaders/kmeans.metal``.

Each function is one role of the seed plan (distances, assign, accumulate, finalize, drift,
single-point assign, k-means++ update, partial_fit update) and follows the house order:
validate -> allocate -> return early on empty -> launch. ``backend=None`` resolves the
backend from the tensors (:func:`torch_sparse_metal._backend.resolve_backend`); the
estimator (:class:`torch_sparse_metal.KMeans`) resolves once per fit and passes it down.
``"reference"`` runs :mod:`torch_sparse_metal.reference.kmeans` (plain torch, any device).
On the kernel backends each function validates, then calls its op
(``torch.ops.torch_sparse_metal.kmeans_<role>``, see :mod:`torch_sparse_metal._custom_ops`;
not differentiable), whose kernel allocates and launches.

Conventions: ``x`` is ``(n, d)``, centroids ``(k, d)``, both contiguous floating tensors of
one dtype and one device; labels and counts are int32 tensors (the kernels read them as
``int`` / ``uint``). Every function checks these shapes, dtypes and devices before anything
runs (a ValueError naming the function): the kernels trust the sizes they are given, so a
mismatch would otherwise read past a buffer. No function modifies its arguments: every
result is a new tensor.

Accumulation modes (:func:`choose_accumulate_mode`):

* ``"atomic"``: threadgroup partial sums, then native ``atomic_float`` adds (Metal 3);
* ``"cas"``: the same, with the adds emulated by compare-and-swap on ``atomic_uint``
  (GPUs without Metal 3; float32 only);
* ``"deterministic"``: each threadgroup writes its partial sums to its own slots and a
  second kernel adds the slots in a fixed order: bit-identical results run to run.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch

from .. import _custom_ops
from .. import _launch
from .. import _validation as V
from .._backend import resolve_backend
from .._kernel_names import kernel_name, kernel_names_for, library_kernels
from ..reference import kmeans as R
from . import matmul as MM

OP = "kmeans"
SHADER = "kmeans.metal"
KERNELS = ("kmeans_sq_norms", "kmeans_assign", "kmeans_zero",
           "kmeans_accumulate_atomic", "kmeans_accumulate_blocks", "kmeans_reduce_blocks",
           "kmeans_finalize", "kmeans_drift", "kmeans_assign_one", "kmeans_pp_update",
           "kmeans_update_affected")
CAS_KERNEL = "kmeans_accumulate_cas"  # float32 only
ACCUMULATE_MODES = ("auto", "atomic", "cas", "deterministic")
ASSIGN_ADD_X_SQ, ASSIGN_STORE = 1, 2  # kmeans_assign's flags (KMEANS_ASSIGN_* in the shader)

GROUP_SIZE = 256          # 1-D kernels: 8 SIMD-groups, as the sparse layer
STAGE_GROUP_SIZE = 64     # kmeans_sq_norms, kmeans_assign: KMEANS_STAGE_GROUP (32-row tiles)
MAX_REDUCE_GROUP = 256    # kmeans_drift / kmeans_assign_one: one power-of-two threadgroup
MAX_THREADGROUP_MEMORY = 32 * 1024
POINTS_PER_THREAD = 32    # accumulate: points each thread adds before the group flushes
MAX_BLOCKS = 256          # accumulate: cap on point blocks (deterministic slots: blocks*k*d)


def kernel_names(backend: str = "emulator") -> Tuple[str, ...]:
    """Every kernel name the host code can ask ``backend`` for (tests check they exist)."""
    return kernel_names_for(KERNELS, backend) + (kernel_name(CAS_KERNEL, torch.float32),)


def kernels_for(dtype: torch.dtype) -> Tuple[Tuple[str, str], ...]:
    """``(shader, kernel name)`` of what k-means may launch for ``dtype``: its own kernels
    and the distance GEMM's."""
    return library_kernels(SHADER, KERNELS, dtype) + MM.kernels_for(None, dtype, "metal")


def _backend(backend: Optional[str], *tensors: torch.Tensor) -> str:
    if backend is not None:
        return backend
    return resolve_backend(OP, tensors, kernels=lambda: kernels_for(tensors[0].dtype))


def _check_kernel_inputs(backend: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.is_floating_point():
            V.check_kernel_dtype(OP, t.dtype, backend)
        if not t.is_contiguous():
            raise ValueError(f"{OP}: {name} must be contiguous")


def _check_features(op: str, x: torch.Tensor, centroids: torch.Tensor, *, x_name: str = "x",
                    c_name: str = "centroids", x_dim: int = 2) -> Tuple[int, int]:
    """``x`` (``x_dim``-D: ``(n, d)`` points, or ``(d,)`` for one point) and ``centroids``
    ``(k, d)`` are floating tensors of one dtype on one device, with the same number ``d``
    of features. Returns ``(k, d)``; raises ValueError naming ``kmeans.<op>``."""
    where = f"{OP}.{op}"
    V.check_tensor(where, x_name, x)
    V.check_tensor(where, c_name, centroids)
    V.check_dim(where, x_name, x, x_dim)
    V.check_dim(where, c_name, centroids, 2)
    V.check_floating(where, x_name, x)
    V.check_same_dtype(where, {x_name: x, c_name: centroids})
    V.check_same_device(where, {x_name: x, c_name: centroids})
    k, d = centroids.shape
    if x.shape[-1] != d:
        raise ValueError(f"{where}: {x_name} has {x.shape[-1]} features but {c_name} "
                         f"has {d}; they must match")
    return k, d


def _check_vector(op: str, name: str, t: Optional[torch.Tensor], length: int, what: str,
                  like: torch.Tensor, *, integer: bool = False) -> None:
    """``t`` (skipped when None) is 1-D with ``length`` elements on ``like``'s device:
    ``like``'s dtype, or an integer dtype (``integer``: labels, counts)."""
    if t is None:
        return
    where = f"{OP}.{op}"
    V.check_tensor(where, name, t)
    V.check_length(where, name, t, length, what)
    if integer:
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{where}: {name} must be an int32 tensor, got dtype {t.dtype}")
    elif t.dtype != like.dtype:
        raise ValueError(f"{where}: {name} has dtype {t.dtype} but the points have dtype "
                         f"{like.dtype}; they must match")
    if t.device != like.device:
        raise ValueError(f"{where}: {name} is on {t.device} but the points are on "
                         f"{like.device}; all tensors must be on one device")


def _check_int32_for_kernels(op: str, backend: str, **tensors: torch.Tensor) -> None:
    """The kernels read labels and counts as 32-bit ``int`` / ``uint``."""
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{OP}.{op}: {name} must be int32 for backend {backend!r}, got "
                             f"{t.dtype}")


def _round16(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16


def _pow2_at_least(n: int, cap: int) -> int:
    size = 1
    while size < min(n, cap):
        size *= 2
    return size


# ---------------------------------------------------------------------------------------
# Distances and assignment


def sq_norms(rows: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
    """``(n, d) -> (n,)`` squared row norms."""
    V.check_floating_tensor(f"{OP}.sq_norms", "rows", rows, 2)
    backend = _backend(backend, rows)
    if backend == "reference":
        return R.sq_norms_reference(rows)
    _check_kernel_inputs(backend, rows=rows)
    n, d = rows.shape
    V.check_fits_uint32(OP, "n * d", n * d)
    return _SQ_NORMS(rows)


def _sq_norms_kernel(rows: torch.Tensor, *, backend: str) -> torch.Tensor:
    n, d = rows.shape
    out = rows.new_empty(n)
    if n == 0:
        return out
    if d == 0:
        return out.zero_()
    _launch.launch(SHADER, kernel_name("kmeans_sq_norms", rows.dtype),
                   (rows, out, np.uint32(n), np.uint32(d)),
                   threads=-(-n // STAGE_GROUP_SIZE) * STAGE_GROUP_SIZE,  # whole groups
                   group_size=STAGE_GROUP_SIZE, backend=backend)
    return out


def _check_distance_inputs(op: str, x: torch.Tensor, centroids: torch.Tensor,
                           x_sq: Optional[torch.Tensor], c_sq: Optional[torch.Tensor]) -> None:
    k, _ = _check_features(op, x, centroids)
    _check_vector(op, "x_sq", x_sq, x.shape[0], "the number of points", x)
    _check_vector(op, "c_sq", c_sq, k, "the number of centroids", x)


def _gemm_partial_distances(op: str, x: torch.Tensor, centroids: torch.Tensor,
                            c_sq: torch.Tensor, backend: str) -> torch.Tensor:
    """``D' = -2 x @ c.T + ||c||^2`` ``(n, k)`` through the project's GEMM: one dispatch
    of whichever rung :func:`torch_sparse_metal.ops.matmul.choose_kernel` picks, ``c.T``
    read in place (a transposed view), ``c_sq`` a broadcast row bias. ``kmeans_assign``
    adds ``||x||^2`` and clamps at 0. ``x`` and ``centroids`` are validated and non-empty
    (``n, k >= 1``)."""
    if x.shape[1] == 0:
        return x.new_zeros(x.shape[0], centroids.shape[0])  # 0 features: all norms are 0
    out, _ = MM.launch_matmul(x, centroids.t(), c_sq, alpha=-2.0, beta=1.0, backend=backend,
                              op=f"{OP}.{op}")
    return out


def _launch_assign(dist: torch.Tensor, x_sq: Optional[torch.Tensor], flags: int,
                   backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kmeans_assign`` over a non-empty ``(n, k)`` ``dist`` (``flags``: ASSIGN_*)."""
    n, k = dist.shape
    labels = torch.empty(n, dtype=torch.int32, device=dist.device)
    min_dist = dist.new_empty(n)
    x_sq = dist.new_empty(1) if x_sq is None else x_sq  # a placeholder the kernel never reads
    _launch.launch(SHADER, kernel_name("kmeans_assign", dist.dtype),
                   (dist, x_sq, labels, min_dist, np.uint32(n),
                    np.uint32(k), np.uint32(flags)),
                   threads=-(-n // STAGE_GROUP_SIZE) * STAGE_GROUP_SIZE,  # whole groups
                   group_size=STAGE_GROUP_SIZE, backend=backend)
    return labels, min_dist


def _check_kernel_distances(x: torch.Tensor, centroids: torch.Tensor,
                            x_sq: Optional[torch.Tensor], c_sq: Optional[torch.Tensor],
                            backend: str) -> None:
    """What the kernel path of :func:`distances` and :func:`assign` needs besides
    :func:`_check_distance_inputs`."""
    _check_kernel_inputs(backend, x=x, centroids=centroids)
    n, d = x.shape
    V.check_fits_uint32(OP, "n * d", n * d)
    V.check_fits_uint32(OP, "n * k", n * centroids.shape[0])
    _check_kernel_inputs(backend, **{name: t for name, t in (("x_sq", x_sq), ("c_sq", c_sq))
                                     if t is not None})


def _kernel_distances(op: str, x: torch.Tensor, centroids: torch.Tensor,
                      x_sq: Optional[torch.Tensor], c_sq: Optional[torch.Tensor], backend: str,
                      store: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels of :func:`distances` and :func:`assign`: ``(D or D', labels,
    min_dist)`` -- D (finished in place) with ``store``, else the GEMM's D'."""
    n = x.shape[0]
    k = centroids.shape[0]
    if n == 0:
        return (x.new_empty(n, k), torch.empty(0, dtype=torch.int32, device=x.device),
                x.new_empty(0))
    x_sq = _sq_norms_kernel(x, backend=backend) if x_sq is None else x_sq
    c_sq = _sq_norms_kernel(centroids, backend=backend) if c_sq is None else c_sq
    dist = _gemm_partial_distances(op, x, centroids, c_sq, backend)
    flags = ASSIGN_ADD_X_SQ | (ASSIGN_STORE if store else 0)
    labels, min_dist = _launch_assign(dist, x_sq, flags, backend)
    return dist, labels, min_dist


def distances(x: torch.Tensor, centroids: torch.Tensor, *, x_sq: Optional[torch.Tensor] = None,
              c_sq: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """``(n, k)`` squared Euclidean distances through ``||x||^2 - 2 x.c + ||c||^2`` (>= 0).

    ``x_sq`` / ``c_sq``: precomputed :func:`sq_norms` (the fit computes ``x_sq`` once).
    Kernels: the GEMM (``-2 x @ c.T + ||c||^2``), then ``kmeans_assign`` adds ``||x||^2``,
    clamps and writes the rows back (its labels are a by-product, dropped here).
    """
    _check_distance_inputs("distances", x, centroids, x_sq, c_sq)
    backend = _backend(backend, x, centroids)
    if backend == "reference":
        return R.distances_reference(x, centroids, x_sq, c_sq)
    if centroids.shape[0] == 0:
        _check_kernel_inputs(backend, x=x, centroids=centroids)
        return x.new_empty(x.shape[0], 0)
    _check_kernel_distances(x, centroids, x_sq, c_sq, backend)
    return _DISTANCES(x, centroids, x_sq, c_sq)


def _distances_kernel(x, centroids, x_sq, c_sq, *, backend):
    return _kernel_distances("distances", x, centroids, x_sq, c_sq, backend, store=True)[0]


def assign_from_distances(dist: torch.Tensor, *,
                          backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(n, k) -> (labels int32 (n,), min_dist (n,))``: argmin (lowest index on ties)."""
    V.check_floating_tensor(f"{OP}.assign_from_distances", "dist", dist, 2)
    backend = _backend(backend, dist)
    if backend == "reference":
        return R.assign_reference(dist)
    _check_kernel_inputs(backend, dist=dist)
    n, k = dist.shape
    if k == 0:
        raise ValueError(f"{OP}: cannot assign points to 0 clusters")
    return _ASSIGN_FROM_DISTANCES(dist)


def _assign_from_distances_kernel(dist, *, backend):
    if dist.shape[0] == 0:
        return torch.empty(0, dtype=torch.int32, device=dist.device), dist.new_empty(0)
    return _launch_assign(dist, None, 0, backend)  # no flags: dist is only read


def assign(x: torch.Tensor, centroids: torch.Tensor, *, x_sq: Optional[torch.Tensor] = None,
           c_sq: Optional[torch.Tensor] = None,
           backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid of each point: ``(labels int32 (n,), squared distance (n,))``.

    Kernels: ``||c||^2`` (unless ``c_sq`` is given; ``||x||^2`` unless ``x_sq`` is), the GEMM,
    and ``kmeans_assign`` finishing the distances as it scans them: D is never completed
    in memory.
    """
    _check_distance_inputs("assign", x, centroids, x_sq, c_sq)
    backend = _backend(backend, x, centroids)
    if backend == "reference":
        dist = R.distances_reference(x, centroids, x_sq, c_sq)
        return R.assign_reference(dist)
    if centroids.shape[0] == 0:
        raise ValueError(f"{OP}: cannot assign points to 0 clusters")
    _check_kernel_distances(x, centroids, x_sq, c_sq, backend)
    return _ASSIGN(x, centroids, x_sq, c_sq)


def _assign_kernel(x, centroids, x_sq, c_sq, *, backend):
    _, labels, min_dist = _kernel_distances("assign", x, centroids, x_sq, c_sq, backend,
                                            store=False)
    return labels, min_dist


# ---------------------------------------------------------------------------------------
# Accumulation


def choose_accumulate_mode(requested: str, backend: str, dtype: torch.dtype) -> str:
    """The accumulate kernel to run: ``"atomic"``, ``"cas"`` or ``"deterministic"``.

    ``"auto"`` takes ``"deterministic"`` under ``torch.use_deterministic_algorithms(True)``,
    else native float atomics where the GPU has them (Metal 3, as probed by
    :func:`torch_sparse_metal._metal_backend.device_capabilities`, which
    ``TSM_FORCE_NO_ATOMIC_FLOAT=1`` overrides) and the CAS emulation otherwise; on the
    emulator, which has both, ``"atomic"``. The reference backend is deterministic and
    ignores the choice.
    """
    if requested not in ACCUMULATE_MODES:
        raise ValueError(f"{OP}: accumulate mode must be one of {ACCUMULATE_MODES}, "
                         f"got {requested!r}")
    if backend == "reference":
        return "deterministic"
    if requested == "auto" and torch.are_deterministic_algorithms_enabled():
        requested = "deterministic"
    if requested == "deterministic":
        return requested
    if requested == "cas" and dtype != torch.float32:
        raise ValueError(f"{OP}: the compare-and-swap accumulation is float32 only "
                         f"(a 32-bit atomic holds the bits), got {dtype}")
    if backend == "metal":
        from .._metal_backend import device_capabilities
        has_float_atomics = bool(device_capabilities()["supports_metal3"])
        if requested == "auto":
            return "atomic" if has_float_atomics else "cas"
        if requested == "atomic" and not has_float_atomics:
            raise ValueError(f"{OP}: accumulate mode 'atomic' needs atomic_float (Metal 3); "
                             "this GPU has none: use 'auto' or 'cas'")
        return requested
    return "atomic" if requested == "auto" else requested


class AccumulateShape(NamedTuple):
    """Launch shape of the accumulate kernels (see ``kmeans_accumulate_block`` in the shader).

    Threadgroups of ``(tf, tp)`` threads: ``tf`` features by ``tp`` rows of points; each
    covers ``block`` points; ``tiles`` feature tiles by ``blocks`` point blocks.
    """
    tf: int
    tp: int
    block: int
    tiles: int
    blocks: int
    threadgroup_memory: Tuple[int, int]


def accumulate_shape(n: int, k: int, d: int, itemsize: int, *, op: str = OP) -> AccumulateShape:
    """Pick the widest feature tile (<= 32) and the most point rows (<= 256 threads in all)
    whose partial sums ``tp * k * tf`` and counts ``tp * k`` fit in 32 KB of threadgroup
    memory. Raises when even one thread's ``k`` sums do not fit (k > ~4000)."""
    tf = _pow2_at_least(d, 32)
    while True:
        for tp in range(GROUP_SIZE // tf, 0, -1):
            mem = (_round16(tp * k * tf * itemsize), _round16(tp * k * 4))
            if sum(mem) <= MAX_THREADGROUP_MEMORY:
                break
        else:
            if tf == 1:
                raise ValueError(f"{op}: n_clusters = {k} is too many for the kernels' "
                                 "threadgroup partial sums (32 KB); use backend 'reference'")
            tf //= 2
            continue
        break
    # Blocks of POINTS_PER_THREAD points per thread row, but never more than MAX_BLOCKS
    # blocks (the deterministic mode keeps blocks * k * d partial sums).
    block = max(tp * POINTS_PER_THREAD, -(-n // MAX_BLOCKS))
    block = -(-block // tp) * tp
    blocks = max(1, -(-n // block))
    tiles = -(-d // tf)
    return AccumulateShape(tf, tp, block, tiles, blocks, mem)


def check_fit_limits(op: str, n: int, k: int, d: int, dtype: torch.dtype, backend: str) -> None:
    """Every size limit the kernels of a k-means fit (``k`` clusters, ``n`` points of ``d``
    features) meet, checked before any work: each step checks its own again when it runs,
    but a fit should not seed for minutes and then fail. ``op`` starts the message."""
    if backend == "reference":
        return
    for what, size in (("n * d", n * d), ("n * k", n * k), ("k * d", k * d)):
        V.check_fits_uint32(op, what, size)
    shape = accumulate_shape(n, k, d, torch.empty((), dtype=dtype).element_size(), op=op)
    V.check_fits_uint32(op, "blocks * k * d", shape.blocks * k * d)


def accumulate(x: torch.Tensor, labels: torch.Tensor, k: int, *, mode: str = "auto",
               backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-cluster sums ``(k, d)`` and counts ``(k,)`` int32 of ``x`` grouped by ``labels``.

    ``labels`` int32 in ``[0, k)`` (a label outside is skipped by the kernels).
    """
    V.check_floating_tensor(f"{OP}.accumulate", "x", x, 2)
    _check_vector("accumulate", "labels", labels, x.shape[0], "the number of points", x,
                  integer=True)
    k = V.check_int(f"{OP}.accumulate", "k", k, minimum=0)
    backend = _backend(backend, x, labels)
    if backend == "reference":
        return R.accumulate_reference(x, labels, k)
    mode = choose_accumulate_mode(mode, backend, x.dtype)
    _check_kernel_inputs(backend, x=x, labels=labels)
    _check_int32_for_kernels("accumulate", backend, labels=labels)
    n, d = x.shape
    shape = accumulate_shape(n, k, d, x.element_size())
    V.check_fits_uint32(OP, "n * d", n * d)
    V.check_fits_uint32(OP, "blocks * k * d", shape.blocks * k * d)
    return _ACCUMULATE(x, labels, k, mode)


def _accumulate_kernel(x, labels, k, mode, *, backend):
    n, d = x.shape
    shape = accumulate_shape(n, k, d, x.element_size())
    counts = torch.empty(k, dtype=torch.int32, device=x.device)
    sums = x.new_empty(k, d)
    if k == 0 or d == 0:
        return sums, counts.zero_()
    grid = (shape.tiles * shape.tf, shape.blocks * shape.tp)
    group = (shape.tf, shape.tp)
    scalars = (np.uint32(n), np.uint32(k), np.uint32(d), np.uint32(shape.block))
    if mode == "deterministic":
        block_sums = x.new_empty(shape.blocks, k, d)
        block_counts = torch.empty(shape.blocks, k, dtype=torch.int32, device=x.device)
        if n == 0:
            return sums.zero_(), counts.zero_()
        _launch.launch(SHADER, kernel_name("kmeans_accumulate_blocks", x.dtype),
                       (x, labels, block_sums, block_counts) + scalars,
                       threads=grid, group_size=group,
                       threadgroup_memory=shape.threadgroup_memory, backend=backend)
        _launch.launch(SHADER, kernel_name("kmeans_reduce_blocks", x.dtype),
                       (block_sums, block_counts, sums, counts, np.uint32(shape.blocks),
                        np.uint32(k), np.uint32(d)),
                       threads=k * d, group_size=GROUP_SIZE, backend=backend)
        return sums, counts
    _launch.launch(SHADER, kernel_name("kmeans_zero", x.dtype),
                   (sums, counts, np.uint32(k), np.uint32(d)),
                   threads=k * d, group_size=GROUP_SIZE, backend=backend)
    if n == 0:
        return sums, counts
    base = "kmeans_accumulate_atomic" if mode == "atomic" else CAS_KERNEL
    _launch.launch(SHADER, kernel_name(base, x.dtype), (x, labels, sums, counts) + scalars,
                   threads=grid, group_size=group,
                   threadgroup_memory=shape.threadgroup_memory, backend=backend)
    return sums, counts


# ---------------------------------------------------------------------------------------
# Update, convergence, online steps


def _check_same_centroids(op: str, a: torch.Tensor, b: torch.Tensor, a_name: str,
                          b_name: str) -> None:
    """Two ``(k, d)`` centroid-shaped tensors: same features (:func:`_check_features`) and
    the same number of rows."""
    k, _ = _check_features(op, b, a, x_name=b_name, c_name=a_name)
    if b.shape[0] != k:
        raise ValueError(f"{OP}.{op}: {b_name} has {b.shape[0]} rows but {a_name} has {k}; "
                         "they must match")


def finalize(sums: torch.Tensor, counts: torch.Tensor, old_centroids: torch.Tensor, *,
             backend: Optional[str] = None) -> torch.Tensor:
    """New centroids ``sums / counts``; a cluster with count 0 keeps its old centroid."""
    _check_same_centroids("finalize", old_centroids, sums, "old_centroids", "sums")
    _check_vector("finalize", "counts", counts, sums.shape[0], "the number of centroids",
                  sums, integer=True)
    backend = _backend(backend, sums, old_centroids)
    if backend == "reference":
        return R.finalize_reference(sums, counts, old_centroids)
    _check_kernel_inputs(backend, sums=sums, counts=counts, old_centroids=old_centroids)
    _check_int32_for_kernels("finalize", backend, counts=counts)
    return _FINALIZE(sums, counts, old_centroids)


def _finalize_kernel(sums, counts, old_centroids, *, backend):
    k, d = sums.shape
    out = sums.new_empty(k, d)
    if k * d == 0:
        return out
    _launch.launch(SHADER, kernel_name("kmeans_finalize", sums.dtype),
                   (sums, counts, old_centroids, out, np.uint32(k), np.uint32(d)),
                   threads=k * d, group_size=GROUP_SIZE, backend=backend)
    return out


def drift(old: torch.Tensor, new: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
    """``[max, sum]`` over centroids of the squared shift ``||new_c - old_c||^2`` (2 values)."""
    return drift_and_norms(old, new, backend=backend)[0]


def drift_and_norms(old: torch.Tensor, new: torch.Tensor, *,
                    backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`drift` and ``sq_norms(new)`` ``(k,)`` from one dispatch: the Lloyd loop feeds
    the norms to the next iteration's :func:`assign` as ``c_sq``."""
    _check_same_centroids("drift", old, new, "old", "new")
    backend = _backend(backend, old, new)
    if backend == "reference":
        return R.drift_reference(old, new), R.sq_norms_reference(new)
    _check_kernel_inputs(backend, old=old, new=new)
    return _DRIFT_AND_NORMS(old, new)


def _drift_and_norms_kernel(old, new, *, backend):
    k, d = old.shape
    out = old.new_empty(2)
    new_sq = old.new_empty(k)
    if k == 0:
        return out.zero_(), new_sq
    size = _pow2_at_least(k, MAX_REDUCE_GROUP)
    _launch.launch(SHADER, kernel_name("kmeans_drift", old.dtype),
                   (old, new, out, new_sq, np.uint32(k), np.uint32(d)),
                   threads=size, group_size=size,
                   threadgroup_memory=(_round16(2 * size * old.element_size()),),
                   backend=backend)
    return out, new_sq


def assign_one(point: torch.Tensor, centroids: torch.Tensor, *,
               backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid of one point ``(d,)``: ``(label int32 (1,), distance (1,))``."""
    _check_features("assign_one", point, centroids, x_name="point", x_dim=1)
    backend = _backend(backend, point, centroids)
    if backend == "reference":
        return R.assign_one_reference(point, centroids)
    _check_kernel_inputs(backend, point=point, centroids=centroids)
    if centroids.shape[0] == 0:
        raise ValueError(f"{OP}: cannot assign a point to 0 clusters")
    return _ASSIGN_ONE(point, centroids)


def _assign_one_kernel(point, centroids, *, backend):
    k, d = centroids.shape
    label = torch.empty(1, dtype=torch.int32, device=point.device)
    dist = point.new_empty(1)
    size = _pow2_at_least(k, MAX_REDUCE_GROUP)
    _launch.launch(SHADER, kernel_name("kmeans_assign_one", point.dtype),
                   (point, centroids, label, dist, np.uint32(k), np.uint32(d)),
                   threads=size, group_size=size,
                   threadgroup_memory=(_round16(size * point.element_size()),
                                       _round16(size * 4)),
                   backend=backend)
    return label, dist


def pp_update(x: torch.Tensor, chosen: torch.Tensor, min_dist: torch.Tensor, *,
              backend: Optional[str] = None) -> torch.Tensor:
    """k-means++: ``min(min_dist, ||x - chosen||^2)`` per point (pass +inf at first)."""
    _check_features("pp_update", chosen, x, x_name="chosen", c_name="x", x_dim=1)
    _check_vector("pp_update", "min_dist", min_dist, x.shape[0], "the number of points", x)
    backend = _backend(backend, x, chosen, min_dist)
    if backend == "reference":
        return R.pp_update_reference(x, chosen, min_dist)
    _check_kernel_inputs(backend, x=x, chosen=chosen, min_dist=min_dist)
    return _PP_UPDATE(x, chosen, min_dist)


def _pp_update_kernel(x, chosen, min_dist, *, backend):
    n, d = x.shape
    out = x.new_empty(n)
    if n == 0:
        return out
    _launch.launch(SHADER, kernel_name("kmeans_pp_update", x.dtype),
                   (x, chosen, min_dist, out, np.uint32(n), np.uint32(d)),
                   threads=n, group_size=GROUP_SIZE, backend=backend)
    return out


def update_affected(centroids: torch.Tensor, counts: torch.Tensor, batch_sums: torch.Tensor,
                    batch_counts: torch.Tensor, *,
                    backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """partial_fit: running means of the clusters a batch touched; the others unchanged.

    Returns ``(new_centroids, new_counts int32)``.
    """
    _check_same_centroids("update_affected", centroids, batch_sums, "centroids", "batch_sums")
    for name, c in (("counts", counts), ("batch_counts", batch_counts)):
        _check_vector("update_affected", name, c, centroids.shape[0],
                      "the number of centroids", centroids, integer=True)
    backend = _backend(backend, centroids, batch_sums)
    if backend == "reference":
        return R.update_affected_reference(centroids, counts, batch_sums, batch_counts)
    _check_kernel_inputs(backend, centroids=centroids, counts=counts, batch_sums=batch_sums,
                         batch_counts=batch_counts)
    _check_int32_for_kernels("update_affected", backend, counts=counts,
                             batch_counts=batch_counts)
    return _UPDATE_AFFECTED(centroids, counts, batch_sums, batch_counts)


def _update_affected_kernel(centroids, counts, batch_sums, batch_counts, *, backend):
    k, d = centroids.shape
    new_centroids = centroids.new_empty(k, d)
    new_counts = torch.empty(k, dtype=torch.int32, device=centroids.device)
    if k * d == 0:
        return new_centroids, counts + batch_counts
    _launch.launch(SHADER, kernel_name("kmeans_update_affected", centroids.dtype),
                   (centroids, counts, batch_sums, batch_counts, new_centroids, new_counts,
                    np.uint32(k), np.uint32(d)),
                   threads=k * d, group_size=GROUP_SIZE, backend=backend)
    return new_centroids, new_counts


# ---------------------------------------------------------------------------------------
# The ops: the kernels above, and outputs of the right shapes for tracing.


def _int32(like: torch.Tensor, *shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.int32, device=like.device)


_SQ_NORMS = _custom_ops.define(
    "kmeans_sq_norms(Tensor rows) -> Tensor", _sq_norms_kernel,
    lambda rows: rows.new_empty(rows.shape[0]))
_DISTANCES = _custom_ops.define(
    "kmeans_distances(Tensor x, Tensor centroids, Tensor? x_sq, Tensor? c_sq) -> Tensor",
    _distances_kernel,
    lambda x, centroids, x_sq, c_sq: x.new_empty(x.shape[0], centroids.shape[0]))
_ASSIGN = _custom_ops.define(
    "kmeans_assign(Tensor x, Tensor centroids, Tensor? x_sq, Tensor? c_sq) -> (Tensor, Tensor)",
    _assign_kernel,
    lambda x, centroids, x_sq, c_sq: (_int32(x, x.shape[0]), x.new_empty(x.shape[0])))
_ASSIGN_FROM_DISTANCES = _custom_ops.define(
    "kmeans_assign_from_distances(Tensor dist) -> (Tensor, Tensor)",
    _assign_from_distances_kernel,
    lambda dist: (_int32(dist, dist.shape[0]), dist.new_empty(dist.shape[0])))
_ACCUMULATE = _custom_ops.define(
    "kmeans_accumulate(Tensor x, Tensor labels, SymInt k, str mode) -> (Tensor, Tensor)",
    _accumulate_kernel,
    lambda x, labels, k, mode: (x.new_empty(k, x.shape[1]), _int32(x, k)))
_FINALIZE = _custom_ops.define(
    "kmeans_finalize(Tensor sums, Tensor counts, Tensor old_centroids) -> Tensor",
    _finalize_kernel, lambda sums, counts, old_centroids: sums.new_empty(sums.shape))
_DRIFT_AND_NORMS = _custom_ops.define(
    "kmeans_drift_and_norms(Tensor old, Tensor new) -> (Tensor, Tensor)",
    _drift_and_norms_kernel, lambda old, new: (old.new_empty(2), old.new_empty(old.shape[0])))
_ASSIGN_ONE = _custom_ops.define(
    "kmeans_assign_one(Tensor point, Tensor centroids) -> (Tensor, Tensor)",
    _assign_one_kernel, lambda point, centroids: (_int32(point, 1), point.new_empty(1)))
_PP_UPDATE = _custom_ops.define(
    "kmeans_pp_update(Tensor x, Tensor chosen, Tensor min_dist) -> Tensor",
    _pp_update_kernel, lambda x, chosen, min_dist: x.new_empty(x.shape[0]))
_UPDATE_AFFECTED = _custom_ops.define(
    "kmeans_update_affected(Tensor centroids, Tensor counts, Tensor batch_sums, "
    "Tensor batch_counts) -> (Tensor, Tensor)", _update_affected_kernel,
    lambda centroids, counts, batch_sums, batch_counts: (
        centroids.new_empty(centroids.shape), _int32(centroids, centroids.shape[0])))
