"""``KMeans``: scikit-learn's k-means estimator as an ``nn.Module``, on the Metal kernels.

Lloyd's algorithm with k-means++ (greedy, as scikit-learn) or random seeding; every step
runs through :mod:`torch_sparse_metal.ops.kmeans`, so it executes the kernels of
``shaders/kmeans.metal`` on MPS tensors (backend "metal") or on CPU tensors through the
emulator (backend "emulator"), and plain torch otherwise (backend "reference").

Distributed: ``fit(x, distributed=True)`` (or ``process_group=...``) treats ``x`` as this
rank's shard of the data; centroid sums and counts, potentials and farthest points are
all-reduced, and every random choice is made identically on every rank from the shared
seed, so all ranks end with the same centroids, the ones one process would find on the
concatenation of the shards in rank order (up to float rounding of the reductions).

Precision without float64 on the device: MPS has no float64, so nothing here makes a
float64 tensor on the data's device. Sums that need more than the data's precision
(inertia, potentials, the variance behind ``tol``) go through :func:`_host_sum`: the device
adds blocks of rows in the data's dtype, and the host widens those few partial sums to
float64 and adds them.

scikit-learn's habits: ``get_params`` / ``set_params`` (so ``sklearn.clone``, pipelines and
grid searches work), ``n_features_in_``, ``sample_weight`` in ``fit`` and ``score``, array
outputs for array inputs; ``tests/test_kmeans_sklearn.py`` runs scikit-learn's estimator
checks and lists the few that do not apply, with the reason.
"""
from __future__ import annotations

import functools
import math
import sys
import warnings
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
import torch
from torch import nn

from .. import _validation as V
from .._progress import ProgressBar
from ..formats import is_scipy_sparse
from .._backend import resolve_backend
from ..ops import kmeans as K

_NAME = "KMeans"
_INITS = ("k-means++", "random")

ArrayLike = Union[torch.Tensor, np.ndarray]

# _host_sum: rows the device adds per block, in the data's dtype, before the host takes over.
_SUM_BLOCK = 64


def _host_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over its first dimension, as a float64 tensor on the CPU (shape
    ``t.shape[1:]``; a 0-d tensor for a vector).

    Never makes a float64 tensor on ``t``'s device (MPS has none): the device sums blocks of
    ``_SUM_BLOCK`` rows in ``t``'s dtype (float32 relative error ~1e-7 per block sum, well
    under the float32 rounding of the terms themselves); only those ``n / _SUM_BLOCK``
    partial sums cross to the host, where they are widened and added in float64, so the
    error does not grow with ``n`` as a float32 running sum's would."""
    n = t.shape[0]
    full = n - n % _SUM_BLOCK
    parts = []
    if full:
        parts.append(t[:full].reshape((full // _SUM_BLOCK, _SUM_BLOCK) + tuple(t.shape[1:]))
                     .sum(dim=1))
    if n > full:
        parts.append(t[full:].sum(dim=0, keepdim=True))
    if not parts:
        return torch.zeros(tuple(t.shape[1:]), dtype=torch.float64)
    partial = torch.cat(parts) if len(parts) > 1 else parts[0]
    return partial.cpu().double().sum(dim=0)


def _as_tensor(x: Any, where: str, name: str = "x") -> Tuple[torch.Tensor, bool]:
    """``(x as a tensor, whether it came as an array)``: a tensor as it is; a NumPy array or
    any array-like (a list, an object with ``__array__``) through NumPy, sharing the
    array's memory when it can (a contiguous copy in native byte order otherwise; numbers
    held in an object array converted to float64, as scikit-learn does). A SciPy sparse
    matrix, or what cannot become a numeric tensor, is a TypeError naming ``where``."""
    if isinstance(x, torch.Tensor):
        return x, False
    if is_scipy_sparse(x):
        raise TypeError(f"{where}: sparse input is not supported; {name} must be dense (a "
                        "tensor or an array: use .toarray())")
    what = "a NumPy array" if isinstance(x, np.ndarray) else f"a {type(x).__name__}"
    arr = np.asarray(x)
    if arr.dtype == object:
        try:
            arr = arr.astype(np.float64)
        except (TypeError, ValueError) as err:
            raise TypeError(f"{where}: cannot convert {what} of dtype object to a tensor "
                            f"({err})") from None
    arr = np.ascontiguousarray(arr)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    try:
        with warnings.catch_warnings():  # a read-only array: never written here
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            return torch.from_numpy(arr), True
    except TypeError as err:  # string, unsigned 16/32/64-bit... arrays
        raise TypeError(f"{where}: cannot convert {what} of dtype {arr.dtype} to a tensor "
                        f"({err})") from None


def _as_output(t: torch.Tensor, as_array: bool) -> ArrayLike:
    """NumPy out when NumPy came in (a CPU copy if ``t`` lives elsewhere)."""
    return t.cpu().numpy() if as_array else t


class NotFittedError(ValueError, AttributeError):
    """The estimator is used before ``fit`` (as scikit-learn's ``NotFittedError``; when
    scikit-learn is imported, the error raised is an instance of its class too)."""


def _not_fitted(message: str) -> NotFittedError:
    sklearn_exceptions = sys.modules.get("sklearn.exceptions")  # imported: no import cost
    if sklearn_exceptions is None:
        return NotFittedError(message)
    return _also_sklearns(sklearn_exceptions.NotFittedError)(message)


@functools.lru_cache(maxsize=None)
def _also_sklearns(sklearn_class: type) -> type:
    return type("NotFittedError", (NotFittedError, sklearn_class), {"__module__": __name__})


_PARAMS = ("n_clusters", "init", "n_init", "max_iter", "tol", "seed", "verbose", "accumulate")


def _validated_params(*, n_clusters, init, n_init, max_iter, tol, seed, verbose,
                      accumulate) -> Dict[str, Any]:
    """The constructor's arguments checked, as stored: a valid value is kept as given (a
    NumPy number becomes the Python one), so ``get_params`` returns what was set."""
    n_clusters = V.check_int(_NAME, "n_clusters", n_clusters, minimum=1)
    if isinstance(init, str):
        if init not in _INITS:
            raise ValueError(f"{_NAME}: init must be one of {_INITS} or a tensor of "
                             f"centroids, got {init!r}")
    elif not isinstance(init, (torch.Tensor, np.ndarray)):
        raise TypeError(f"{_NAME}: init must be a string or a (n_clusters, n_features) "
                        f"tensor, got {type(init).__name__}")
    n_init = V.check_int(_NAME, "n_init", n_init, minimum=1)
    max_iter = V.check_int(_NAME, "max_iter", max_iter, minimum=1)
    tol = V.check_number(_NAME, "tol", tol, minimum=0)
    if seed is not None:
        seed = V.check_int(_NAME, "seed", seed)
    if not isinstance(verbose, (bool, np.bool_)):
        verbose = V.check_int(_NAME, "verbose", verbose, minimum=0)
    if accumulate not in K.ACCUMULATE_MODES:
        raise ValueError(f"{_NAME}: accumulate must be one of {K.ACCUMULATE_MODES}, "
                         f"got {accumulate!r}")
    return dict(n_clusters=n_clusters, init=init, n_init=n_init, max_iter=max_iter, tol=tol,
                seed=seed, verbose=verbose, accumulate=accumulate)


# ---------------------------------------------------------------------------------------
# Collectives: one small interface so the fit loop is the same with 1 process or many.


class _Comm:
    """Sums and gathers over a ``torch.distributed`` process group; no-ops when local."""

    def __init__(self, distributed: bool, group: Any = None) -> None:
        self.distributed = distributed
        self.group = group
        self.rank, self.world = 0, 1
        if distributed:
            import torch.distributed as dist
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(f"{_NAME}.fit: distributed=True needs an initialised "
                                   "torch.distributed process group (init_process_group)")
            self._dist = dist
            self.rank = dist.get_rank(group)
            self.world = dist.get_world_size(group)
            # gloo reduces CPU tensors only: MPS data goes through host copies.
            self._cpu_only = dist.get_backend(group) == "gloo"

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        """A new tensor (also with one process: callers may edit the result in place)."""
        if self.world == 1:
            return t.clone()
        buf = t.cpu().clone() if (self._cpu_only and t.device.type != "cpu") else t.clone()
        self._dist.all_reduce(buf, op=op, group=self.group)
        return buf.to(t.device)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks (a new tensor; ``t`` is left alone)."""
        return self._reduce(t, None if self.world == 1 else self._dist.ReduceOp.SUM)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise max over ranks (a new tensor; ``t`` is left alone)."""
        return self._reduce(t, None if self.world == 1 else self._dist.ReduceOp.MAX)

    def gather_sizes(self, n: int) -> torch.Tensor:
        """Every rank's local count, int64 on CPU, in rank order."""
        sizes = torch.zeros(self.world, dtype=torch.int64)
        sizes[self.rank] = n
        return self.sum(sizes)

    def fetch(self, local: torch.Tensor, global_idx: torch.Tensor, start: int) -> torch.Tensor:
        """Rows ``global_idx`` (of the concatenation of all shards) of the per-rank tensor
        ``local``; every rank gets them all. ``start``: this rank's first global row."""
        idx = global_idx.to(local.device)
        mine = (idx >= start) & (idx < start + local.shape[0])
        out = local.new_zeros((idx.shape[0],) + tuple(local.shape[1:]))
        out[mine] = local[idx[mine] - start]
        return self.sum(out)  # non-owners add exact zeros


# ---------------------------------------------------------------------------------------


class KMeans(nn.Module):
    """k-means clustering (Lloyd), scikit-learn's ``KMeans`` API on the package's kernels.

    Args:
        n_clusters: number of clusters ``k``.
        init: ``"k-means++"`` (greedy k-means++, scikit-learn's default), ``"random"``
            (``k`` distinct points) or a ``(k, n_features)`` tensor / array of centroids.
        n_init: runs from different seeds; the lowest inertia wins (an explicit ``init``
            array runs once).
        max_iter: Lloyd iterations per run.
        tol: convergence when the total squared centroid shift of an iteration is at most
            ``tol`` times the mean per-feature variance of the data (scikit-learn's rule);
            a run also stops when no label changes.
        seed: seeds every random choice (a ``torch.Generator`` on the CPU); None draws one.
        verbose: show progress per iteration (inertia, largest centroid shift): a bar
            redrawn in place on a terminal, one line per iteration otherwise.
        accumulate: how the kernels sum points per cluster: ``"auto"`` (native float atomics
            where the GPU has Metal 3, compare-and-swap emulation otherwise; under
            ``torch.use_deterministic_algorithms(True)``, ``"deterministic"``), ``"atomic"``,
            ``"cas"`` (float32 only), or ``"deterministic"`` (bit-identical run to run).
            Ignored by the reference backend, which is deterministic.

    Attributes (after ``fit``; the first two are buffers, so ``.to()`` and ``state_dict()``
    carry them, and stay tensors):
        cluster_centers_: ``(k, n_features)``.
        cluster_counts_: ``(k,)`` int32, points each centroid has absorbed (the weights of
            :meth:`partial_fit`'s running means).
        labels_: ``(n_samples,)`` int64 label of each training point (a NumPy array when
            ``fit`` was given an array).
        inertia_: float, (weighted) sum of squared distances of the points to their
            centroids.
        n_iter_: int, Lloyd iterations of the best run.
        n_features_in_: int, features seen by ``fit`` (also after ``load_state_dict``).

    Inputs: tensors, or NumPy arrays and other array-likes (lists, ...), which give NumPy
    outputs (``predict``, ``transform``, ``fit_predict``, ``labels_``); never modified.
    ``forward(x)`` returns the labels of a tensor ``x`` ``(*, n_features) -> (*)``, so a
    fitted ``KMeans`` works as a quantizer stage inside a model.

    scikit-learn's estimator API: ``get_params`` / ``set_params`` (validated as the
    constructor validates: a bad value raises at once, nothing changes), ``sklearn.clone``,
    ``sample_weight`` in :meth:`fit` and :meth:`score`.
    """

    def __init__(self, n_clusters: int = 8, *, init: Union[str, ArrayLike] = "k-means++",
                 n_init: int = 1, max_iter: int = 300, tol: float = 1e-4,
                 seed: Optional[int] = None, verbose: bool = False,
                 accumulate: str = "auto") -> None:
        super().__init__()
        for name, value in _validated_params(n_clusters=n_clusters, init=init, n_init=n_init,
                                             max_iter=max_iter, tol=tol, seed=seed,
                                             verbose=verbose, accumulate=accumulate).items():
            setattr(self, name, value)
        self.register_buffer("cluster_centers_", None)
        self.register_buffer("cluster_counts_", None)

    # -----------------------------------------------------------------------------------
    # scikit-learn's estimator protocol

    def get_params(self, deep: bool = True) -> Dict[str, Any]:
        """The constructor's arguments, by name (``deep`` is accepted and changes nothing:
        no parameter is an estimator)."""
        return {name: getattr(self, name) for name in _PARAMS}

    def set_params(self, **params: Any) -> "KMeans":
        """Set constructor arguments by name; every value is checked before any is set.
        A fitted model keeps its centroids until it is fitted again."""
        unknown = sorted(set(params) - set(_PARAMS))
        if unknown:
            raise ValueError(f"{_NAME}.set_params: invalid parameter(s) {unknown}; valid "
                             f"parameters are {list(_PARAMS)}")
        validated = _validated_params(**{**self.get_params(), **params})
        for name in params:
            setattr(self, name, validated[name])
        return self

    def __sklearn_tags__(self):
        from sklearn.utils import InputTags, Tags, TargetTags, TransformerTags
        return Tags(estimator_type="clusterer", target_tags=TargetTags(required=False),
                    transformer_tags=TransformerTags(preserves_dtype=["float64", "float32"]),
                    input_tags=InputTags(two_d_array=True, sparse=False))

    def __sklearn_is_fitted__(self) -> bool:
        return self.cluster_centers_ is not None

    @property
    def n_features_in_(self) -> int:
        return int(self._check_fitted("n_features_in_").shape[1])

    def extra_repr(self) -> str:
        init = self.init if isinstance(self.init, str) else "array"
        return (f"n_clusters={self.n_clusters}, init={init!r}, n_init={self.n_init}, "
                f"max_iter={self.max_iter}, tol={self.tol}, seed={self.seed}, "
                f"accumulate={self.accumulate!r}")

    # -----------------------------------------------------------------------------------
    # Input handling

    def _prepare(self, x: ArrayLike, method: str, *, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> Tuple[torch.Tensor, bool]:
        """``(x as a contiguous 2-D floating tensor, validated; whether it came as an
        array)``; never the caller's memory written to (a view or a copy, only read)."""
        where = f"{_NAME}.{method}"
        x, as_array = _as_tensor(x, where)
        if x.dim() != 2:
            hint = ". Reshape your data: x.reshape(1, -1) for one sample" if x.dim() == 1 else ""
            raise ValueError(f"{where}: x must be 2-D (n_samples, n_features), got shape "
                             f"{tuple(x.shape)}{hint}")
        if x.shape[0] == 0:
            raise ValueError(f"{where}: x is empty (0 samples)")
        if x.shape[1] == 0:
            raise ValueError(f"{where}: x has 0 features: found array with 0 feature(s) "
                             f"(shape={tuple(x.shape)}) while a minimum of 1 is required.")
        if x.is_complex():
            raise ValueError(f"{where}: Complex data not supported (x has dtype {x.dtype})")
        if device is not None and x.device != device:
            raise ValueError(f"{where}: x is on {x.device} but the centroids are on {device}; "
                             "move one of them (model.to(device) or x.to(device))")
        if dtype is not None:
            x = x.to(dtype)
        elif not x.is_floating_point():
            x = x.to(torch.get_default_dtype())
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{where}: x contains NaN or infinity")
        return x.contiguous(), as_array

    def _check_fitted(self, method: str) -> torch.Tensor:
        if self.cluster_centers_ is None:
            raise _not_fitted(f"{_NAME}.{method}: this KMeans is not fitted yet; call fit (or "
                              "partial_fit, or load_state_dict) first")
        return self.cluster_centers_

    def _backend(self, method: str, x: torch.Tensor) -> str:
        backend = resolve_backend(f"{_NAME}.{method}", (x,),
                                  kernels=lambda: K.kernels_for(x.dtype))
        if backend != "reference":
            V.check_kernel_dtype(f"{_NAME}.{method}", x.dtype, backend)
        return backend

    def _prepare_for_centroids(self, x: ArrayLike,
                               method: str) -> Tuple[torch.Tensor, str, bool]:
        """``(x, backend, whether x came as an array)`` for a method of a fitted model."""
        centers = self._check_fitted(method)
        x, as_array = self._prepare(x, method, dtype=centers.dtype, device=centers.device)
        if x.shape[1] != centers.shape[1]:
            raise ValueError(f"{_NAME}.{method}: X has {x.shape[1]} features, but {_NAME} is "
                             f"expecting {centers.shape[1]} features as input")
        return x, self._backend(method, x), as_array

    def _prepare_weights(self, sample_weight: Any, x: torch.Tensor, method: str,
                         comm: "_Comm") -> Optional[torch.Tensor]:
        """``sample_weight`` as a ``(n_samples,)`` tensor of ``x``'s dtype and device:
        finite, non-negative, not all zero (over every rank); None stays None."""
        if sample_weight is None:
            return None
        where = f"{_NAME}.{method}"
        w, _ = _as_tensor(sample_weight, where, "sample_weight")
        if w.dim() != 1 or w.shape[0] != x.shape[0]:
            raise ValueError(f"{where}: sample_weight must have shape (n_samples,) = "
                             f"({x.shape[0]},), got {tuple(w.shape)}")
        if w.is_complex():
            raise ValueError(f"{where}: Complex data not supported (sample_weight has dtype "
                             f"{w.dtype})")
        w = w.to(device=x.device, dtype=x.dtype).contiguous()
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"{where}: sample_weight contains NaN or infinity")
        if bool((w < 0).any()):
            raise ValueError(f"{where}: sample_weight must be non-negative")
        if float(comm.sum(_host_sum(w).reshape(1))) == 0:
            raise ValueError(f"{where}: every sample weight is zero; at least one must be "
                             "positive")
        return w

    # -----------------------------------------------------------------------------------
    # Fitting

    def fit(self, x: ArrayLike, y: Any = None, sample_weight: Optional[ArrayLike] = None, *,
            distributed: bool = False, process_group: Any = None) -> "KMeans":
        """Cluster ``x`` ``(n_samples, n_features)``; returns ``self``.

        ``sample_weight`` ``(n_samples,)``: non-negative weights, as scikit-learn's: a point
        of weight 2 counts as two copies of it in the centroids, the inertia and the
        k-means++ draws (the tolerance's variance stays unweighted, as there). The points
        are then accumulated with their weight as one more feature, and the centroids are
        those weighted sums divided by torch ops, not the finalize kernel (which divides
        by integer counts).

        ``distributed=True`` (implied by a ``process_group``): ``x`` (and
        ``sample_weight``) is this rank's shard; needs ``torch.distributed`` initialised
        (the default group unless one is given). ``y`` is ignored (scikit-learn's
        signature).
        """
        comm = _Comm(distributed or process_group is not None, process_group)
        x, as_array = self._prepare(x, "fit")
        backend = self._backend("fit", x)
        mode = K.choose_accumulate_mode(self.accumulate, backend, x.dtype)
        k = self.n_clusters
        sizes = comm.gather_sizes(x.shape[0])
        if comm.distributed:
            widest, narrowest = comm.max(torch.tensor([x.shape[1], -x.shape[1]])).tolist()
            if widest != -narrowest:
                raise ValueError(f"{_NAME}.fit: the ranks' shards have different numbers of "
                                 "features")
        n_total = int(sizes.sum())
        if n_total < k:
            raise ValueError(f"{_NAME}.fit: n_samples = {n_total} should be >= n_clusters = {k}")
        w = self._prepare_weights(sample_weight, x, "fit", comm)
        if w is not None:
            positive = int(comm.sum((w > 0).sum().reshape(1).cpu()))
            if positive < k:
                raise ValueError(f"{_NAME}.fit: sample_weight has {positive} positive "
                                 f"weight(s); it needs at least n_clusters = {k}")
        # With weights, the points are accumulated as (w x, w): the weighted sums and the
        # clusters' weights from one kernel.
        points = x if w is None else torch.cat([x * w[:, None], w[:, None]], dim=1)
        K.check_fit_limits(f"{_NAME}.fit", x.shape[0], k, points.shape[1], x.dtype, backend)
        start = int(sizes[:comm.rank].sum())

        seed = self.seed
        if seed is None:  # one draw, shared by every rank
            seed = comm.sum(torch.tensor([int(torch.randint(0, 2**62, ()).item())
                                          if comm.rank == 0 else 0])).item()
        gen = torch.Generator().manual_seed(int(seed))
        x_sq = K.sq_norms(x, backend=backend)
        tol = self.tol * self._mean_variance(x, n_total, comm)

        explicit = not isinstance(self.init, str)
        best = None
        for run in range(1 if explicit else self.n_init):
            centers = self._init_centroids(x, x_sq, w, gen, comm, backend, n_total, start)
            result = self._lloyd(x, x_sq, points, w, centers, tol, comm, backend, mode, run)
            if best is None or result[2] < best[2]:
                best = result
        centers, labels, inertia, n_iter = best

        counts = torch.bincount(labels.long(), minlength=k).to(torch.int32)
        self.cluster_centers_ = centers
        self.cluster_counts_ = comm.sum(counts)
        self.labels_ = _as_output(labels.long(), as_array)
        self.inertia_ = inertia
        self.n_iter_ = n_iter
        return self

    def fit_predict(self, x: ArrayLike, y: Any = None, **fit_kwargs) -> ArrayLike:
        """``fit(x)`` then the training labels (int64)."""
        return self.fit(x, **fit_kwargs).labels_

    @staticmethod
    def _mean_variance(x: torch.Tensor, n_total: int, comm: _Comm) -> float:
        """Mean over features of the data's variance, for ``tol``: two passes, the sums
        finished in float64 on the host (:func:`_host_sum`)."""
        mean = comm.sum(_host_sum(x)) / n_total
        dev = x - mean.to(device=x.device, dtype=x.dtype)
        sq = comm.sum(_host_sum(dev * dev)) / n_total
        return float(sq.mean())

    def _init_centroids(self, x: torch.Tensor, x_sq: torch.Tensor, w: Optional[torch.Tensor],
                        gen: torch.Generator, comm: _Comm, backend: str, n_total: int,
                        start: int) -> torch.Tensor:
        k, d = self.n_clusters, x.shape[1]
        if not isinstance(self.init, str):
            init, _ = _as_tensor(self.init, f"{_NAME}.fit", "init")
            if init.shape != (k, d):
                raise ValueError(f"{_NAME}.fit: init has shape {tuple(init.shape)}, expected "
                                 f"(n_clusters, n_features) = ({k}, {d})")
            init = init.to(device=x.device, dtype=x.dtype)
            if not bool(torch.isfinite(init).all()):
                raise ValueError(f"{_NAME}.fit: init contains NaN or infinity")
            return init.clone().contiguous()
        if self.init == "random":
            if w is None:
                idx = torch.randperm(n_total, generator=gen)[:k]
            else:  # k distinct points drawn with probability proportional to their weight
                every = comm.fetch(w, torch.arange(n_total), start).cpu().double()
                idx = torch.multinomial(every, k, replacement=False, generator=gen)
            return comm.fetch(x, idx, start).contiguous()
        return self._kmeans_plusplus(x, x_sq, w, gen, comm, backend, n_total, start)

    def _kmeans_plusplus(self, x: torch.Tensor, x_sq: torch.Tensor, w: Optional[torch.Tensor],
                         gen: torch.Generator, comm: _Comm, backend: str, n_total: int,
                         start: int) -> torch.Tensor:
        """Greedy k-means++ (Arthur & Vassilvitskii; scikit-learn's variant): each new
        centroid is the best of ``2 + log k`` candidates drawn with probability proportional
        to the (weighted) squared distance to the nearest centroid so far; with weights,
        the first centroid is drawn in proportion to them. The draws come from the shared
        generator and the candidates' potentials are summed over ranks, so every rank
        picks the same centroids."""
        k, d = self.n_clusters, x.shape[1]
        trials = 2 + int(math.log(k))
        centers = x.new_empty(k, d)
        if w is None:
            first = torch.randint(n_total, (1,), generator=gen)
        else:
            total = float(comm.sum(_host_sum(w).reshape(1)))
            first = self._sample(w, torch.rand(1, generator=gen, dtype=torch.float64) * total,
                                 comm, n_total, start)
        weighted = (lambda t: t) if w is None else (lambda t: t * (w if t.dim() == 1
                                                                   else w[:, None]))
        centers[0] = comm.fetch(x, first, start)[0]
        min_dist = K.pp_update(x, centers[0].contiguous(),
                               torch.full_like(x_sq, math.inf), backend=backend)
        potential = float(comm.sum(_host_sum(weighted(min_dist)).reshape(1)))
        for c in range(1, k):
            draws = torch.rand(trials, generator=gen, dtype=torch.float64) * potential
            idx = self._sample(weighted(min_dist), draws, comm, n_total, start)
            candidates = comm.fetch(x, idx, start).contiguous()
            dist = K.distances(x, candidates, x_sq=x_sq, backend=backend)
            # host float64
            pots = comm.sum(_host_sum(weighted(torch.minimum(dist, min_dist[:, None]))))
            best = int(torch.argmin(pots))
            centers[c] = candidates[best]
            min_dist = K.pp_update(x, candidates[best].contiguous(), min_dist, backend=backend)
            potential = float(pots[best])
        return centers

    @staticmethod
    def _sample(weights: torch.Tensor, draws: torch.Tensor, comm: _Comm, n_total: int,
                start: int) -> torch.Tensor:
        """Global indices ``i`` of the first ``cumsum(weights)[i] >= draw`` over the
        concatenated shards (numpy's searchsorted, as scikit-learn), clipped to the data.

        Every rank computes the owner of each draw from the same gathered totals, so
        exactly one rank answers for it, whatever the rounding of the partial sums."""
        local = torch.cumsum(weights.cpu().double(), 0)
        total = float(local[-1]) if local.numel() else 0.0
        totals = torch.zeros(comm.world, dtype=torch.float64)
        totals[comm.rank] = total
        ends = torch.cumsum(comm.sum(totals), 0)
        # The first rank whose range [end - total, end) holds the draw (ranks with nothing
        # to draw from have an empty range); past the end (rounding): the last rank.
        owner = torch.searchsorted(ends, draws, right=True).clamp_max(comm.world - 1)
        mine = owner == comm.rank
        idx = torch.zeros(draws.shape[0], dtype=torch.int64)
        if local.numel():
            rel = draws - (ends[comm.rank] - total)
            found = torch.searchsorted(local, rel).clamp_max(local.numel() - 1)
            idx = torch.where(mine, found + start + 1, idx)  # +1: 0 means "not mine"
        idx = comm.sum(idx) - 1
        return idx.clamp(0, n_total - 1)

    def _lloyd(self, x: torch.Tensor, x_sq: torch.Tensor, points: torch.Tensor,
               w: Optional[torch.Tensor], centers: torch.Tensor, tol: float, comm: _Comm,
               backend: str, mode: str, run: int) -> Tuple[torch.Tensor, torch.Tensor, float, int]:
        """One run of Lloyd's algorithm from ``centers``: ``(centers, labels, inertia, n_iter)``.

        ``points``: what is accumulated per cluster, ``x`` or, with weights ``w``, the
        rows ``(w x, w)``."""
        k, d = self.n_clusters, x.shape[1]

        def inertia_of(min_dist: torch.Tensor) -> float:
            return float(comm.sum(_host_sum(min_dist if w is None else min_dist * w).reshape(1)))

        labels_old = None
        n_iter = 0
        progress = ProgressBar(self.max_iter, f"{_NAME}: ") if self.verbose and comm.rank == 0 else None
        c_sq = None  # ||c||^2: computed by assign at first, then given by drift_and_norms
        for i in range(self.max_iter):
            n_iter = i + 1
            labels, min_dist = K.assign(x, centers, x_sq=x_sq, c_sq=c_sq, backend=backend)
            sums, counts = K.accumulate(points, labels, k, mode=mode, backend=backend)
            sums, counts = comm.sum(sums), comm.sum(counts)
            empty = (counts if w is None else sums[:, d]) == 0
            if bool(empty.any()):
                self._relocate_empty(points, labels, min_dist, sums, counts, comm,
                                     torch.nonzero(empty).flatten())
            if w is None:
                new_centers = K.finalize(sums, counts, centers, backend=backend)
            else:
                mass = sums[:, d:]
                new_centers = torch.where(mass > 0, sums[:, :d] / torch.where(mass > 0, mass, 1),
                                          centers)
            shift, new_sq = K.drift_and_norms(centers, new_centers, backend=backend)
            shift_max, shift_total = (float(v) for v in shift.tolist())
            if progress is not None:
                inertia = inertia_of(min_dist)
                prefix = f"run {run + 1}, " if self.n_init > 1 else ""
                progress.update(i + 1, f"{prefix}iteration {i + 1}/{self.max_iter}, inertia "
                                       f"{inertia:.6g}, largest centroid shift {math.sqrt(shift_max):.4g}")
            elif self.verbose:
                inertia_of(min_dist)  # keep ranks in step
            centers, c_sq = new_centers, new_sq
            if labels_old is not None:
                changed = int(comm.sum((labels != labels_old).sum().reshape(1)))
                if changed == 0:
                    if progress is not None:
                        progress.close(f"converged at iteration {i + 1}: no label changed")
                        progress = None
                    break
            if shift_total <= tol:
                if progress is not None:
                    progress.close(f"converged at iteration {i + 1}: centroid shift "
                                   f"{shift_total:.3g} <= tol {tol:.3g}")
                    progress = None
                break
            labels_old = labels
        if progress is not None:
            progress.close(f"stopped after max_iter = {self.max_iter} iterations")
        # Labels and inertia that match the final centroids.
        labels, min_dist = K.assign(x, centers, x_sq=x_sq, c_sq=c_sq, backend=backend)
        return centers, labels, inertia_of(min_dist), n_iter

    @staticmethod
    def _relocate_empty(x: torch.Tensor, labels: torch.Tensor, min_dist: torch.Tensor,
                        sums: torch.Tensor, counts: torch.Tensor, comm: _Comm,
                        empty: torch.Tensor) -> None:
        """Re-seed each empty cluster (``empty``: their indices) to one of the points
        farthest from their centroids (scikit-learn's rule), moving that point's
        contribution (its row of ``x``, what was accumulated) out of its old cluster.
        Edits ``sums`` and ``counts`` (the fit's own fresh tensors) in place."""
        n_empty = empty.numel()
        # Each rank proposes its n_empty farthest points; the global top n_empty win
        # (ties to the lower global index: a stable sort of the gathered candidates).
        m = min(n_empty, min_dist.shape[0])
        vals, local_idx = torch.topk(min_dist, m)  # widened on the host below
        prop_vals = torch.full((comm.world, n_empty), -math.inf, dtype=torch.float64)
        prop_idx = torch.zeros((comm.world, n_empty), dtype=torch.int64)
        start = 0
        if comm.distributed:
            sizes = comm.gather_sizes(x.shape[0])
            start = int(sizes[:comm.rank].sum())
        prop_vals[comm.rank, :m] = vals.cpu().double()
        prop_idx[comm.rank, :m] = local_idx.cpu() + start
        if comm.world > 1:
            # -inf + 0 stays -inf; the other ranks' rows are filled by their owners.
            prop_vals = comm.max(prop_vals)
            prop_idx = comm.sum(prop_idx)
        order = torch.sort(-prop_vals.flatten(), stable=True).indices[:n_empty]
        far = prop_idx.flatten()[order]
        points = comm.fetch(x, far, start)
        old = comm.fetch(labels.long(), far, start).to(sums.device)
        sums.index_add_(0, old, -points)
        counts.index_add_(0, old, -torch.ones_like(old, dtype=counts.dtype))
        new = empty.to(sums.device)
        sums.index_copy_(0, new, points)
        counts.index_fill_(0, new, 1)

    # -----------------------------------------------------------------------------------
    # Using a fitted model

    def predict(self, x: ArrayLike) -> ArrayLike:
        """The nearest centroid of each point: ``(n_samples, n_features) -> (n_samples,)``
        int64."""
        x, backend, as_array = self._prepare_for_centroids(x, "predict")
        labels, _ = K.assign(x, self.cluster_centers_.contiguous(), backend=backend)
        return _as_output(labels.long(), as_array)

    def transform(self, x: ArrayLike) -> ArrayLike:
        """Euclidean distance of each point to each centroid: ``(n_samples, n_clusters)``."""
        x, backend, as_array = self._prepare_for_centroids(x, "transform")
        dist = K.distances(x, self.cluster_centers_.contiguous(), backend=backend).sqrt()
        return _as_output(dist, as_array)

    def fit_transform(self, x: ArrayLike, y: Any = None, **fit_kwargs) -> ArrayLike:
        return self.fit(x, **fit_kwargs).transform(x)

    def score(self, x: ArrayLike, y: Any = None,
              sample_weight: Optional[ArrayLike] = None) -> float:
        """Minus the (weighted) inertia of ``x`` under the fitted centroids (scikit-learn's
        sign)."""
        x, backend, _ = self._prepare_for_centroids(x, "score")
        w = self._prepare_weights(sample_weight, x, "score", _Comm(False))
        _, min_dist = K.assign(x, self.cluster_centers_.contiguous(), backend=backend)
        return -float(_host_sum(min_dist if w is None else min_dist * w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Labels of ``x`` ``(*, n_features) -> (*)`` int64: a quantizer stage."""
        self._check_fitted("forward")
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise ValueError(f"{_NAME}.forward: x must be a tensor (*, n_features)")
        lead = tuple(x.shape[:-1])
        if math.prod(lead) == 0:
            return torch.empty(lead, dtype=torch.int64, device=x.device)
        flat = x.reshape(math.prod(lead), x.shape[-1])
        return self.predict(flat).reshape(lead)

    def assign(self, x_one: ArrayLike) -> int:
        """The nearest centroid of ONE new point ``(n_features,)`` (one small dispatch; the
        centroids do not move)."""
        centers = self._check_fitted("assign")
        x_one, _ = _as_tensor(x_one, f"{_NAME}.assign", "x_one")
        if x_one.dim() == 2 and x_one.shape[0] == 1:
            x_one = x_one[0]
        if x_one.dim() != 1:
            raise ValueError(f"{_NAME}.assign: x_one must be one point (n_features,), got shape "
                             f"{tuple(x_one.shape)}; use predict for many")
        point = self._prepare(x_one.reshape(1, -1), "assign", dtype=centers.dtype,
                              device=centers.device)[0][0]
        if point.shape[0] != centers.shape[1]:
            raise ValueError(f"{_NAME}.assign: x_one has {point.shape[0]} features but the "
                             f"model was fitted with {centers.shape[1]}")
        backend = self._backend("assign", point)
        label, _ = K.assign_one(point.contiguous(), centers.contiguous(), backend=backend)
        return int(label.item())

    def partial_fit(self, x: ArrayLike, y: Any = None) -> "KMeans":
        """Online update from a batch: each point joins its nearest centroid and only the
        centroids that received points move, to the running mean of everything they have
        absorbed (``cluster_counts_`` weighs the past). An unfitted model is first
        initialised from this batch with ``init``. Sets ``labels_`` / ``inertia_`` to the
        batch's (under the centroids before the update). Returns ``self``."""
        fitted = self.cluster_centers_ is not None
        if fitted:
            x, backend, as_array = self._prepare_for_centroids(x, "partial_fit")
        else:
            x, as_array = self._prepare(x, "partial_fit")
            if x.shape[0] < self.n_clusters and isinstance(self.init, str):
                raise ValueError(f"{_NAME}.partial_fit: the first batch has n_samples = "
                                 f"{x.shape[0]}, should be >= n_clusters = {self.n_clusters}")
            backend = self._backend("partial_fit", x)
        K.check_fit_limits(f"{_NAME}.partial_fit", x.shape[0], self.n_clusters, x.shape[1],
                           x.dtype, backend)
        if fitted:
            centers, counts = self.cluster_centers_.contiguous(), self.cluster_counts_
            if counts is None:  # centroids loaded without counts
                counts = torch.zeros(self.n_clusters, dtype=torch.int32, device=x.device)
        else:
            seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()))
            gen = torch.Generator().manual_seed(seed)
            comm = _Comm(False)
            x_sq = K.sq_norms(x, backend=backend)
            centers = self._init_centroids(x, x_sq, None, gen, comm, backend, x.shape[0], 0)
            counts = torch.zeros(self.n_clusters, dtype=torch.int32, device=x.device)
        if int(counts.max()) + x.shape[0] > V.INT32_MAX:
            raise ValueError(f"{_NAME}.partial_fit: a centroid's count would pass 2**31 - 1")
        mode = K.choose_accumulate_mode(self.accumulate, backend, x.dtype)
        labels, min_dist = K.assign(x, centers, backend=backend)
        batch_sums, batch_counts = K.accumulate(x, labels, self.n_clusters, mode=mode,
                                                backend=backend)
        centers, counts = K.update_affected(centers, counts.to(torch.int32).contiguous(),
                                            batch_sums, batch_counts, backend=backend)
        self.cluster_centers_ = centers
        self.cluster_counts_ = counts
        self.labels_ = _as_output(labels.long(), as_array)
        self.inertia_ = float(_host_sum(min_dist))
        return self

    # -----------------------------------------------------------------------------------
    # state_dict: the buffers start as None (unfitted), so loading must create them.

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        for name in ("cluster_centers_", "cluster_counts_"):
            value = state_dict.get(prefix + name)
            if value is not None:
                current = self._buffers.get(name)
                device = current.device if current is not None else value.device
                self._buffers[name] = torch.empty_like(value, device=device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self.cluster_centers_ is not None and self.cluster_centers_.shape[0] != self.n_clusters:
            error_msgs.append(f"{_NAME}: cluster_centers_ has {self.cluster_centers_.shape[0]} "
                              f"rows but n_clusters is {self.n_clusters}")
