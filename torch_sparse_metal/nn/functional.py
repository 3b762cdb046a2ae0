"""Functional ops on the package's kernels: ``cross_entropy``.

``cross_entropy(logits, labels)`` is ``torch.nn.functional.cross_entropy`` with mean
reduction, as one fused kernel (``shaders/cross_entropy.metal``) that writes the mean loss
and, under autograd, the gradient with respect to the logits in the same dispatch.

Host code follows the ops: validate -> allocate -> return early on empty -> launch.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from .. import _custom_ops
from .. import _launch
from .. import _validation as V
from .._autocast import kernel_dtype
from .._backend import kernels_or_reference, require_kernel_dtype, resolve_backend
from .._kernel_names import kernel_name, kernel_names_for, library_kernels
from ..checks import check_invariants, error_word
from .._binding import SIMD_WIDTH

OP = "cross_entropy"
SHADER = "cross_entropy.metal"
KERNELS = ("cross_entropy_forward",)
# float32, float16 and bfloat16 logits (bfloat16 from MSL 3.1), float64 on the emulator; the
# softmax and the sums in float32 whatever the logits' type. Under torch.autocast the logits
# are cast to float32 first, as torch's cross_entropy has them.
DTYPES = V.KERNEL_DTYPES_WITH_HALF

__all__ = ["cross_entropy"]


def kernel_names(backend: str = "emulator") -> Tuple[str, ...]:
    """Every kernel name the host code can ask ``backend`` for (tests check they exist)."""
    return kernel_names_for(KERNELS, backend, DTYPES)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *,
                  weight: Optional[torch.Tensor] = None, size_average: Optional[bool] = None,
                  ignore_index: int = -100, reduce: Optional[bool] = None,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean softmax cross-entropy of ``logits`` ``(batch, classes)`` against ``labels``.

    Args:
        logits: ``(batch, classes)`` floating point, unnormalised scores.
        labels: ``(batch,)`` int64 or int32 class indices in ``[0, classes)``; rows whose
            label equals ``ignore_index`` count neither in the loss nor in the mean.
        weight, size_average, reduce, reduction, label_smoothing: accepted for
            ``torch.nn.functional.cross_entropy``'s signature (keywords only) but only at
            their defaults (no class weights, mean reduction, no label smoothing); any
            other value raises ``ValueError``.

    Returns:
        A 0-D tensor: the mean over counted rows of ``logsumexp(x) - x[label]`` (NaN when
        no row counts, as in torch). Differentiable in ``logits``.

    Labels outside ``[0, classes)`` (other than ``ignore_index``) are checked by the kernel,
    without a read-back: the loss and that row's gradient come out NaN and
    :func:`torch_sparse_metal.check_errors` raises :class:`~torch_sparse_metal.checks.InvalidInputError`.
    In strict mode (:class:`torch_sparse_metal.check_invariants`) they raise ``ValueError``
    before the kernel runs, reading two numbers back (one GPU sync on MPS); the reference
    backend always checks so, as torch's own CPU op does.
    """
    _check_torch_options(weight, size_average, reduce, reduction, label_smoothing)
    V.check_tensor(OP, "logits", logits)
    V.check_tensor(OP, "labels", labels)
    V.check_floating(OP, "logits", logits)
    V.check_dim(OP, "logits", logits, 2)
    if labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{OP}: labels must be an int64 (or int32) tensor of class indices, "
                         f"got dtype {labels.dtype}")
    V.check_length(OP, "labels", labels, logits.shape[0], "batch = logits.shape[0]")
    V.check_same_device(OP, {"logits": logits, "labels": labels})
    batch, classes = logits.shape
    if classes == 0:
        raise ValueError(f"{OP}: logits has 0 classes; it needs at least one")
    if not -V.INT32_MAX - 1 <= int(ignore_index) <= V.INT32_MAX:
        raise ValueError(f"{OP}: ignore_index = {ignore_index} is past the int32 range of the "
                         "kernel's labels")
    ignore_index = int(ignore_index)

    dtype = kernel_dtype(OP, {"logits": logits}, to=torch.float32)
    backend = resolve_backend(OP, (logits,),
                              kernels=lambda: library_kernels(SHADER, KERNELS, dtype))

    def on_reference() -> torch.Tensor:
        # Inside a compiled graph the check cannot read the labels back: torch's own
        # cross_entropy checks them there.
        if not torch.compiler.is_compiling():
            _check_labels(labels, classes, ignore_index)
        return torch.nn.functional.cross_entropy(logits, labels.long(), ignore_index=ignore_index)

    def on_kernels() -> torch.Tensor:
        require_kernel_dtype(OP, dtype, backend, DTYPES)
        V.check_fits_uint32(OP, "batch * classes", batch * classes)
        need_grad = torch.is_grad_enabled() and logits.requires_grad
        loss, _ = _CROSS_ENTROPY(logits, labels, ignore_index, need_grad,
                                 check_invariants.is_enabled())
        return loss

    return kernels_or_reference(OP, backend, on_kernels, on_reference)


def _check_torch_options(weight, size_average, reduce, reduction, label_smoothing) -> None:
    """torch's options the fused kernel does not implement: only their defaults pass."""
    if weight is not None:
        raise ValueError(f"{OP}: class weights are not supported (weight must be None); use "
                         "torch.nn.functional.cross_entropy")
    if size_average is not None or reduce is not None:
        raise ValueError(f"{OP}: size_average and reduce (deprecated in torch) are not "
                         "supported: mean reduction only")
    if reduction != "mean":
        raise ValueError(f"{OP}: reduction={reduction!r} is not supported: mean reduction "
                         "only; use torch.nn.functional.cross_entropy")
    if float(label_smoothing) != 0.0:
        raise ValueError(f"{OP}: label_smoothing={label_smoothing} is not supported: no "
                         "label smoothing only (0.0); use torch.nn.functional.cross_entropy")


def _check_labels(labels: torch.Tensor, classes: int, ignore_index: int) -> int:
    """Rows that count (label != ignore_index); raises on a label outside [0, classes)."""
    if labels.numel() == 0:
        return 0
    counted = labels != ignore_index
    big = torch.iinfo(torch.int64).max
    lab = labels.long()
    # One read-back for all three numbers (each .item() would be a device sync).
    n, lo, hi = torch.stack([counted.sum(),
                             torch.where(counted, lab, big).min(),
                             torch.where(counted, lab, -big).max()]).tolist()
    if n and (lo < 0 or hi >= classes):
        bad = lo if lo < 0 else hi
        raise ValueError(f"{OP}: labels must lie in [0, classes) = [0, {classes}) or equal "
                         f"ignore_index = {ignore_index}; found {bad}")
    return int(n)


# The op ``torch_sparse_metal::cross_entropy``: ``(mean loss, d loss / d logits)`` from one
# dispatch. The kernel checks the labels; strict mode's check (one read-back) runs inside
# the op, so it holds under torch.compile too.


def _kernel(logits, labels, ignore_index, need_grad, strict, *, backend):
    if strict:
        _check_labels(labels, logits.shape[1], ignore_index)
    loss, grad_logits = _forward(logits.contiguous(), labels, ignore_index, backend,
                                 need_grad=need_grad)
    return loss, grad_logits if need_grad else _custom_ops.empty_like_none(loss)


def _fake(logits, labels, ignore_index, need_grad, strict):
    return logits.new_empty(()), logits.new_empty(logits.shape if need_grad else (0,))


def _setup_context(ctx, inputs, output) -> None:
    _, labels, ctx.ignore_index, ctx.need_grad, _ = inputs
    ctx.save_for_backward(output[1], labels)
    # A gradient into grad_logits arrives only in a double backward (grad_logits is saved
    # as that output): None, not zeros, tells the two apart.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, grad_of_grad_logits):
    grad_logits, labels = ctx.saved_tensors
    # grad_logits = (softmax(logits) - onehot(label)) * weight, weight = 1 / count on the
    # rows that count and 0 on the others (the logits are not saved, as torch's
    # cross_entropy does not save them). Computed in float32 for 2-byte logits, as the
    # kernel computes, and rounded once: the formula cancels at the label.
    dtype = grad_logits.dtype
    if dtype in (torch.float16, torch.bfloat16):
        grad_logits = grad_logits.float()
        grad_loss = None if grad_loss is None else grad_loss.float()
        grad_of_grad_logits = None if grad_of_grad_logits is None else grad_of_grad_logits.float()
    counted = labels != ctx.ignore_index
    count = counted.sum()
    weight = (counted.to(grad_logits.dtype) / count.clamp(min=1))[:, None]
    # A comparison, not one_hot, which reads the labels back to check them (the kernel
    # flagged a bad one, its row NaN).
    classes = torch.arange(grad_logits.shape[1], device=labels.device)
    onehot = (classes == labels[:, None]) & counted[:, None]
    grad = None
    if grad_loss is not None:
        # torch's chain, nll_loss's backward (-weight * grad_loss at the label) then
        # log_softmax's (+ softmax * weight * grad_loss): grad_logits * grad_loss for a
        # finite grad_loss, but an infinite or NaN one gives torch's NaN at the label and 0
        # in the rows that do not count. Plain torch ops, not a kernel.
        at_label = torch.where(onehot, -weight * grad_loss, 0)
        grad = torch.where(counted[:, None],
                           at_label + (grad_logits + onehot * weight) * grad_loss, grad_logits)
    if grad_of_grad_logits is not None and ctx.need_grad:
        # The second-order term: softmax's derivative, by torch's formula, with the softmax
        # recovered from what the kernel wrote.
        softmax = grad_logits * count + onehot
        term = torch.ops.aten._softmax_backward_data(grad_of_grad_logits * weight, softmax, 1,
                                                     grad_logits.dtype)
        grad = term if grad is None else grad + term
    return (None if grad is None else grad.to(dtype)), None, None, None, None


_CROSS_ENTROPY = _custom_ops.define(
    "cross_entropy(Tensor logits, Tensor labels, int ignore_index, bool need_grad, "
    "bool strict) -> (Tensor, Tensor)", _kernel, _fake, backward=_backward,
    setup_context=_setup_context, autocast=torch.float32)


def _forward(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, backend: str, *,
             need_grad: bool):
    batch, classes = logits.shape
    grad_logits = logits.new_empty(batch, classes) if need_grad else None
    if batch == 0:
        # torch: the mean over no rows is NaN (and there is no gradient to write).
        return logits.new_full((), float("nan")), grad_logits
    loss = logits.new_empty(1)
    labels32 = labels if labels.dtype == torch.int32 else labels.to(torch.int32)
    args = (logits, labels32.contiguous(), loss,
            grad_logits if need_grad else logits.new_empty(1),
            np.uint32(batch), np.uint32(classes), np.int32(ignore_index),
            np.uint32(need_grad), error_word(logits.device))
    # The whole batch runs in one threadgroup (see the shader): as many threads as rows, in
    # whole SIMD-groups, up to what the pipeline allows (1024 at most).
    name = kernel_name("cross_entropy_forward", logits.dtype)
    limit = _launch.max_threads_per_group(SHADER, name, backend) // SIMD_WIDTH * SIMD_WIDTH
    group = min(limit, -(-batch // SIMD_WIDTH) * SIMD_WIDTH)
    _launch.launch(SHADER, name, args, threads=group, group_size=group, backend=backend)
    return loss.reshape(()), grad_logits
