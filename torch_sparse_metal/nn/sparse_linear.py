"""``SparseLinear``: ``nn.Linear`` with a fixed CSR sparsity pattern."""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np
import torch
from torch import nn

from .. import _validation as V
from .._activations import check_activation
from ..formats import sparse_weight_parts
from ..checks import check_invariants
from ..ops.sparse_linear import BySource, CSRPattern, IndexArrays, apply_pattern

_MODULE = "SparseLinear"
# Below this many cells a random pattern comes from randperm (exact, O(cells) memory);
# above it, from rejection sampling (O(nnz) memory).
_RANDPERM_MAX_CELLS = 1 << 22


def random_csr_pattern(in_features: int, out_features: int, density: float, *,
                       generator: Optional[torch.Generator] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """A uniformly random pattern with ``round(density * in * out)`` distinct entries.

    Returns ``(indptr, indices)`` as int32 on the generator's device (CPU by default),
    columns sorted within each row. Rows may come out empty at low density.
    """
    density = V.check_number(_MODULE, "density", density, minimum=0, maximum=1)
    device = generator.device if generator is not None else torch.device("cpu")
    cells = in_features * out_features
    nnz = round(density * cells)
    if 2 * nnz <= cells:
        cells_chosen = _distinct_cells(cells, nnz, generator, device)
    else:  # sample the (fewer) empty cells instead
        keep = torch.ones(cells, dtype=torch.bool, device=device)
        keep[_distinct_cells(cells, cells - nnz, generator, device)] = False
        cells_chosen = keep.nonzero().squeeze(1)
    cells_chosen, _ = torch.sort(cells_chosen)
    rows = torch.div(cells_chosen, max(in_features, 1), rounding_mode="floor")
    indices = cells_chosen - rows * in_features
    counts = torch.bincount(rows, minlength=out_features)
    indptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    return indptr.to(torch.int32), indices.to(torch.int32)


def _distinct_cells(cells: int, k: int, generator: Optional[torch.Generator],
                    device: torch.device) -> torch.Tensor:
    """``k <= cells / 2`` distinct uniform draws from ``range(cells)``, int64, any order."""
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    if cells <= _RANDPERM_MAX_CELLS:
        return torch.randperm(cells, generator=generator, device=device)[:k]
    # With k <= cells / 2 each round keeps most of its draws. The distinct values of
    # i.i.d. uniform draws form a uniform random subset of their size, so a random
    # k-subset of them is a uniform k-subset of range(cells).
    chosen = torch.empty(0, dtype=torch.long, device=device)
    while chosen.numel() < k:
        n_draw = 2 * (k - chosen.numel()) + 16
        draws = torch.randint(cells, (n_draw,), generator=generator, device=device)
        chosen = torch.unique(torch.cat([chosen, draws]))
    pick = torch.randperm(chosen.numel(), generator=generator, device=device)[:k]
    return chosen[pick]


class SparseLinear(nn.Module):
    """``y = act(x @ W.T + b)`` with ``W`` (out_features x in_features) sparse in CSR form.

    Give exactly one of ``density`` (a random pattern with that fraction of nonzeros,
    drawn from ``generator`` if given) or ``indptr`` + ``indices`` (the pattern: row ``r``
    holds the source neurons ``indices[indptr[r]:indptr[r + 1]]`` of target neuron ``r``).

    ``activation`` (None, ``"relu"``, ``"gelu"`` = tanh approximation, ``"tanh"``) is fused
    into the forward kernel and its derivative into the one backward dispatch.
    ``deterministic`` picks the backward kernel as in :func:`~torch_sparse_metal.sparse_linear`:
    True gives bit-identical gradients run to run, None follows
    ``torch.are_deterministic_algorithms_enabled()``.

    Attributes:
        weight: ``(nnz,)`` the nonzero values, in CSR order.
        bias: ``(out_features,)`` or None.
        indptr, indices: the pattern (int32 buffers, saved in the state dict).
        src_indptr, src_rows, src_perm: the same pattern indexed by source neuron, which
            the backward kernel walks (derived, not saved; rebuilt when the pattern changes).

    A training step reads nothing back from the device (no GPU sync on MPS). The pattern
    is validated and transposed again when its buffers change in a way torch sees (a new
    tensor, ``load_state_dict``, an in-place write). An edit torch's version counter does not
    see (``layer.indices.data[0] = 3``, a write through ``.numpy()``) is found by
    :func:`~torch_sparse_metal.check_errors` (which compares the buffers with a fingerprint
    taken when they were validated) and, when it puts an index out of range, by the kernels
    (NaN outputs); :meth:`pattern` validates and transposes it again. In strict mode
    (:class:`~torch_sparse_metal.check_invariants`) every forward compares the buffers with
    that fingerprint first (one read-back), as :meth:`pattern` does.

    Initialisation follows ``nn.Linear`` (uniform in ``+-1/sqrt(fan_in)``) with each row's
    real fan-in, its number of edges; rows without edges get a zero bias.

    ``load_state_dict`` accepts a state dict with a different pattern (another nnz): the
    buffers and ``weight`` are resized first. Optimizer state of ``weight`` then no longer
    fits: build the optimizer after loading.

    Other formats: :meth:`from_dense` prunes a trained ``nn.Linear`` by magnitude (or a
    mask), :meth:`from_sparse` takes a torch sparse CSR / COO tensor or a SciPy matrix, and
    :meth:`to_sparse_csr` / :meth:`to_dense` give ``W`` back.

    Under ``torch.compile`` the forward cannot validate and transpose a changed pattern
    again inside the graph: in strict mode the op compares the buffers with their
    fingerprints instead and raises ``ValueError`` if they were written behind torch's
    back. Edits made in eager code between compiled calls (``load_state_dict``,
    ``prune_and_regrow``) bring the pattern up to date themselves.
    """

    def __init__(self, in_features: int, out_features: int, *, density: Optional[float] = None,
                 indptr: Optional[torch.Tensor] = None, indices: Optional[torch.Tensor] = None,
                 bias: bool = True, activation: Optional[str] = None, device=None, dtype=None,
                 generator: Optional[torch.Generator] = None,
                 deterministic: Optional[bool] = None) -> None:
        super().__init__()
        self.activation = check_activation(_MODULE, activation)
        if deterministic is not None and not isinstance(deterministic, bool):
            raise TypeError(f"{_MODULE}: deterministic must be True, False or None, got "
                            f"{deterministic!r}")
        self.deterministic = deterministic
        in_features = V.check_int(_MODULE, "in_features", in_features, minimum=0)
        out_features = V.check_int(_MODULE, "out_features", out_features, minimum=0)
        has_pattern = indptr is not None or indices is not None
        if (density is not None) == has_pattern:
            raise ValueError(f"{_MODULE}: give exactly one of density or indptr + indices")
        if has_pattern and (indptr is None or indices is None):
            raise ValueError(f"{_MODULE}: indptr and indices go together; got only "
                             f"{'indptr' if indices is None else 'indices'}")
        self.in_features = in_features
        self.out_features = out_features
        if density is not None:
            indptr, indices = random_csr_pattern(in_features, out_features, density,
                                                 generator=generator)
            # Valid and free of duplicates by construction.
            pattern = CSRPattern.trusted(indptr, indices, in_features,
                                         distinct_cells=indices.shape[0])
        else:
            pattern = CSRPattern(indptr, indices, in_features, out_features=out_features,
                                 op=_MODULE)

        self.weight = nn.Parameter(torch.empty(pattern.nnz, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        pattern = pattern.to(self.weight.device)
        self.register_buffer("indptr", pattern.indptr)
        self.register_buffer("indices", pattern.indices)
        src = pattern.by_source()
        self.register_buffer("src_indptr", src.indptr, persistent=False)
        self.register_buffer("src_rows", src.rows, persistent=False)
        self.register_buffer("src_perm", src.perm, persistent=False)
        # What the op checks the five index buffers against under torch.compile.
        self.register_buffer("pattern_fingerprints", pattern.fingerprints(True),
                             persistent=False)
        self._pattern = pattern
        self._pattern_key = self._buffers_key()
        self.reset_parameters(generator=generator)

    # -- pattern bookkeeping -------------------------------------------------------------

    def _buffers_key(self) -> tuple:
        # A new tensor (.to(), assignment) changes the pointer; an in-place write
        # (load_state_dict's copy_, user edits) bumps the version.
        return tuple((t.device, t.data_ptr(), t._version, t.shape, t.dtype)
                     for t in (self.indptr, self.indices))

    def pattern(self) -> CSRPattern:
        """The current pattern; validated and transposed again only after it changed,
        including through a write torch's version counter does not see (one read-back)."""
        return self._current_pattern(read_back=True)

    def _current_pattern(self, read_back: bool) -> CSRPattern:
        """The pattern, rebuilt when its buffers changed as torch sees them (another tensor,
        a version bump), or, with ``read_back``, as their fingerprint does."""
        if self._buffers_key() != self._pattern_key or (read_back and self._pattern.changed()):
            self._adopt_pattern(CSRPattern(self.indptr, self.indices, self.in_features,
                                           out_features=self.out_features, op=_MODULE))
        return self._pattern

    def _adopt_pattern(self, pattern: CSRPattern) -> None:
        """Make ``pattern`` (valid, ``out_features x in_features``, nnz the weight's) the
        layer's: its arrays become the index buffers, its by-source CSR the derived ones
        (built on the device if the pattern has none yet: no read-back)."""
        src: BySource = pattern.by_source()
        self.indptr, self.indices = pattern.indptr, pattern.indices  # int32 if they weren't
        self.src_indptr, self.src_rows, self.src_perm = src
        self.pattern_fingerprints = pattern.fingerprints(True)
        self._pattern = pattern
        self._pattern_key = self._buffers_key()

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """L2 norm of this layer's gradients (weight and bias) as the last step of a
        :class:`torch_sparse_metal.optim.AdamW` read them, or None before such a step.

        The step kernel leaves every parameter's squared gradient norm in a small device
        buffer; this reads two of its entries (on unified memory, no copy of a gradient).
        """
        from ..optim.adamw import grad_norm_of
        return grad_norm_of(p for p in (self.weight, self.bias) if p is not None)

    @property
    def nnz(self) -> int:
        return self.indices.shape[0]

    @property
    def density(self) -> float:
        cells = self.in_features * self.out_features
        return self.nnz / cells if cells else 0.0

    # -- nn.Module API -------------------------------------------------------------------

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Uniform in ``+-1/sqrt(fan_in)`` per row, fan_in = that row's number of edges."""
        pattern = self.pattern()
        # Sample where the generator lives (the weight's device without one), in float32
        # unless the weight is float64 (MPS has no float64).
        device = generator.device if generator is not None else self.weight.device
        dtype = torch.float64 if self.weight.dtype == torch.float64 else torch.float32
        fan_in = (pattern.indptr[1:] - pattern.indptr[:-1]).to(device=device, dtype=dtype)
        bound = torch.where(fan_in > 0, fan_in.clamp(min=1).rsqrt(), torch.zeros_like(fan_in))
        rows = pattern.row_ids().to(device)
        with torch.no_grad():
            u = torch.rand(self.nnz, generator=generator, device=device, dtype=dtype)
            self.weight.copy_((2 * u - 1) * bound[rows])
            if self.bias is not None:
                u = torch.rand(self.out_features, generator=generator, device=device, dtype=dtype)
                self.bias.copy_((2 * u - 1) * bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        strict = check_invariants.is_enabled()
        if torch.compiler.is_compiling():
            # No validation inside a graph: in strict mode the op checks the buffers against
            # their fingerprints (eager code validates and transposes them in pattern()).
            arrays = IndexArrays(self.indptr, self.indices, self.in_features,
                                 BySource(self.src_indptr, self.src_rows, self.src_perm),
                                 self.pattern_fingerprints)
            return apply_pattern(input, arrays, self.weight, self.bias, verify=strict,
                                 activation=self.activation, deterministic=self.deterministic)
        return apply_pattern(input, self._current_pattern(read_back=strict), self.weight,
                             self.bias, activation=self.activation,
                             deterministic=self.deterministic)

    def to_dense(self) -> torch.Tensor:
        """``W`` as a dense ``(out_features, in_features)`` tensor (differentiable)."""
        pattern = self.pattern()
        dense = self.weight.new_zeros(self.out_features, self.in_features)
        return dense.index_put((pattern.row_ids(), pattern.indices.long()), self.weight,
                               accumulate=True)

    def to_sparse_csr(self) -> torch.Tensor:
        """``W`` as a torch sparse CSR tensor ``(out_features, in_features)`` with int64
        indices, differentiable in ``weight``. Columns come sorted within each row and
        duplicate entries summed, as torch's CSR invariants require (for a pattern already
        so, the values are ``weight`` in order)."""
        pattern = self.pattern()
        cells = torch.stack([pattern.row_ids(), pattern.indices.long()])
        # The pattern was validated when it was set: torch's own check would only cost time.
        coo = torch.sparse_coo_tensor(cells, self.weight, (self.out_features, self.in_features),
                                      check_invariants=False)
        return coo.coalesce().to_sparse_csr()

    @classmethod
    def from_dense(cls, linear: Union[nn.Linear, torch.Tensor], *,
                   density: Optional[float] = None, mask: Optional[torch.Tensor] = None,
                   activation: Optional[str] = None,
                   deterministic: Optional[bool] = None) -> "SparseLinear":
        """A sparse layer from a trained dense one (an ``nn.Linear``, or a weight tensor
        ``(out_features, in_features)`` and no bias), by magnitude pruning.

        Give exactly one of ``density`` (keep the ``round(density * out * in)`` weights of
        largest magnitude; ties go to the lower row-major position) or ``mask`` (a bool
        ``(out_features, in_features)`` tensor, True where a weight is kept). The kept
        weights and the bias are copied (dtype and device follow the dense layer); the
        pattern is row-major with sorted columns.
        """
        if isinstance(linear, nn.Linear):
            weight, bias = linear.weight, linear.bias
        elif isinstance(linear, torch.Tensor) and linear.dim() == 2 \
                and linear.layout == torch.strided:
            weight, bias = linear, None
        else:
            raise TypeError(f"{_MODULE}.from_dense: expected an nn.Linear or a dense 2-D weight "
                            f"tensor, got {type(linear).__name__}")
        if (density is None) == (mask is None):
            raise ValueError(f"{_MODULE}.from_dense: give exactly one of density or mask")
        out_features, in_features = weight.shape
        w = weight.detach().reshape(-1)
        if density is not None:
            density = V.check_number(f"{_MODULE}.from_dense", "density", density,
                                     minimum=0, maximum=1)
            # Stable: among equal magnitudes the lower position wins.
            order = torch.argsort(w.abs(), descending=True, stable=True)
            cells, _ = torch.sort(order[:round(density * w.numel())])
        else:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool \
                    or tuple(mask.shape) != (out_features, in_features):
                raise ValueError(f"{_MODULE}.from_dense: mask must be a bool tensor of shape "
                                 f"(out_features, in_features) = {(out_features, in_features)}, "
                                 f"got {_describe(mask)}")
            cells = mask.to(w.device).reshape(-1).nonzero().squeeze(1)
        rows = torch.div(cells, max(in_features, 1), rounding_mode="floor")
        counts = torch.bincount(rows, minlength=out_features)
        indptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        layer = cls(in_features, out_features, indptr=indptr, indices=cells - rows * in_features,
                    bias=bias is not None, activation=activation, deterministic=deterministic,
                    device=w.device, dtype=w.dtype)
        with torch.no_grad():
            layer.weight.copy_(w[cells])
            if bias is not None:
                layer.bias.copy_(bias)
        return layer

    @classmethod
    def from_sparse(cls, weight: Any, bias: Optional[Union[torch.Tensor, np.ndarray]] = None, *,
                    activation: Optional[str] = None, deterministic: Optional[bool] = None,
                    device=None, dtype=None) -> "SparseLinear":
        """A layer whose ``W`` is ``weight``: a torch sparse CSR tensor, a COO tensor
        (coalesced and converted once), or a SciPy sparse matrix or array, of shape
        ``(out_features, in_features)``. Its pattern and values are copied (duplicate
        entries of a CSR matrix stay separate edges, adding up as there; SciPy's
        ``tocsr()`` sums those of its other formats).

        ``bias``: ``(out_features,)`` tensor or array, copied; None for a layer without
        bias. ``dtype`` / ``device`` default to the weight's (an integer matrix becomes
        torch's default dtype).
        """
        where = f"{_MODULE}.from_sparse"
        indptr, indices, values, (out_features, in_features) = sparse_weight_parts(where, weight)
        values = values.detach()
        if dtype is None:
            dtype = values.dtype if values.is_floating_point() else torch.get_default_dtype()
        device = values.device if device is None else device
        if bias is not None:
            bias = torch.as_tensor(bias)
            if tuple(bias.shape) != (out_features,):
                raise ValueError(f"{where}: bias has shape {tuple(bias.shape)}, expected "
                                 f"(out_features,) = ({out_features},)")
        layer = cls(in_features, out_features, indptr=indptr, indices=indices,
                    bias=bias is not None, activation=activation, deterministic=deterministic,
                    device=device, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(values)
            if bias is not None:
                layer.bias.copy_(bias)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"nnz={self.nnz}, density={self.density:.4g}, bias={self.bias is not None}"
                + (f", activation={self.activation!r}" if self.activation else "")
                + (f", deterministic={self.deterministic}" if self.deterministic is not None else ""))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        # Resize to the incoming pattern so checkpoints of any nnz load; copy_ then fills.
        indices = state_dict.get(prefix + "indices")
        if isinstance(indices, torch.Tensor) and indices.dim() == 1 \
                and indices.shape != self.indices.shape:
            nnz = indices.shape[0]
            self.indices = self.indices.new_empty(nnz)
            self.weight.data = self.weight.new_empty(nnz)
        n_errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if len(error_msgs) == n_errors:
            self.pattern()  # a bad pattern fails here, not at the next forward


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a {obj.dtype} tensor of shape {tuple(obj.shape)}"
    return type(obj).__name__
