"""``sparse_linear``: ``input @ W.T + bias`` with ``W`` a CSR matrix, and its gradients.

``W`` is ``out_features x in_features``; row ``r`` of the CSR lists the source neurons
(``indices``) and weights (``values``) of target neuron ``r``. Kernels:
``shaders/sparse_linear.metal`` (one forward dispatch, one fused backward dispatch).

Host code follows torch's MPS ops: validate -> allocate -> return early on empty -> launch.

Ops (``torch.ops.torch_sparse_metal``, registered by :mod:`torch_sparse_metal._custom_ops`):

* ``sparse_linear`` (differentiable) runs the forward kernel. Besides the data it takes the
  pattern's index arrays, its by-source CSR (three empty tensors when no gradient will be
  needed; a backward would then build it) and their fingerprints, so that all of them are
  saved for backward, where torch's version counter guards them.
* ``sparse_linear_backward`` runs the one fused backward kernel.

What reads the device back stays off the hot path (:mod:`torch_sparse_metal.checks`): a
pattern is validated when it is built or replaced (a new tensor, or a write torch's version
counter sees), and a write that bypasses the counter (``.data``, ``.numpy()``) is found by
the kernels when it leaves an index out of range (NaN and an error flag) and by
``check_errors()`` otherwise. In strict mode (``check_invariants``) every call compares the
arrays with their fingerprints first (one read-back): in Python before the op in eager
mode, and inside the ops (``verify``, ``strict``) under ``torch.compile``, where a
``SparseLinear`` cannot validate its pattern again. The functional forms validate their
index arrays on every call, a graph break there.
"""
from __future__ import annotations

import copy
import functools
from typing import NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import _custom_ops
from .. import _launch
from .. import _validation as V
from .._autocast import cast_for_reference, kernel_dtype
from .._backend import kernels_or_reference, require_kernel_dtype, resolve_backend
from ..checks import check_invariants, error_word, watch_pattern
from .._activations import ACTIVATION_CODES, check_activation
from .._kernel_names import kernel_name, kernel_names_for, library_kernels
from ..formats import is_sparse_weight, sparse_weight_parts
from ..reference.activations import activation_backward_reference, apply_activation
from ..reference.sparse_linear import csr_row_ids, sparse_linear_reference

OP = "sparse_linear"
SHADER = "sparse_linear.metal"
KERNELS = ("sparse_linear_forward", "sparse_linear_backward",
           "sparse_linear_backward_deterministic", "sparse_linear_forward_batch_lanes",
           "sparse_linear_backward_batch_lanes")
# float32, float16 and bfloat16 on Metal (bfloat16 from MSL 3.1), float64 too on the emulator;
# sums in float32 (float64 for float64) whatever the storage type.
DTYPES = V.KERNEL_DTYPES_WITH_HALF
# 8 SIMD-groups of 32: the seed engine's choice for these register-light kernels.
GROUP_SIZE = 256
SIMD_WIDTH = 32
# The batch from which the kernels give a SIMD-group one row and its lanes the batch
# (the *_batch_lanes kernels, activations in the (features, batch) layout) rather than
# each lane its own row. Chosen by the emulator's transaction counters
# (tests/test_sparse_linear_mapping.py): the batch-lanes kernels take about the same
# transactions at any batch up to 32 (a row's indices and values are loaded 32 edges at a
# time for every lane), the lane-per-row kernels a number proportional to the batch, fewer
# only at batch 1 (their lanes' index and value loads share segments, since consecutive
# rows' edges are consecutive).
BATCH_LANES_FROM = 2


def lanes_along_batch(batch: int, deterministic: bool = False) -> bool:
    """Whether a batch of ``batch`` runs the *_batch_lanes kernels, which take and give
    the activations (input, output and their gradients) in the (features, batch) layout.
    The deterministic backward keeps a lane per element."""
    return batch >= BATCH_LANES_FROM and not deterministic


def kernel_names(backend: str = "emulator") -> Tuple[str, ...]:
    """Every kernel name the host code can ask ``backend`` for (tests check they exist)."""
    return kernel_names_for(KERNELS, backend, DTYPES)


class BySource(NamedTuple):
    """The pattern transposed: CSR indexed by source neuron (all int32, on the device).

    ``indptr`` (in_features + 1): edges leaving source ``i`` are positions
    ``indptr[i]:indptr[i + 1]``; ``rows`` (nnz): the target row of the edge at each
    position; ``perm`` (nnz): its by-target edge id, i.e. where its value lives.
    """
    indptr: torch.Tensor
    rows: torch.Tensor
    perm: torch.Tensor


class CSRPattern:
    """A validated sparsity pattern of an ``out_features x in_features`` matrix.

    Holds ``indptr`` / ``indices`` as contiguous int32 on one device and builds the
    by-source CSR the backward kernel needs on first use, once. Immutable: a new pattern
    means a new object (``SparseLinear`` does that when its buffers change).

    A write to its index arrays that torch's version counter does not see (through
    ``.data`` or ``.numpy()``) is caught by :meth:`changed`, a fingerprint of their contents
    taken when they were validated (and when the by-source CSR was built), which
    :func:`~torch_sparse_metal.checks.check_errors` also runs on every live pattern.

    Duplicate (row, column) entries are allowed and add up, as in scipy.
    """

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, in_features: int, *,
                 out_features: Optional[int] = None, op: str = OP) -> None:
        in_features = V.check_int(op, "in_features", in_features, minimum=0)
        indptr, indices = V.validate_csr(op, indptr, indices, n_cols=in_features,
                                         n_rows=out_features)
        self._adopt(indptr, indices, in_features, None)

    @classmethod
    def trusted(cls, indptr: torch.Tensor, indices: torch.Tensor, in_features: int, *,
                distinct_cells: Optional[int] = None) -> "CSRPattern":
        """A pattern valid by construction (``prune_and_regrow``'s, say), taken without the
        validation and its read-back: contiguous int32 arrays on one device.
        ``distinct_cells``: how many distinct (row, column) cells it holds, if known."""
        pattern = cls.__new__(cls)
        pattern._adopt(indptr, indices, in_features, distinct_cells)
        return pattern

    def _adopt(self, indptr: torch.Tensor, indices: torch.Tensor, in_features: int,
               distinct_cells: Optional[int]) -> None:
        self.indptr, self.indices = indptr, indices
        self.in_features = in_features
        self.out_features = self.indptr.shape[0] - 1
        # (indptr, indices)'s fingerprint, then the by-source CSR's once it is built.
        self._fingerprints = fingerprints(self.indptr, self.indices)
        self._by_source: Optional[BySource] = None
        self._layout = _layout((self.indptr, self.indices))
        self._distinct_cells = distinct_cells
        watch_pattern(self)

    def distinct_cells(self) -> int:
        """How many distinct (row, column) cells the pattern holds: ``nnz`` unless it has
        duplicate entries. Counted on the device with one read-back the first time, unless
        known from how the pattern was made."""
        if self._distinct_cells is None:
            self._distinct_cells = count_distinct(self.row_ids(), self.indices, self.in_features)
        return self._distinct_cells

    @property
    def nnz(self) -> int:
        return self.indices.shape[0]

    @property
    def device(self) -> torch.device:
        return self.indptr.device

    @property
    def density(self) -> float:
        cells = self.in_features * self.out_features
        return self.nnz / cells if cells else 0.0

    def row_ids(self) -> torch.Tensor:
        """The target row of every edge (int64), in edge order."""
        return csr_row_ids(self.indptr, self.nnz)

    def by_source(self) -> BySource:
        """The by-source CSR, built on the pattern's device from torch ops on first call."""
        if self._by_source is None:
            self._by_source = build_by_source(self.indptr, self.indices, self.in_features)
            self._fingerprints = fingerprints(self.indptr, self.indices, self._by_source)
            self._layout = _layout((self.indptr, self.indices, *self._by_source))
        return self._by_source

    def fingerprints(self, with_source: bool) -> torch.Tensor:
        """The fingerprints the ops check the arrays against: ``(1,)`` int64 for
        ``(indptr, indices)``, ``(2,)`` with the by-source CSR's (``with_source``)."""
        if with_source:
            self.by_source()
            return self._fingerprints
        return self._fingerprints[:1]

    def changed(self) -> bool:
        """Whether any index array (``indptr``, ``indices``, the by-source CSR if built) was
        written, or swapped for another through ``.data``, since it was validated or built.
        One pass over them and one device read-back."""
        stale = self.contents_changed_on_device()
        return True if stale is None else bool(stale)

    def contents_changed_on_device(self) -> Optional[torch.Tensor]:
        """:meth:`changed` without the read-back: a 0-d bool tensor on the pattern's device,
        or None when an array's shape, dtype or device changed (seen on the host)."""
        arrays = (self.indptr, self.indices, *(self._by_source or ()))
        if _layout(arrays) != self._layout:
            return None
        now = fingerprints(self.indptr, self.indices, self._by_source)
        return (now != self._fingerprints).any()

    def to(self, device: torch.device) -> "CSRPattern":
        device = torch.device(device)
        if device == self.device:
            return self
        # The fingerprints move too: a copy of arrays written behind torch's back still
        # shows as changed.
        moved = copy.copy(self)
        moved.indptr, moved.indices, moved._fingerprints = (
            t.to(device) for t in (self.indptr, self.indices, self._fingerprints))
        if self._by_source is not None:
            moved._by_source = BySource(*(t.to(device) for t in self._by_source))
        moved._layout = _layout((moved.indptr, moved.indices, *(moved._by_source or ())))
        watch_pattern(moved)
        return moved

    def __repr__(self) -> str:
        return (f"CSRPattern(out_features={self.out_features}, in_features={self.in_features}, "
                f"nnz={self.nnz}, device={self.device})")


class IndexArrays(NamedTuple):
    """A pattern as the ops take it: the arrays, unvalidated, and the fingerprints they
    must match. What a ``SparseLinear`` passes from its buffers under ``torch.compile``,
    and what the kernels of the ops see; duck-typed like :class:`CSRPattern` for them."""
    indptr: torch.Tensor
    indices: torch.Tensor
    in_features: int
    source: Optional[BySource]   # None: built when needed
    known: torch.Tensor          # the fingerprints: (1,), or (2,) with ``source``

    @property
    def nnz(self) -> int:
        return self.indices.shape[0]

    @property
    def out_features(self) -> int:
        return self.indptr.shape[0] - 1

    def by_source(self) -> BySource:
        return self.source if self.source is not None else build_by_source(
            self.indptr, self.indices, self.in_features)

    def fingerprints(self, with_source: bool) -> torch.Tensor:
        return self.known if with_source else self.known[:1]

    def changed(self, out_features: Optional[int] = None) -> bool:
        """Whether the arrays are not what the kernels were promised: :meth:`layout_changed`,
        or contents that no longer match the fingerprints (one pass and one read-back)."""
        if self.layout_changed(out_features):
            return True
        now = fingerprints(self.indptr, self.indices, self.source)
        return bool((now != self.known).any())

    def layout_changed(self, out_features: Optional[int] = None) -> bool:
        """Whether the arrays have another dtype, layout or device than the kernels were
        promised, or lengths that disagree with each other (or with ``out_features``):
        what the host sees without reading them."""
        src = () if self.source is None else tuple(self.source)
        arrays = (self.indptr, self.indices, *src)
        device = self.indptr.device
        if any(a.dtype != torch.int32 or a.dim() != 1 or not a.is_contiguous()
               or a.device != device for a in arrays) \
                or self.known.shape != (1 + bool(src),) or self.known.device != device \
                or self.indptr.shape[0] == 0 \
                or (out_features is not None and self.indptr.shape[0] != out_features + 1):
            return True
        return bool(src) and (src[0].shape[0] != self.in_features + 1
                              or src[1].shape[0] != self.nnz or src[2].shape[0] != self.nnz)


def _layout(arrays: Sequence[torch.Tensor]) -> Tuple:
    """What the kernels assume of each array besides its contents."""
    return tuple((a.shape, a.dtype, a.device, a.is_contiguous()) for a in arrays)


def _fingerprint(arrays: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d int64 tensor on the arrays' device summarising their contents: the sum of
    every entry times an odd weight, 2j + 1 for the j-th entry of the concatenation
    (wrapping modulo 2**64). Changing any one entry, or swapping two, always changes it."""
    total = torch.zeros((), dtype=torch.int64, device=arrays[0].device)
    offset = 0
    for a in arrays:
        n = a.numel()
        weights = torch.arange(n, dtype=torch.int64, device=a.device) * 2 + (2 * offset + 1)
        total = total + (a.to(torch.int64) * weights).sum()
        offset += n
    return total


def fingerprints(indptr: torch.Tensor, indices: torch.Tensor,
                 source: Optional[BySource] = None) -> torch.Tensor:
    """``(1,)`` int64: the fingerprint of ``(indptr, indices)``; ``(2,)`` with the
    by-source CSR's. Torch ops only, no read-back."""
    parts = [_fingerprint((indptr, indices))]
    if source is not None:
        parts.append(_fingerprint(source))
    return torch.stack(parts)


def count_distinct(rows: torch.Tensor, cols: torch.Tensor, n_cols: int) -> int:
    """How many distinct (row, column) cells the entries ``(rows[e], cols[e])`` hold: one
    sort on the device and one read-back."""
    cells, _ = torch.sort(rows.long() * max(n_cols, 1) + cols.long())
    repeats = (cells[1:] == cells[:-1]).sum() if cells.numel() > 1 else torch.zeros(())
    return cells.numel() - int(repeats)


def build_by_source(indptr: torch.Tensor, indices: torch.Tensor, in_features: int) -> BySource:
    # A stable sort keeps each source's edges in target-row order, so the by-source walk
    # reads grad_output rows in increasing order (and the result is deterministic).
    sorted_sources, perm = torch.sort(indices.long(), stable=True)
    # Where each source's run of edges starts: searchsorted instead of bincount + cumsum,
    # which works on every device torch has and for nnz = 0.
    boundaries = torch.arange(in_features + 1, device=indices.device)
    src_indptr = torch.searchsorted(sorted_sources, boundaries)
    rows = csr_row_ids(indptr, indices.shape[0])[perm]
    return BySource(src_indptr.to(torch.int32), rows.to(torch.int32), perm.to(torch.int32))


# ---------------------------------------------------------------------------------------
# Public entry points


def sparse_linear(input: torch.Tensor, indptr: torch.Tensor, indices=None,
                  values: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                  *, activation: Optional[str] = None,
                  deterministic: Optional[bool] = None) -> torch.Tensor:
    """``act(input @ W.T + bias)`` where ``W`` is the CSR matrix ``(indptr, indices, values)``.

    Two forms: ``sparse_linear(input, indptr, indices, values, bias=None)``, or
    ``sparse_linear(input, weight, bias=None)`` as ``torch.nn.functional.linear``, with
    ``weight`` a torch sparse CSR tensor or a sparse COO tensor (coalesced and converted to
    CSR on each call), ``(out_features, in_features)``: the gradient of a weight that
    requires grad is a sparse tensor with its pattern, as ``torch.sparse.mm`` gives.

    Args:
        input: ``(*, in_features)``, floating point.
        indptr: ``(out_features + 1,)`` int32 (int64 accepted), row ``r``'s edges are
            ``indptr[r]:indptr[r + 1]``.
        indices: ``(nnz,)`` int32 (int64 accepted), source neuron of each edge.
        values: ``(nnz,)`` weights, the dtype of ``input``.
        bias: ``(out_features,)`` or None.
        activation: None, ``"relu"``, ``"gelu"`` (the tanh approximation, i.e.
            ``torch.nn.functional.gelu(z, approximate="tanh")``) or ``"tanh"``; fused into
            the forward kernel, and its derivative into the one backward dispatch.
        deterministic: the backward kernel: False sums the weight and bias gradients over
            the batch with atomics (their last bits vary run to run), True in a fixed
            order (bit-identical runs); None follows
            ``torch.are_deterministic_algorithms_enabled()``.

    Returns:
        ``(*, out_features)``. Differentiable in ``input``, ``values`` and ``bias``.

    The pattern is validated on every call (one small device read-back) and transposed
    for every backward; to do both once, build a :class:`CSRPattern` and call
    :func:`sparse_linear_pattern` (``SparseLinear`` does). ``indptr`` and ``indices`` are
    saved for backward: an in-place change before it raises torch's usual error.
    """
    if is_sparse_weight(indptr):
        if values is not None or bias is not None:
            raise TypeError(f"{OP}: with a sparse weight the call is sparse_linear(input, "
                            "weight, bias=None); got more arguments")
        weight, bias = indptr, indices
        indptr, indices, values, (_, in_features) = sparse_weight_parts(OP, weight)
        V.check_tensor(OP, "input", input)
        if input.dim() and input.shape[-1] != in_features:
            raise ValueError(f"{OP}: input has {input.shape[-1]} features in its last "
                             f"dimension but the weight is {tuple(weight.shape)} (out_features, "
                             "in_features)")
    elif indices is None or values is None:
        raise TypeError(f"{OP}: expected (input, indptr, indices, values, bias=None) or "
                        "(input, weight, bias=None) with weight a torch sparse CSR or COO "
                        f"tensor; got indptr of type {type(indptr).__name__} and "
                        f"{'no indices' if indices is None else 'no values'}")
    for name, t in (("input", input), ("indptr", indptr), ("indices", indices)):
        V.check_tensor(OP, name, t)
    if input.dim() == 0:
        raise ValueError(f"{OP}: input must have at least 1 dimension (*, in_features), "
                         "got a 0-D tensor")
    V.check_same_device(OP, {"input": input, "indptr": indptr, "indices": indices})
    check_activation(OP, activation)
    pattern = CSRPattern(indptr, indices, input.shape[-1])
    return apply_pattern(input, pattern, values, bias, activation=activation,
                         deterministic=deterministic)


def sparse_linear_pattern(input: torch.Tensor, pattern: CSRPattern, values: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, *,
                          activation: Optional[str] = None,
                          deterministic: Optional[bool] = None) -> torch.Tensor:
    """:func:`sparse_linear` with a prepared :class:`CSRPattern`, validated when it was built:
    no read-back. A pattern is immutable; a write to its arrays that bypasses torch's
    version counter is found by :func:`~torch_sparse_metal.check_errors` (or, when it puts
    an index out of range, by the kernels: NaN outputs). In strict mode
    (:class:`~torch_sparse_metal.check_invariants`) each call first checks that the arrays
    did not change (one pass over them and one read-back) and raises ValueError if they
    did, as :meth:`CSRPattern.changed` cannot tell whether the change is valid."""
    if not isinstance(pattern, CSRPattern):
        raise TypeError(f"{OP}: pattern must be a CSRPattern, got {type(pattern).__name__}")
    if check_invariants.is_enabled() and pattern.changed():
        raise ValueError(f"{OP}: {_CHANGED}; build a new CSRPattern from them")
    return apply_pattern(input, pattern, values, bias, activation=activation,
                         deterministic=deterministic)


_CHANGED = ("the pattern's index arrays were written since it was validated, bypassing "
            "torch's version counter (through .data or .numpy(), say)")


def apply_pattern(input: torch.Tensor, pattern: "CSRPattern | IndexArrays", values: torch.Tensor,
                  bias: Optional[torch.Tensor] = None, *, activation: Optional[str] = None,
                  deterministic: Optional[bool] = None, verify: bool = False,
                  op: str = OP) -> torch.Tensor:
    """:func:`sparse_linear_pattern` for a pattern the caller vouches for (validated, and in
    strict mode checked unchanged since), or, with ``verify`` (a ``SparseLinear`` under
    ``torch.compile`` in strict mode, ``pattern`` an :class:`IndexArrays` of its buffers),
    one the op checks against its fingerprints. The backward op checks them too in strict
    mode. ``op`` starts the error messages (the public function that was called)."""
    check_activation(op, activation)
    for name, t in (("input", input), ("values", values)):
        V.check_tensor(op, name, t)
        V.check_floating(op, name, t)
    if bias is not None:
        V.check_tensor(op, "bias", bias)
        V.check_floating(op, "bias", bias)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    elif not isinstance(deterministic, bool):
        raise TypeError(f"{op}: deterministic must be True, False or None, got {deterministic!r}")
    V.check_same_device(op, {"input": input, "values": values, "bias": bias,
                             "indptr": pattern.indptr})
    dtype = kernel_dtype(op, {"input": input, "values": values, "bias": bias})
    V.check_length(op, "values", values, pattern.nnz, "nnz = len(indices)")
    if bias is not None:
        V.check_length(op, "bias", bias, pattern.out_features, "out_features = len(indptr) - 1")
    x, lead = V.flat_batch(op, "input", input, pattern.in_features, contiguous=False)

    backend = resolve_backend(op, (input, values, bias),
                              kernels=lambda: library_kernels(SHADER, KERNELS, dtype))

    def on_reference() -> torch.Tensor:
        return sparse_linear_reference(*cast_for_reference(x.device, x, pattern.indptr,
                                                           pattern.indices, values, bias),
                                       activation=activation)

    def on_kernels() -> torch.Tensor:
        require_kernel_dtype(op, dtype, backend, DTYPES)
        batch = x.shape[0]
        V.check_fits_uint32(op, "batch * in_features", batch * pattern.in_features)
        V.check_fits_uint32(op, "batch * out_features", batch * pattern.out_features)
        need_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, values, bias))
        # The by-source CSR only when a backward may come (the op saves it for that).
        src = tuple(pattern.by_source()) if need_grad else (_no_array(x),) * 3
        # The batch-lanes kernels write (features, batch) activations: the op returns the
        # output so, and its transpose here is a view. The kernels read the input so: a
        # copy inside the op unless it is in that layout already (the output of another
        # sparse_linear), so that a network converts its input once.
        features_major = lanes_along_batch(batch, deterministic)
        out, _ = _SPARSE_LINEAR(x, pattern.indptr, pattern.indices, values, bias, *src,
                                pattern.fingerprints(need_grad), activation, deterministic,
                                need_grad and activation == "gelu", verify,
                                check_invariants.is_enabled(), features_major)
        return out.t() if features_major else out

    out = kernels_or_reference(op, backend, on_kernels, on_reference)
    return out.reshape(*lead, pattern.out_features)


def _no_array(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int32, device=like.device)


# ---------------------------------------------------------------------------------------
# The ops


def _forward_kernel(input, indptr, indices, values, bias, src_indptr, src_rows, src_perm,
                    fingerprints, activation, deterministic, save_preact, verify, strict,
                    features_major, *, backend):
    arrays = _index_arrays(input.shape[1], indptr, indices, src_indptr, src_rows, src_perm,
                           fingerprints)
    if arrays.layout_changed() or (verify and arrays.changed()):
        raise ValueError(f"{OP}: {_CHANGED}; under torch.compile they cannot be validated "
                         "again inside the graph: call the SparseLinear's pattern() (or run "
                         "it once) outside the compiled code to validate them")
    out, preact = _forward(_features_major(input) if features_major else input.contiguous(),
                           arrays, values.contiguous(),
                           None if bias is None else bias.contiguous(), backend, activation,
                           save_preact=save_preact, features_major=features_major)
    return out, preact if preact is not None else _custom_ops.empty_like_none(out)


def _forward_fake(input, indptr, indices, values, bias, src_indptr, src_rows, src_perm,
                  fingerprints, activation, deterministic, save_preact, verify, strict,
                  features_major):
    out_features = indptr.shape[0] - 1
    out = input.new_empty((out_features, input.shape[0]) if features_major
                          else (input.shape[0], out_features))
    return out, (input.new_empty(out.shape) if save_preact else input.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    (input, indptr, indices, values, bias, src_indptr, src_rows, src_perm, fingerprints,
     activation, deterministic, save_preact, _, strict, features_major) = inputs
    need_input, need_values = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
    ctx.in_features = input.shape[1]
    ctx.features_major = features_major
    # grad_input is given in the input's layout (as autograd would copy it to for a leaf).
    ctx.input_features_major = features_major and input.t().is_contiguous()
    ctx.activation = activation
    ctx.deterministic = deterministic
    ctx.strict = strict
    ctx.has_bias = bias is not None
    ctx.save_preact = save_preact
    # Save what backward reads: x for grad_values, values for grad_input, for the
    # activation's derivative the output (relu, tanh) or pre-activation (gelu), and the
    # index arrays with their fingerprints, so that torch's version counter guards them
    # all and the backward op can check what it cannot see.
    act_saved = None
    if activation is not None:
        act_saved = output[1] if activation == "gelu" else output[0]
    ctx.save_for_backward(input if need_values else None, values if need_input else None,
                          act_saved, indptr, indices, src_indptr, src_rows, src_perm,
                          fingerprints)
    # A gradient into the pre-activation arrives in a double backward through gelu's
    # derivative (act_saved is that output): None, not zeros, tells when it did not.
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, grad_output, grad_preact):
    x, values, act_saved, *arrays = ctx.saved_tensors  # raises if one was modified in place
    need_input, need_values = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
    need_bias = ctx.needs_input_grad[4] and ctx.has_bias
    activation = ctx.activation
    if grad_preact is not None and ctx.save_preact:
        # d loss / d z is then the activation's backward of grad_output plus grad_preact,
        # a sum the fused kernel cannot form: the activation's part runs in torch.
        if grad_output is not None:
            grad_preact = grad_preact + activation_backward_reference(grad_output, act_saved,
                                                                      activation)
        grad_output, act_saved, activation = grad_preact, None, None
    elif grad_output is None:
        return (None,) * 15
    grad_input, grad_values, grad_bias = _SPARSE_LINEAR_BACKWARD(
        grad_output, x, values, act_saved, *arrays, ctx.in_features, activation,
        ctx.deterministic, need_input, need_values, need_bias, ctx.features_major, ctx.strict)
    if need_input and ctx.features_major:  # (in_features, batch) from the kernel
        grad_input = grad_input.t() if ctx.input_features_major else grad_input.t().contiguous()
    return ((grad_input if need_input else None), None, None,
            (grad_values if need_values else None), (grad_bias if need_bias else None),
            None, None, None, None, None, None, None, None, None, None)


def _backward_kernel(grad_output, input, values, act_saved, indptr, indices, src_indptr,
                     src_rows, src_perm, fingerprints, in_features, activation, deterministic,
                     need_input, need_values, need_bias, features_major, strict, *, backend):
    batch, out_features = grad_output.shape[::-1] if features_major else grad_output.shape
    arrays = _index_arrays(in_features, indptr, indices, src_indptr, src_rows, src_perm,
                           fingerprints)
    if arrays.layout_changed(out_features) or (strict and arrays.changed(out_features)):
        raise ValueError(f"{OP} backward: {_CHANGED} after the forward pass; run the "
                         "forward pass again")
    # `t.data = other` swaps a saved tensor for another without a version bump: the
    # kernel must not read it with the forward's sizes.
    expected = {"input": (input, (batch, in_features)),
                "values": (values, (arrays.nnz,)),
                "activation's output": (act_saved, (out_features, batch) if features_major
                                        else (batch, out_features))}
    for name, (t, shape) in expected.items():
        if t is not None and (tuple(t.shape) != shape or t.dtype != grad_output.dtype):
            raise ValueError(f"{OP} backward: the {name} saved by the forward pass was "
                             f"replaced since (now shape {tuple(t.shape)}, dtype {t.dtype}; "
                             f"expected {shape}, {grad_output.dtype}), bypassing torch's "
                             "version counter (through .data); run the forward pass again")
    if features_major and input is not None:
        input = _features_major(input)
    grads = _backward(grad_output.contiguous(), _contiguous(input), _contiguous(values),
                      arrays, backend, need_input=need_input, need_values=need_values,
                      need_bias=need_bias, activation=activation,
                      act_saved=_contiguous(act_saved), deterministic=deterministic,
                      features_major=features_major)
    return tuple(g if g is not None else _custom_ops.empty_like_none(grad_output)
                 for g in grads)


def _backward_fake(grad_output, input, values, act_saved, indptr, indices, src_indptr,
                   src_rows, src_perm, fingerprints, in_features, activation, deterministic,
                   need_input, need_values, need_bias, features_major, strict):
    batch, out_features = grad_output.shape[::-1] if features_major else grad_output.shape
    grad_input = (in_features, batch) if features_major else (batch, in_features)
    sizes = (grad_input if need_input else (0,),
             (indices.shape[0],) if need_values else (0,),
             (out_features,) if need_bias else (0,))
    return tuple(grad_output.new_empty(size) for size in sizes)


def _backward_setup_context(ctx, inputs, output) -> None:
    (grad_output, input, values, act_saved, *arrays, in_features, activation, deterministic,
     need_input, need_values, need_bias, features_major, strict) = inputs
    ctx.in_features = in_features
    ctx.activation = activation
    ctx.deterministic = deterministic
    ctx.features_major = features_major
    ctx.strict = strict
    ctx.computed = (need_input, need_values, need_bias)
    ctx.save_for_backward(grad_output, input, values, act_saved, *arrays)
    ctx.set_materialize_grads(False)  # a gradient not asked for is not a kernel launch


def _backward_backward(ctx, gg_input, gg_values, gg_bias):
    """The VJP of ``sparse_linear_backward``, in the package's ops (themselves differentiable,
    so any order works). With ``gz`` the gradient at the pre-activation the kernel forms
    (``activation_backward(grad_output, act_saved)``), ``W`` the pattern holding ``values``
    and ``G`` the one holding ``gg_values``, the kernel computes ``grad_input = gz @ W``,
    ``grad_values[e] = sum_b gz[b, row e] * input[b, col e]`` and ``grad_bias = sum_b gz``;
    so ``d/d gz = gg_input @ W.T + input @ G.T + gg_bias`` (two forward products),
    ``d/d input = gz @ G`` and ``d/d values`` the edges' ``gz * gg_input`` sums (one backward
    launch with ``G`` as its weights and ``gg_input`` as its input), and the activation's
    terms follow from ``d/d gz`` by torch's own derivatives of its backward formulas."""
    grad_output, x, values, act_saved, *arrays = ctx.saved_tensors
    # A placeholder output (not computed) has no gradient to pass on.
    gg_input, gg_values, gg_bias = (g if computed else None for g, computed
                                    in zip((gg_input, gg_values, gg_bias), ctx.computed))
    need_grad_output, need_input, need_values, need_act_saved = ctx.needs_input_grad[:4]
    features_major, activation = ctx.features_major, ctx.activation
    # grad_input came out (in_features, batch) features-major; the ops take (batch, in_features).
    gg_x = gg_input.t() if gg_input is not None and features_major else gg_input

    gg_z, bias = None, gg_bias
    if need_grad_output or need_act_saved:
        for inp, vals in ((gg_x, values), (x, gg_values)):
            if inp is not None and vals is not None:
                term, _ = _SPARSE_LINEAR(inp, *arrays[:2], vals, bias, *arrays[2:], None,
                                         ctx.deterministic, False, ctx.strict, ctx.strict,
                                         features_major)
                gg_z, bias = (term if gg_z is None else gg_z + term), None
        if bias is not None:  # only grad_bias reached the loss
            gg_z = (bias[:, None] if features_major else bias).expand_as(grad_output)

    want_x = need_input and gg_values is not None
    want_values = need_values and gg_x is not None
    grad_x = grad_values = None
    if want_x or want_values:
        gz = activation_backward_reference(grad_output, act_saved, activation)
        grad_x, grad_values, _ = _SPARSE_LINEAR_BACKWARD(
            gz, gg_x if want_values else None, gg_values if want_x else None, None, *arrays,
            ctx.in_features, None, ctx.deterministic, want_x, want_values, False,
            features_major, ctx.strict)
        grad_x = (grad_x.t() if features_major else grad_x) if want_x else None
        grad_values = grad_values if want_values else None

    grad_grad_output = grad_act_saved = None
    if gg_z is not None:
        if need_grad_output:
            grad_grad_output = activation_backward_reference(gg_z, act_saved, activation)
        if need_act_saved and activation is not None:
            grad_act_saved = _activation_backward_vjp(gg_z, grad_output, act_saved, activation)
    return (grad_grad_output, grad_x, grad_values, grad_act_saved) + (None,) * 14


def _activation_backward_vjp(cotangent: torch.Tensor, grad: torch.Tensor, saved: torch.Tensor,
                             activation: str) -> torch.Tensor:
    """``d/d saved`` of ``<cotangent, activation_backward_reference(grad, saved)>`` by torch's
    own derivatives of its backward ops (gelu's second derivative), through autograd; with
    the graph kept under ``create_graph`` (grad mode is on in that backward)."""
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        if create_graph and saved.requires_grad:
            # A new node, so that the derivative is in this argument alone: grad may depend
            # on saved too (tanh's saved output feeds the loss), a path not to be counted.
            saved = saved.view_as(saved)
        else:
            saved = saved.detach().requires_grad_()
            grad = grad if create_graph else grad.detach()
        grad_z = activation_backward_reference(grad, saved, activation)
        return torch.autograd.grad(grad_z, saved, cotangent, create_graph=create_graph)[0]


def _index_arrays(in_features, indptr, indices, src_indptr, src_rows, src_perm,
                  fingerprints) -> IndexArrays:
    source = BySource(src_indptr, src_rows, src_perm) if src_indptr.numel() else None
    return IndexArrays(indptr, indices, in_features, source, fingerprints)


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


_SPARSE_LINEAR = _custom_ops.define(
    "sparse_linear(Tensor input, Tensor indptr, Tensor indices, Tensor values, Tensor? bias, "
    "Tensor src_indptr, Tensor src_rows, Tensor src_perm, Tensor fingerprints, "
    "str? activation, bool deterministic, bool save_preact, bool verify, bool strict, "
    "bool features_major) -> (Tensor, Tensor)",
    _forward_kernel, _forward_fake, backward=_backward_formula, setup_context=_setup_context,
    autocast=True)
_SPARSE_LINEAR_BACKWARD = _custom_ops.define(
    "sparse_linear_backward(Tensor grad_output, Tensor? input, Tensor? values, "
    "Tensor? act_saved, Tensor indptr, Tensor indices, Tensor src_indptr, Tensor src_rows, "
    "Tensor src_perm, Tensor fingerprints, SymInt in_features, str? activation, "
    "bool deterministic, bool need_input, bool need_values, bool need_bias, "
    "bool features_major, bool strict) -> (Tensor, Tensor, Tensor)",
    _backward_kernel, _backward_fake, backward=_backward_backward,
    setup_context=_backward_setup_context)


# ---------------------------------------------------------------------------------------
# Kernel launches


def _features_major(t: torch.Tensor) -> torch.Tensor:
    """(batch, features) -> its (features, batch) transpose, contiguous: no copy when ``t``
    is in that layout already."""
    return t.t().contiguous()


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    """A buffer for a kernel parameter the flags say is never touched."""
    return torch.empty(1, dtype=like.dtype, device=like.device)


def _forward(x: torch.Tensor, pattern: "CSRPattern | IndexArrays", values: torch.Tensor,
             bias: Optional[torch.Tensor], backend: str, activation: Optional[str] = None,
             *, save_preact: bool = False,
             features_major: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(output, pre-activation if save_preact else None)``: ``x`` and both results
    ``(batch, features)``, or ``(features, batch)`` with ``features_major`` (the
    batch-lanes kernel)."""
    batch, out_features = x.shape[1 if features_major else 0], pattern.out_features
    shape = (out_features, batch) if features_major else (batch, out_features)
    if batch == 0 or out_features == 0 or pattern.nnz == 0:
        preact = x.new_zeros(shape)
        if bias is not None:
            preact.add_(bias[:, None] if features_major else bias)
        return apply_activation(preact, activation), (preact if save_preact else None)
    out = x.new_empty(shape)
    preact = x.new_empty(shape) if save_preact else None
    placeholder = _placeholder(x)
    if features_major:
        kernel, threads = "sparse_linear_forward_batch_lanes", out_features * SIMD_WIDTH
        V.check_fits_uint32(OP, "out_features * 32", threads)
    else:
        kernel, threads = "sparse_linear_forward", batch * out_features
    args = (x, pattern.indptr, pattern.indices, values,
            bias if bias is not None else placeholder, out,
            np.uint32(batch), np.uint32(pattern.in_features), np.uint32(out_features),
            np.uint32(bias is not None),
            preact if save_preact else placeholder,
            np.uint32(ACTIVATION_CODES[activation]), np.uint32(save_preact),
            np.uint32(pattern.nnz), error_word(x.device))
    _launch.launch(SHADER, kernel_name(kernel, x.dtype), args,
                   threads=threads, group_size=GROUP_SIZE, backend=backend)
    return out, preact


def _backward(grad_out: torch.Tensor, x: Optional[torch.Tensor], values: Optional[torch.Tensor],
              pattern: "CSRPattern | IndexArrays", backend: str, *, need_input: bool,
              need_values: bool, need_bias: bool, activation: Optional[str] = None,
              act_saved: Optional[torch.Tensor] = None, deterministic: bool = False,
              features_major: bool = False) -> Tuple[Optional[torch.Tensor], ...]:
    """``(grad_input, grad_values, grad_bias)``, each None unless needed; ``grad_out``,
    ``x``, ``act_saved`` and ``grad_input`` are ``(batch, features)``, or
    ``(features, batch)`` with ``features_major`` (the batch-lanes kernel)."""
    batch = grad_out.shape[1 if features_major else 0]
    in_features, out_features = pattern.in_features, pattern.out_features
    empty = batch == 0 or pattern.nnz == 0
    atomic = not empty and (features_major or not deterministic)
    # The atomic kernels add into zeros of the accumulator type (float32 for the 2-byte
    # types, rounded once below); the deterministic one writes every element.
    if atomic:
        acc_dtype = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
        new = functools.partial(torch.zeros, dtype=acc_dtype, device=grad_out.device)
    else:
        new = grad_out.new_zeros if empty else grad_out.new_empty
    grad_input = grad_out.new_empty((in_features, batch) if features_major
                                    else (batch, in_features)) if need_input else None
    grad_values = new(pattern.nnz) if need_values else None
    grad_bias = new(out_features) if need_bias else None

    if empty:
        # Nothing flows through edges; only grad_bias can be nonzero (a plain column sum).
        if grad_input is not None:
            grad_input.zero_()
        if grad_bias is not None:
            if activation is not None:
                grad_out = activation_backward_reference(grad_out, act_saved, activation)
            torch.sum(grad_out, dim=1 if features_major else 0, out=grad_bias)
        return grad_input, grad_values, grad_bias

    if backend == "metal":  # the shader's atomic kernel needs them to compile at all
        from .._metal_backend import require_native_float_atomics
        require_native_float_atomics(f"{OP} backward")
    # nnz > 0 here, so in_features and out_features are both > 0.
    neurons = max(in_features if (need_input or need_values) else 0,
                  out_features if need_bias else 0)
    if features_major:
        kernel = "sparse_linear_backward_batch_lanes"
        threads = neurons * SIMD_WIDTH
        V.check_fits_uint32(OP, "max(in_features, out_features) * 32", threads)
        shape_args = (np.uint32(neurons),)
    elif deterministic:
        kernel = "sparse_linear_backward_deterministic"
        threads = (batch * in_features * need_input + pattern.nnz * need_values
                   + out_features * need_bias)
        V.check_fits_uint32(OP, "batch * in_features + nnz + out_features", threads)
        shape_args = (np.uint32(pattern.nnz),)
    else:
        kernel = "sparse_linear_backward"
        threads = batch * neurons
        V.check_fits_uint32(OP, "batch * max(in_features, out_features)", threads)
        shape_args = (np.uint32(neurons),)
    src = pattern.by_source()
    placeholder = _placeholder(grad_out)
    args = (grad_out,
            x if need_values else placeholder,
            values if need_input else placeholder,
            src.indptr, src.rows, src.perm,
            grad_input if need_input else placeholder,
            grad_values if need_values else placeholder,
            grad_bias if need_bias else placeholder,
            np.uint32(batch), np.uint32(in_features), np.uint32(out_features),
            *shape_args,
            np.uint32(need_input), np.uint32(need_values), np.uint32(need_bias),
            act_saved if activation is not None else placeholder,
            np.uint32(ACTIVATION_CODES[activation]))
    if not deterministic:
        args += (np.uint32(pattern.nnz),)
    args += (error_word(grad_out.device),)
    _launch.launch(SHADER, kernel_name(kernel, grad_out.dtype), args,
                   threads=threads, group_size=GROUP_SIZE, backend=backend)
    return grad_input, _to(grad_values, grad_out.dtype), _to(grad_bias, grad_out.dtype)


def _to(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else t.to(dtype)
