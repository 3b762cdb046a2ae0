"""``mm`` / ``addmm``: dense matrix products through the matmul ladder, with autograd.

The kernels (``shaders/matmul_<rung>.metal``, common code in ``shaders/matmul.h``) compute

    C = activation(alpha * op(A) @ op(B) + beta * bias)

where ``op`` is the identity or a transpose chosen per operand from its strides, so a
transposed view (``w.t()``, the backward's ``grad @ b.t()``) is read in place: no copy.
Rungs of the ladder (``kernel=``):

=============  ===========================================================================
``naive``      one thread per output element, dot product from device memory
``tiled``      32 x 32 threadgroup tiles in padded threadgroup memory
``register``   64 x 64 tiles, 4 x 4 outputs per thread in registers
``simdgroup``  64 x 64 tiles, 2 x 2 SIMD-groups of 4 x 4 simdgroup_matrix accumulators
               (Apple7+: M1 and later) -- the production kernel
``shuffle``    64 x 64 tiles, SIMD-group broadcasts and vector loads, no threadgroup
               memory (GPUs without simdgroup_matrix)
=============  ===========================================================================

``kernel=None`` asks :func:`choose_kernel`. Host code follows the project's pattern:
validate -> allocate -> early return -> choose the variant -> launch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

import numpy as np
import torch
from .. import _custom_ops
from .. import _launch
from .. import _validation as V
from .._backend import kernels_or_reference, require_kernel_dtype, resolve_backend
from .._kernel_names import kernel_name
from .._activations import ACTIVATION_CODES, check_activation
from ..reference.activations import activation_backward_reference
from ..reference.matmul import addmm_reference

OP_MM, OP_ADDMM = "mm", "addmm"

# Activation name -> code in bits 4..7 of the epilogue word (shaders/matmul.h).
EPILOGUE_HAS_BIAS = 1
EPILOGUE_SAVE_PREACT = 2
EPILOGUE_ACT_SHIFT = 4
VEC_A, VEC_B = 1, 2

# alpha and beta are bound in the kernels' accumulator type (tsm_acc<T>::type in
# shaders/tsm_common.h): float, except double for the emulator-only double build.
ACC_SCALAR = {torch.float64: np.float64}

# dtypes the kernels are instantiated for.
MATMUL_DTYPES = V.KERNEL_DTYPES_WITH_HALF


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Rung:
    """One kernel of the ladder: its shader, output tile and launch geometry."""
    name: str
    shader: str
    tile: Tuple[int, int]        # (rows, columns) of C per threadgroup
    group_size: Tuple[int, int]  # threads per threadgroup (x, y)
    whole_groups: bool           # launch whole threadgroups (barriers / SIMD-group collectives)
    needs_simdgroup_matrix: bool = False
    rows_follow_group: bool = False  # the kernel takes one row of C per row of threads

    def fit(self, max_threads: int) -> "Rung":
        """This rung's geometry for a pipeline allowing ``max_threads`` threads per group:
        unchanged when its group fits; a rung whose rows follow the group drops rows of
        threads (and of its C tile); any other raises ``ValueError``."""
        gx, gy = self.group_size
        if gx * gy <= max_threads:
            return self
        if self.rows_follow_group and max_threads >= gx:
            rows = max_threads // gx
            return replace(self, tile=(rows, self.tile[1]), group_size=(gx, rows))
        raise ValueError(f"matmul rung {self.name!r} needs {gx * gy} threads per threadgroup; "
                         f"this pipeline allows {max_threads}")

    def grid(self, m: int, n: int) -> Tuple[int, int]:
        """The grid in threads (dispatchThreads semantics) for an ``m x n`` output."""
        tm, tn = self.tile
        gx, gy = self.group_size
        if not self.whole_groups:  # one thread per element of C, guarded in the kernel
            return n, m
        return _ceil_div(n, tn) * gx, _ceil_div(m, tm) * gy


RUNGS: Dict[str, Rung] = {r.name: r for r in (
    Rung("naive", "matmul_naive.metal", (8, 32), (32, 8), whole_groups=False),
    Rung("tiled", "matmul_tiled.metal", (32, 32), (32, 32), whole_groups=True,
         rows_follow_group=True),
    Rung("register", "matmul_register.metal", (64, 64), (32, 8), whole_groups=True),
    Rung("simdgroup", "matmul_simdgroup.metal", (64, 64), (128, 1), whole_groups=True,
         needs_simdgroup_matrix=True),
    Rung("shuffle", "matmul_shuffle.metal", (64, 64), (128, 1), whole_groups=True),
)}
KERNELS = tuple(RUNGS)
VARIANTS = ("nn", "nt", "tn", "tt")  # transposed (t) or not (n): A then B



def matmul_kernel_name(rung: str, trans_a: bool, trans_b: bool, dtype: torch.dtype) -> str:
    """``matmul_<rung>_<nn|nt|tn|tt>_<dtype>``, as ``TSM_MM_INSTANTIATE`` registers it."""
    variant = ("t" if trans_a else "n") + ("t" if trans_b else "n")
    return kernel_name(f"matmul_{rung}_{variant}", dtype)


def kernel_names(backend: str = "emulator") -> Tuple[str, ...]:
    """Every kernel name the host code can ask ``backend`` for (tests check they exist)."""
    return tuple(matmul_kernel_name(r, ta, tb, d)
                 for r in KERNELS for ta in (False, True) for tb in (False, True)
                 for d in MATMUL_DTYPES[backend])


def capabilities(backend: str) -> Dict[str, bool]:
    """What the kernel chooser needs to know about the device ``backend`` runs on.

    Metal: probed once by :func:`torch_sparse_metal._metal_backend.device_capabilities`
    (``TSM_FORCE_NO_SIMDGROUP_MATRIX=1`` forces the fallback). The emulator runs
    simdgroup_matrix, and honours the same environment override so both paths are testable.
    """
    from .._metal_backend import FORCE_NO_SIMDGROUP_MATRIX, _env_flag, device_capabilities
    if backend == "metal":
        return {"supports_simdgroup_matrix": bool(device_capabilities()["supports_apple7"])}
    return {"supports_simdgroup_matrix": not _env_flag(FORCE_NO_SIMDGROUP_MATRIX)}


# Below this many multiply-adds a dispatch is all overhead and the 64 x 64 tiles would be
# mostly padding: the naive kernel has the least set-up.
SMALL_PRODUCT_FMAS = 32 * 32 * 32


def choose_kernel(m: int, n: int, k: int, dtype: torch.dtype, *,
                  supports_simdgroup_matrix: bool) -> str:
    """The rung ``kernel=None`` runs for an ``m x k`` by ``k x n`` product.

    * tiny products (``m * n * k < SMALL_PRODUCT_FMAS``) and matrix-vector shapes
      (``m == 1`` or ``n == 1``, where a 64-wide tile is 98% padding): ``naive``;
    * devices with simdgroup_matrix (Apple7+, as llama.cpp decides): ``simdgroup``;
    * others (Intel/AMD Macs, pre-M1 Apple GPUs, or forced off): ``shuffle``;
    * float64 (emulator only, for gradcheck): ``register``, the emulator's fastest rung
      (``kernel="simdgroup"`` runs in float64 too).
    """
    if m * n * k < SMALL_PRODUCT_FMAS or m == 1 or n == 1:
        return "naive"
    if dtype == torch.float64:
        return "register"
    return "simdgroup" if supports_simdgroup_matrix else "shuffle"


# ---------------------------------------------------------------------------------------
# Operands: strides -> (buffer, leading dimension, transposed?) without copying.


@dataclass
class Operand:
    """A matrix as a kernel reads it: ``flat`` is a contiguous 1-D view of its storage from
    its first element to its last, element (r, c) at ``r * ld + c`` (``c * ld + r`` when
    ``transposed``). ``vec_ok``: 4-wide vector loads along the contiguous dimension are
    aligned."""
    flat: torch.Tensor
    ld: int
    transposed: bool
    vec_ok: bool


def _flat_view(t: torch.Tensor, extent: int) -> torch.Tensor:
    # A 1-D contiguous view at the tensor's storage offset: the launchers bind a tensor at
    # that offset, so the kernel's element 0 is t[0, 0].
    return t.as_strided((extent,), (1,))


def _aligned(t: torch.Tensor, ld: int) -> bool:
    width = 4 * t.element_size()
    base = t.storage_offset() * t.element_size() if t.device.type != "cpu" else t.data_ptr()
    return ld % 4 == 0 and base % width == 0


def as_operand(op: str, name: str, t: torch.Tensor) -> Operand:
    """Read ``t`` (2-D) in place when it is row-major or column-major with any leading
    dimension (a slice, a transposed view); anything else (expanded, doubly strided) is
    copied to contiguous first."""
    rows, cols = t.shape
    sr, sc = t.stride()
    # Strides of size-1 dimensions are meaningless: normalise them for each reading.
    row_sr, row_sc = (sr if rows > 1 else cols), (sc if cols > 1 else 1)
    col_sr, col_sc = (sr if rows > 1 else 1), (sc if cols > 1 else rows)
    if row_sc == 1 and row_sr >= cols:
        ld, transposed = row_sr, False
        extent = (rows - 1) * ld + cols
    elif col_sr == 1 and col_sc >= rows:
        ld, transposed = col_sc, True
        extent = (cols - 1) * ld + rows
    else:
        t = t.contiguous()
        ld, transposed, extent = cols, False, rows * cols
    if extent - 1 > V.UINT32_MAX:
        raise ValueError(f"{op}: {name} spans {extent} elements in memory; the kernels "
                         "index with 32-bit offsets (at most 2**32)")
    return Operand(_flat_view(t, extent), max(ld, 1), transposed, _aligned(t, ld))


def broadcast_bias(op: str, bias: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """``bias`` expanded to the ``m x n`` output (a view); ValueError if it does not broadcast."""
    try:
        return bias.expand(m, n)
    except RuntimeError:
        raise ValueError(f"{op}: bias of shape {tuple(bias.shape)} does not broadcast to the "
                         f"output shape {(m, n)}") from None


def bias_operand(op: str, bias: torch.Tensor, m: int, n: int) -> Tuple[torch.Tensor, int, int]:
    """``(flat, row_stride, col_stride)`` reading ``bias`` broadcast to a non-empty ``m x n``
    in place: broadcast dimensions get stride 0 (a Linear bias of shape ``(n,)`` is ``(0, 1)``)."""
    expanded = broadcast_bias(op, bias, m, n)
    sr, sc = expanded.stride()
    sr, sc = (sr if m > 1 else 0), (sc if n > 1 else 0)
    extent = (m - 1) * sr + (n - 1) * sc + 1
    if extent - 1 > V.UINT32_MAX:
        expanded = expanded.contiguous()
        sr, sc, extent = n, 1, m * n
    return _flat_view(expanded, extent), sr, sc


# ---------------------------------------------------------------------------------------
# Validation and public entry points


def _check_matrices(op: str, a: torch.Tensor, b: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> None:
    for name, t in (("a", a), ("b", b), ("bias", bias)):
        if t is None:
            continue
        V.check_tensor(op, name, t)
        V.check_floating(op, name, t)
    V.check_dim(op, "a", a, 2)
    V.check_dim(op, "b", b, 2)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: a is {tuple(a.shape)} and b is {tuple(b.shape)}; a's columns "
                         "must equal b's rows")
    V.check_same_dtype(op, {"a": a, "b": b, "bias": bias})
    V.check_same_device(op, {"a": a, "b": b, "bias": bias})
    if bias is not None and bias.dim() > 2:
        raise ValueError(f"{op}: bias must have at most 2 dimensions, got shape "
                         f"{tuple(bias.shape)}")


def _check_kernel(op: str, kernel: Optional[str]) -> None:
    if kernel is not None and kernel not in RUNGS:
        raise ValueError(f"{op}: kernel must be None or one of {list(KERNELS)}, got {kernel!r}")


def mm(a: torch.Tensor, b: torch.Tensor, *, kernel: Optional[str] = None) -> torch.Tensor:
    """``a @ b`` for 2-D ``a`` (m x k) and ``b`` (k x n), as ``torch.mm``.

    ``kernel`` selects a rung of the ladder (``"naive"``, ``"tiled"``, ``"register"``,
    ``"simdgroup"``, ``"shuffle"``); None picks one with :func:`choose_kernel`.
    Transposed views are read in place. Differentiable in ``a`` and ``b``; the backward
    runs the same kernels on transposed views.
    """
    return _matmul(OP_MM, None, a, b, alpha=1.0, beta=0.0, activation=None, kernel=kernel)


def addmm(bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor, *,
          beta: float = 1.0, alpha: float = 1.0, activation: Optional[str] = None,
          kernel: Optional[str] = None) -> torch.Tensor:
    """``activation(beta * bias + alpha * a @ b)``, as ``torch.addmm`` plus a fused
    activation (None, ``"relu"``, ``"gelu"`` -- tanh approximation -- or ``"tanh"``).

    ``bias`` broadcasts to the ``m x n`` output (``(n,)``, ``(1, n)``, ``(m, 1)``,
    ``(m, n)``, a scalar) and is read in place; None means no bias term. As in torch,
    ``beta = 0`` ignores ``bias`` entirely (NaNs in it do not propagate; its gradient is
    ``0 * grad``, as torch's: zeros but where ``grad`` is not finite). ``alpha = 0`` scales
    ``a @ b`` all the same (0 * inf is NaN; torch's float32 and float64 BLAS skip it).
    Differentiable in ``bias``, ``a`` and ``b``.
    """
    return _matmul(OP_ADDMM, bias, a, b, alpha=alpha, beta=beta, activation=activation,
                   kernel=kernel)


def _matmul(op: str, bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor, *,
            alpha: float, beta: float, activation: Optional[str],
            kernel: Optional[str]) -> torch.Tensor:
    _check_matrices(op, a, b, bias)
    _check_kernel(op, kernel)
    check_activation(op, activation)
    alpha, beta = float(alpha), float(beta)
    m, k = a.shape
    n = b.shape[1]
    if bias is not None:
        broadcast_bias(op, bias, m, n)  # validates the broadcast (also for an empty output)
    # torch.addmm: beta = 0 ignores the input (NaNs in it do not propagate), but the bias
    # stays an input of the graph, so its gradient is 0 * grad, as torch's, not None.

    backend = resolve_backend(op, (a, b, bias),
                              kernels=lambda: kernels_for(kernel, a.dtype, "metal"))

    def on_reference() -> torch.Tensor:
        return addmm_reference(bias.expand(m, n) if bias is not None else None, a, b,
                               alpha=alpha, beta=beta, activation=activation)

    if m == 0 or n == 0 or k == 0:
        # Empty products have nothing to launch; torch ops give the right (differentiable)
        # answer: zeros, or the scaled bias through the activation.
        return on_reference()
    return kernels_or_reference(op, backend, lambda: _launch_product(
        op, bias, a, b, alpha=alpha, beta=beta, activation=activation, kernel=kernel,
        backend=backend), on_reference)


def _launch_product(op: str, bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor,
                    *, alpha: float, beta: float, activation: Optional[str],
                    kernel: Optional[str], backend: str) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    require_kernel_dtype(op, a.dtype, backend, MATMUL_DTYPES)
    if kernel == "simdgroup":
        check_simdgroup(op, a.dtype, backend)
    for name, size in (("m", m), ("n", n), ("k", k)):
        V.check_fits_uint32(op, name, size)
    V.check_fits_uint32(op, "the output's last flat offset (m * n - 1)", m * n - 1)
    if op == OP_MM:
        return _MM(a, b, kernel)
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (a, b, bias))
    out, _ = _ADDMM(bias, a, b, alpha, beta, activation, kernel,
                    need_grad and activation == "gelu")
    return out


def check_simdgroup(op: str, dtype: torch.dtype, backend: str) -> None:
    """``kernel="simdgroup"`` needs simdgroup_matrix on the device."""
    if not capabilities(backend)["supports_simdgroup_matrix"]:
        raise ValueError(f"{op}: kernel 'simdgroup' needs simdgroup_matrix (an Apple7+ GPU: "
                         "M1 or later); this device has none (or it was forced off)")


def kernels_for(kernel: Optional[str], dtype: torch.dtype, backend: str
                ) -> Tuple[Tuple[str, str], ...]:
    """``(shader, kernel name)`` of what a product may launch: the named rung, or those
    :func:`choose_kernel` may pick on this device (``naive`` and the large-product rung),
    each in its four transposes (the backward flips them)."""
    if kernel is not None:
        rungs: Tuple[str, ...] = (kernel,)
    else:
        big = int(SMALL_PRODUCT_FMAS)  # a product past every threshold
        rungs = ("naive", choose_kernel(big, big, big, dtype, **capabilities(backend)))
    return tuple((RUNGS[r].shader, matmul_kernel_name(r, ta, tb, dtype))
                 for r in rungs for ta in (False, True) for tb in (False, True))


def resolve_kernel(kernel: Optional[str], m: int, n: int, k: int, dtype: torch.dtype,
                   backend: str) -> str:
    if kernel is not None:
        return kernel
    return choose_kernel(m, n, k, dtype, **capabilities(backend))


# ---------------------------------------------------------------------------------------
# Kernel path


# The ops ``torch_sparse_metal::mm`` and ``torch_sparse_metal::addmm``. Their backward runs
# the same ops on transposed views (``g @ B^T``, ``A^T @ g``: the variant flips, nothing is
# copied), on the device, hence the backend, of the forward.


def _mm_kernel(a, b, kernel, *, backend):
    out, _ = launch_matmul(a, b, None, alpha=1.0, beta=0.0, kernel=kernel, backend=backend,
                           op=OP_MM)
    return out


def _mm_fake(a, b, kernel):
    return a.new_empty(a.shape[0], b.shape[1])


def _mm_setup_context(ctx, inputs, output) -> None:
    a, b, ctx.kernel = inputs
    need_a, need_b = ctx.needs_input_grad[:2]
    ctx.save_for_backward(a if need_b else None, b if need_a else None)


def _mm_backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad_a = _MM(grad_out, b.t(), ctx.kernel) if need_a else None
    grad_b = _MM(a.t(), grad_out, ctx.kernel) if need_b else None
    return grad_a, grad_b, None


def _addmm_kernel(bias, a, b, alpha, beta, activation, kernel, save_preact, *, backend):
    # beta = 0: the bias is an input (its gradient is 0 * grad) but the kernel never reads it.
    out, preact = launch_matmul(a, b, bias if beta != 0.0 else None, alpha=alpha, beta=beta,
                                activation=activation, save_preact=save_preact, kernel=kernel,
                                backend=backend, op=OP_ADDMM)
    return out, preact if save_preact else _custom_ops.empty_like_none(out)


def _addmm_fake(bias, a, b, alpha, beta, activation, kernel, save_preact):
    shape = (a.shape[0], b.shape[1])
    return a.new_empty(shape), a.new_empty(shape if save_preact else (0,))


def _addmm_setup_context(ctx, inputs, output) -> None:
    bias, a, b, ctx.alpha, ctx.beta, ctx.activation, ctx.kernel, ctx.save_preact = inputs
    need_bias, need_a, need_b = ctx.needs_input_grad[:3]
    ctx.bias_shape = None if bias is None else bias.shape
    act_saved = None
    if ctx.activation is not None:
        act_saved = output[1] if ctx.activation == "gelu" else output[0]
    ctx.save_for_backward(a if need_b else None, b if need_a else None, act_saved)
    # A gradient into the pre-activation arrives in a double backward through gelu's
    # derivative (act_saved is that output): None, not zeros, tells when it did not.
    ctx.set_materialize_grads(False)


def _addmm_backward(ctx, grad_out, grad_preact):
    a, b, act_saved = ctx.saved_tensors
    need_bias, need_a, need_b = ctx.needs_input_grad[:3]
    g = grad_out
    if g is not None and ctx.activation is not None:
        g = activation_backward_reference(g, act_saved, ctx.activation)
    if grad_preact is not None and ctx.save_preact:
        g = grad_preact if g is None else g + grad_preact
    if g is None:
        return (None,) * 8
    # d/da (alpha * a @ b) = alpha * g @ b^T, d/db = alpha * a^T @ g.
    grad_a = _ADDMM(None, g, b.t(), ctx.alpha, 0.0, None, ctx.kernel, False)[0] \
        if need_a else None
    grad_b = _ADDMM(None, a.t(), g, ctx.alpha, 0.0, None, ctx.kernel, False)[0] \
        if need_b else None
    grad_bias = None
    if need_bias:
        # torch.addmm's: beta * g summed over the broadcast, so beta = 0 (the bias never
        # read) gives zeros, and NaN where g holds a NaN or an infinity, as 0 * inf.
        grad_bias = (g if ctx.beta == 1.0 else g * ctx.beta).sum_to_size(ctx.bias_shape)
    return grad_bias, grad_a, grad_b, None, None, None, None, None


_MM = _custom_ops.define("mm(Tensor a, Tensor b, str? kernel) -> Tensor", _mm_kernel, _mm_fake,
                         backward=_mm_backward, setup_context=_mm_setup_context)
_ADDMM = _custom_ops.define(
    "addmm(Tensor? bias, Tensor a, Tensor b, float alpha, float beta, str? activation, "
    "str? kernel, bool save_preact) -> (Tensor, Tensor)",
    _addmm_kernel, _addmm_fake, backward=_addmm_backward, setup_context=_addmm_setup_context)


def launch_matmul(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], *,
                  alpha: float = 1.0, beta: float = 1.0, activation: Optional[str] = None,
                  save_preact: bool = False, kernel: Optional[str] = None,
                  backend: str, op: str = OP_MM) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One dispatch: ``(C, pre-activation if save_preact else None)``; no autograd.

    ``a``, ``b``, ``bias`` are validated, non-empty and of one dtype and device; ``op``
    (the public op that asked) starts every error message.
    """
    m, k = a.shape
    n = b.shape[1]
    if b.shape[0] != k or b.dtype != a.dtype:
        # Validated by the caller; in backward, an operand swapped through `.data` since
        # the forward pass (no version bump) would otherwise be read with the wrong sizes.
        raise ValueError(f"{op}: a is {tuple(a.shape)} {a.dtype} and b is {tuple(b.shape)} "
                         f"{b.dtype}; a's columns must equal b's rows and the dtypes match "
                         "(was a tensor saved for backward replaced through .data?)")
    rung = RUNGS[resolve_kernel(kernel, m, n, k, a.dtype, backend)]
    if rung.needs_simdgroup_matrix:
        check_simdgroup(op, a.dtype, backend)
    A, B = as_operand(op, "a", a), as_operand(op, "b", b)
    out = a.new_empty(m, n)
    preact = a.new_empty(m, n) if save_preact else None
    placeholder = a.new_empty(1)
    flags = ACTIVATION_CODES[activation] << EPILOGUE_ACT_SHIFT
    if bias is not None:
        bias_flat, bias_rs, bias_cs = bias_operand(op, bias, m, n)
        flags |= EPILOGUE_HAS_BIAS
    else:
        bias_flat, bias_rs, bias_cs = placeholder, 0, 0
    if save_preact:
        flags |= EPILOGUE_SAVE_PREACT
    vec = (VEC_A if A.vec_ok else 0) | (VEC_B if B.vec_ok else 0)
    acc = ACC_SCALAR.get(a.dtype, np.float32)  # alpha, beta in tsm_acc<T>::type
    args = (A.flat, B.flat, bias_flat, out, preact if save_preact else placeholder,
            np.uint32(m), np.uint32(n), np.uint32(k), np.uint32(A.ld), np.uint32(B.ld),
            np.uint32(n), np.uint32(bias_rs), np.uint32(bias_cs),
            acc(alpha), acc(beta), np.uint32(flags), np.uint32(vec))
    name = matmul_kernel_name(rung.name, A.transposed, B.transposed, a.dtype)
    rung = rung.fit(_launch.max_threads_per_group(rung.shader, name, backend))
    _launch.launch(rung.shader, name, args, threads=rung.grid(m, n), group_size=rung.group_size,
                   backend=backend)
    return out, preact
