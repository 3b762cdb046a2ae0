"""``block_sparse_linear``: ``input @ W.T + bias`` with ``W`` in BSR form of ``B x B`` blocks.

``W`` is ``out_features x in_features``, both multiples of the block size ``B`` (8, 16 or
32). Block row ``r`` lists its blocks' columns (``col``) and values ``(B, B)``; kernels:
``shaders/block_sparse_linear.metal`` (one forward dispatch, one fused backward dispatch,
on ``simdgroup_matrix`` fragments, or the SIMD-shuffle kernels on a GPU without them,
chosen as the matmul ladder chooses).

Host code follows the sparse layer's (``ops/sparse_linear.py``): a :class:`BSRPattern` is
validated when it is built (one small read-back) and transposed once (the by-source twin the
backward walks); the kernels check every index they follow, so a write behind torch's back
turns the outputs that depend on it into NaN and is raised by
:func:`~torch_sparse_metal.check_errors`, with no read-back per call.

Ops (``torch.ops.torch_sparse_metal``): ``block_sparse_linear`` (differentiable, registered
for autocast as ``linear`` is) and ``block_sparse_linear_backward`` (which refuses a second
derivative).
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from .. import _custom_ops
from .. import _launch
from .. import _validation as V
from .._autocast import cast_for_reference, kernel_dtype
from .._backend import kernels_or_reference, require_kernel_dtype, resolve_backend
from .._kernel_names import kernel_name
from ..checks import error_word
from ..reference.sparse_linear import csr_row_ids
from .matmul import capabilities, check_simdgroup
from .sparse_linear import BySource, build_by_source, count_distinct

OP = "block_sparse_linear"
SHADER = "block_sparse_linear.metal"
BLOCKS = (8, 16, 32)
DTYPES = V.KERNEL_DTYPES_WITH_HALF
FAMILIES = ("simdgroup", "shuffle")
# Threads per threadgroup: the simdgroup kernels stage each task's tiles in threadgroup
# memory, one SIMD-group (a task) per threadgroup; the shuffle kernels share none.
GROUP_SIZE = {"simdgroup": 32, "shuffle": 256}
SIMD_WIDTH = 32
# Batch rows per task of the forward and of grad_input (TSM_BLOCK_TASK_ROWS in the shader
# for the simdgroup kernels; the shuffle kernels' tile is 8 rows).
TASK_ROWS = {"simdgroup": 32, "shuffle": 8}
_NAMES = ("crow", "col", "out_features / block", "in_features / block")


def kernel_base(direction: str, family: str, block: int) -> str:
    return f"block_sparse_linear_{direction}_{family}_b{block}"


def kernel_names(backend: str = "emulator") -> Tuple[str, ...]:
    """Every kernel name the host code can ask ``backend`` for (tests check they exist)."""
    return tuple(kernel_name(kernel_base(d, f, b), dtype)
                 for d in ("forward", "backward") for f in FAMILIES for b in BLOCKS
                 for dtype in DTYPES[backend])


def kernels_for(dtype: torch.dtype, block: int, family: str) -> Tuple[Tuple[str, str], ...]:
    """``(shader, kernel)`` of what one call may launch."""
    return tuple((SHADER, kernel_name(kernel_base(d, family, block), dtype))
                 for d in ("forward", "backward"))


def family_for(backend: str) -> str:
    """``simdgroup`` where the GPU has simdgroup_matrix, else ``shuffle``
    (``TSM_FORCE_NO_SIMDGROUP_MATRIX=1`` forces the fallback, as for the matmul)."""
    return "simdgroup" if capabilities(backend)["supports_simdgroup_matrix"] else "shuffle"


class BSRPattern:
    """A validated block pattern of an ``out_features x in_features`` matrix of ``block x
    block`` blocks: ``crow`` ``(out_features / block + 1,)`` and ``col`` ``(nnzb,)``, int32 on
    one device. Immutable; the by-source twin is built on first use."""

    def __init__(self, crow: torch.Tensor, col: torch.Tensor, in_features: int,
                 out_features: int, block: int, *, op: str = OP) -> None:
        self.block = check_block(op, block)
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            V.check_int(op, name, n, minimum=0)
            if n % block:
                raise ValueError(f"{op}: {name} = {n} is not a multiple of the block size "
                                 f"{block}")
        self.crow, self.col = V.validate_csr(op, crow, col, n_cols=in_features // block,
                                             n_rows=out_features // block, names=_NAMES)
        self.in_features, self.out_features = in_features, out_features
        self._by_source: Optional[BySource] = None
        self._distinct: Optional[int] = None

    @classmethod
    def trusted(cls, crow: torch.Tensor, col: torch.Tensor, in_features: int,
                out_features: int, block: int, *,
                distinct_blocks: Optional[int] = None) -> "BSRPattern":
        """A pattern valid by construction, taken without the validation's read-back;
        ``distinct_blocks``: how many distinct block cells it holds, if known."""
        pattern = cls.__new__(cls)
        pattern.crow, pattern.col, pattern.block = crow, col, block
        pattern.in_features, pattern.out_features = in_features, out_features
        pattern._by_source, pattern._distinct = None, distinct_blocks
        return pattern

    def distinct_blocks(self) -> int:
        """How many distinct (block row, block column) cells the pattern holds: ``nnzb``
        unless a block is repeated (repeats add up). One read-back the first time, unless
        known from how the pattern was made."""
        if self._distinct is None:
            self._distinct = count_distinct(self.block_rows(), self.col,
                                            self.in_features // self.block)
        return self._distinct

    @property
    def nnzb(self) -> int:
        return self.col.shape[0]

    @property
    def device(self) -> torch.device:
        return self.crow.device

    def block_rows(self) -> torch.Tensor:
        """The block row of every block (int64), in block order."""
        return csr_row_ids(self.crow, self.nnzb)

    def by_source(self) -> BySource:
        """The pattern by block column, built on the device as the CSR layer's is: ``indptr``
        (in_features / B + 1), ``rows`` the block row of each block in that order, ``perm``
        its block id."""
        if self._by_source is None:
            self._by_source = build_by_source(self.crow, self.col,
                                               self.in_features // self.block)
        return self._by_source


def check_block(op: str, block: object) -> int:
    if block not in BLOCKS or isinstance(block, bool):
        raise ValueError(f"{op}: block must be one of {BLOCKS} (the kernels' 8x8 fragments "
                         f"tile it), got {block!r}")
    return int(block)


def block_sparse_linear_reference(input: torch.Tensor, crow: torch.Tensor, col: torch.Tensor,
                                  values: torch.Tensor, bias: Optional[torch.Tensor] = None
                                  ) -> torch.Tensor:
    """Plain torch: each block's product with its slice of ``input``, summed into its block
    row with ``index_add`` (2-byte types in float32, rounded once, as the kernels do).
    ``input`` is ``(batch, in_features)``."""
    dtype = input.dtype
    if dtype in (torch.float16, torch.bfloat16):
        input, values = input.float(), values.float()
        bias = None if bias is None else bias.float()
    nnzb, block = values.shape[0], values.shape[-1]
    batch, in_features = input.shape
    out_features = (crow.shape[0] - 1) * block
    x = input.reshape(batch, in_features // block, block)[:, col.long()]  # (batch, nnzb, B)
    products = torch.einsum("nkj,kij->nki", x, values)                   # (batch, nnzb, B)
    out = input.new_zeros(batch, out_features // block, block).index_add(
        1, csr_row_ids(crow, nnzb), products).reshape(batch, out_features)
    if bias is not None:
        out = out + bias
    return out.to(dtype)


def block_sparse_linear(input: torch.Tensor, crow: torch.Tensor, col=None,
                        values: Optional[torch.Tensor] = None,
                        bias: Optional[torch.Tensor] = None, *,
                        kernel: Optional[str] = None) -> torch.Tensor:
    """``input @ W.T + bias`` with ``W`` the BSR matrix ``(crow, col, values)``.

    Two forms: ``block_sparse_linear(input, crow, col, values, bias=None)``, or
    ``block_sparse_linear(input, weight, bias=None)`` with ``weight`` a torch sparse BSR
    tensor ``(out_features, in_features)`` (``Tensor.to_sparse_bsr(block)``).

    Args:
        input: ``(*, in_features)``, floating point.
        crow: ``(out_features / B + 1,)`` int32 (int64 accepted): block row ``r`` holds
            blocks ``crow[r]:crow[r + 1]``.
        col: ``(nnzb,)`` the block column of each block.
        values: ``(nnzb, B, B)``, ``values[k][i][j] = W[r B + i, c B + j]``; B is 8, 16 or 32.
        bias: ``(out_features,)`` or None.
        kernel: ``"simdgroup"``, ``"shuffle"`` or None (the first where the GPU has
            simdgroup_matrix, else the second).

    Returns:
        ``(*, out_features)``, differentiable in ``input``, ``values`` and ``bias``. The
        pattern is validated on every call (one read-back); a :class:`BSRPattern` with
        :func:`apply_block_pattern` validates once (``BlockSparseLinear`` does).
    """
    if isinstance(crow, torch.Tensor) and crow.layout == torch.sparse_bsr:
        if values is not None or (col is not None and bias is not None):
            raise TypeError(f"{OP}: with a BSR weight the call is block_sparse_linear(input, "
                            "weight, bias=None)")
        weight, bias = crow, col
        crow, col, values = weight.crow_indices(), weight.col_indices(), weight.values()
        out_features, in_features = weight.shape
    elif col is None or values is None:
        raise TypeError(f"{OP}: expected (input, crow, col, values, bias=None) or (input, "
                        "weight, bias=None) with weight a torch sparse BSR tensor")
    else:
        for name, t in (("input", input), ("crow", crow), ("values", values)):
            V.check_tensor(OP, name, t)
        V.check_dim(OP, "crow", crow, 1)
        V.check_dim(OP, "values", values, 3)
        in_features, out_features = input.shape[-1], (crow.shape[0] - 1) * values.shape[-1]
    V.check_tensor(OP, "input", input)
    if values.shape[1] != values.shape[2]:
        raise ValueError(f"{OP}: values must be (nnzb, B, B), got shape {tuple(values.shape)}")
    pattern = BSRPattern(crow, col, in_features, out_features, values.shape[-1])
    return apply_block_pattern(input, pattern, values, bias, kernel=kernel)


def apply_block_pattern(input: torch.Tensor, pattern: BSRPattern, values: torch.Tensor,
                        bias: Optional[torch.Tensor] = None, *, kernel: Optional[str] = None,
                        op: str = OP) -> torch.Tensor:
    """:func:`block_sparse_linear` with a validated :class:`BSRPattern`: no read-back."""
    if kernel not in (None, *FAMILIES):
        raise ValueError(f"{op}: kernel must be None, 'simdgroup' or 'shuffle', got {kernel!r}")
    for name, t in (("input", input), ("values", values), ("bias", bias)):
        if t is not None:
            V.check_tensor(op, name, t)
            V.check_floating(op, name, t)
    B = pattern.block
    if tuple(values.shape) != (pattern.nnzb, B, B):
        raise ValueError(f"{op}: values has shape {tuple(values.shape)} but the pattern needs "
                         f"(nnzb, B, B) = {(pattern.nnzb, B, B)}")
    if bias is not None:
        V.check_length(op, "bias", bias, pattern.out_features, "out_features")
    V.check_same_device(op, {"input": input, "values": values, "bias": bias,
                             "crow": pattern.crow})
    dtype = kernel_dtype(op, {"input": input, "values": values, "bias": bias})
    x, lead = V.flat_batch(op, "input", input, pattern.in_features)
    backend = resolve_backend(op, (input, values, bias), kernels=lambda: kernels_for(
        dtype, B, kernel or family_for("metal")))

    def on_reference() -> torch.Tensor:
        x_, values_, bias_ = cast_for_reference(x.device, x, values, bias)
        return block_sparse_linear_reference(x_, pattern.crow, pattern.col, values_, bias_)

    def on_kernels() -> torch.Tensor:
        require_kernel_dtype(op, dtype, backend, DTYPES)
        if kernel == "simdgroup":
            check_simdgroup(op, dtype, backend)
        batch = x.shape[0]
        for what, n in (("batch * in_features", batch * pattern.in_features),
                        ("batch * out_features", batch * pattern.out_features),
                        ("nnzb * block * block", pattern.nnzb * B * B)):
            V.check_fits_uint32(op, what, n)
        need_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, values, bias))
        src = tuple(pattern.by_source()) if need_grad else (_no_array(x),) * 3
        return _BLOCK_SPARSE_LINEAR(x, pattern.crow, pattern.col, values, bias, *src,
                                    (kernel or family_for(backend)) == "simdgroup")

    out = kernels_or_reference(op, backend, on_kernels, on_reference)
    return out.reshape(*lead, pattern.out_features)


def _no_array(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int32, device=like.device)


# ---------------------------------------------------------------------------------------
# The ops


def _forward_kernel(input, crow, col, values, bias, src_ptr, src_rows, src_perm, simdgroup,
                    *, backend):
    input, values = input.contiguous(), values.contiguous()
    batch, in_features = input.shape
    B = values.shape[-1]
    out_features = (crow.shape[0] - 1) * B
    out = input.new_empty(batch, out_features)
    if batch == 0 or values.shape[0] == 0 or out_features == 0:
        out.zero_()
        if bias is not None:
            out += bias
        return out
    family = "simdgroup" if simdgroup else "shuffle"
    tasks = (out_features // B) * -(-batch // TASK_ROWS[family])
    V.check_fits_uint32(OP, "tasks * 32", tasks * SIMD_WIDTH)
    args = (input, crow, col, values,
            bias.contiguous() if bias is not None else _placeholder(input), out,
            np.uint32(batch), np.uint32(in_features), np.uint32(out_features),
            np.uint32(bias is not None), np.uint32(values.shape[0]), error_word(input.device))
    _launch.launch(SHADER, kernel_name(kernel_base("forward", family, B), input.dtype), args,
                   threads=tasks * SIMD_WIDTH, group_size=GROUP_SIZE[family], backend=backend)
    return out


def _forward_fake(input, crow, col, values, bias, src_ptr, src_rows, src_perm, simdgroup):
    return input.new_empty(input.shape[0], (crow.shape[0] - 1) * values.shape[-1])


def _setup_context(ctx, inputs, output) -> None:
    input, crow, col, values, bias, src_ptr, src_rows, src_perm, simdgroup = inputs
    ctx.in_features = input.shape[1]
    ctx.has_bias = bias is not None
    ctx.simdgroup = simdgroup
    need_input, need_values = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
    ctx.save_for_backward(input if need_values else None, values if need_input else None,
                          crow, col, src_ptr, src_rows, src_perm)


def _backward_formula(ctx, grad_output):
    x, values, crow, col, src_ptr, src_rows, src_perm = ctx.saved_tensors
    need_input, need_values = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
    need_bias = ctx.needs_input_grad[4] and ctx.has_bias
    grads = _BLOCK_SPARSE_LINEAR_BACKWARD(grad_output, x, values, crow, col, src_ptr,
                                          src_rows, src_perm, ctx.in_features, need_input,
                                          need_values, need_bias, ctx.simdgroup)
    grad_input, grad_values, grad_bias = grads
    return ((grad_input if need_input else None), None, None,
            (grad_values if need_values else None), (grad_bias if need_bias else None),
            None, None, None, None)


def _backward_kernel(grad_output, input, values, crow, col, src_ptr, src_rows, src_perm,
                     in_features, need_input, need_values, need_bias, simdgroup, *, backend):
    grad_output = grad_output.contiguous()
    batch, out_features = grad_output.shape
    nnzb, B = col.shape[0], out_features // (crow.shape[0] - 1)
    if batch == 0 or nnzb == 0:  # nothing flows through blocks; grad_bias is a column sum
        return (grad_output.new_zeros(batch, in_features) if need_input else None,
                grad_output.new_zeros(nnzb, B, B) if need_values else None,
                grad_output.sum(0) if need_bias else None)
    # Every element of each needed gradient has one writer in the dispatch: no zero-fill.
    placeholder = _placeholder(grad_output)
    grads = (grad_output.new_empty(batch, in_features) if need_input else None,
             grad_output.new_empty(nnzb, B, B) if need_values else None,
             grad_output.new_empty(out_features) if need_bias else None)
    family = "simdgroup" if simdgroup else "shuffle"
    tasks = ((in_features // B) * -(-batch // TASK_ROWS[family]) * need_input
             + nnzb * need_values + -(-out_features // SIMD_WIDTH) * need_bias)
    V.check_fits_uint32(OP, "backward tasks * 32", tasks * SIMD_WIDTH)
    args = (grad_output, input.contiguous() if need_values else placeholder,
            values.contiguous() if need_input else placeholder, src_ptr, src_rows, src_perm,
            *(g if g is not None else placeholder for g in grads), np.uint32(batch),
            np.uint32(in_features), np.uint32(out_features), np.uint32(nnzb),
            np.uint32(need_input), np.uint32(need_values), np.uint32(need_bias),
            error_word(grad_output.device))
    _launch.launch(SHADER, kernel_name(kernel_base("backward", family, B), grad_output.dtype),
                   args, threads=tasks * SIMD_WIDTH, group_size=GROUP_SIZE[family],
                   backend=backend)
    return grads


def _backward_kernel_op(*args, backend):
    """The op's outputs are tensors: a gradient not asked for is an empty placeholder."""
    return tuple(g if g is not None else _custom_ops.empty_like_none(args[0])
                 for g in _backward_kernel(*args, backend=backend))


def _backward_fake(grad_output, input, values, crow, col, src_ptr, src_rows, src_perm,
                   in_features, need_input, need_values, need_bias, simdgroup):
    batch, out_features = grad_output.shape
    B = out_features // (crow.shape[0] - 1)
    sizes = ((batch, in_features) if need_input else (0,),
             (col.shape[0], B, B) if need_values else (0,),
             (out_features,) if need_bias else (0,))
    return tuple(grad_output.new_empty(size) for size in sizes)


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(1, dtype=like.dtype, device=like.device)


_BLOCK_SPARSE_LINEAR = _custom_ops.define(
    "block_sparse_linear(Tensor input, Tensor crow, Tensor col, Tensor values, Tensor? bias, "
    "Tensor src_ptr, Tensor src_rows, Tensor src_perm, bool simdgroup) -> Tensor",
    _forward_kernel, _forward_fake, backward=_backward_formula, setup_context=_setup_context,
    autocast=True)
_BLOCK_SPARSE_LINEAR_BACKWARD = _custom_ops.define(
    "block_sparse_linear_backward(Tensor grad_output, Tensor? input, Tensor? values, "
    "Tensor crow, Tensor col, Tensor src_ptr, Tensor src_rows, Tensor src_perm, "
    "SymInt in_features, bool need_input, bool need_values, bool need_bias, bool simdgroup) "
    "-> (Tensor, Tensor, Tensor)", _backward_kernel_op, _backward_fake)
