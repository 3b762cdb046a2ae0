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
from .._backend import resolve_backend
from .._kernel_names import kernel_name, kernel_names_for
from ..metal._binding import SIMD_WIDTH

OP = "cross_entropy"
SHADER = "cross_entropy.metal"
KERNELS = ("cross_entropy_forward",)

__all__ = ["cross_entropy"]


def kernel_names(backend: str = "emulator") -> Tuple[str, ...]:
    """Every kernel name the host code can ask ``backend`` for (tests check they exist)."""
    return kernel_names_for(KERNELS, backend)


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

    Labels outside ``[0, classes)`` raise ``ValueError`` before any kernel runs; checking
    them reads two numbers back from the device (one sync), as torch's own CPU op does.
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

    backend = resolve_backend(OP, (logits,))
    if backend == "reference":
        # Inside a compiled graph the check cannot read the labels back: torch's own
        # cross_entropy checks them there.
        if not torch.compiler.is_compiling():
            _check_labels(labels, classes, ignore_index)
        return torch.nn.functional.cross_entropy(logits, labels.long(), ignore_index=ignore_index)
    V.check_kernel_dtype(OP, logits.dtype, backend)
    V.check_fits_uint32(OP, "batch * classes", batch * classes)
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    loss, _ = _CROSS_ENTROPY(logits, labels, ignore_index, need_grad)
    return loss


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
# dispatch; the label check (one read-back) runs inside it, so it holds under torch.compile.


def _kernel(logits, labels, ignore_index, need_grad, *, backend):
    count = _check_labels(labels, logits.shape[1], ignore_index)
    loss, grad_logits = _forward(logits.contiguous(), labels, ignore_index, count, backend,
                                 need_grad=need_grad)
    return loss, grad_logits if need_grad else _custom_ops.empty_like_none(loss)


def _fake(logits, labels, ignore_index, need_grad):
    return logits.new_empty(()), logits.new_empty(logits.shape if need_grad else (0,))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])


def _backward(ctx, grad_loss, _grad_of_grad_logits):
    (grad_logits,) = ctx.saved_tensors
    # The kernel already wrote d mean_loss / d logits; chain rule with the scalar
    # upstream gradient is one plain torch multiply, not a kernel.
    return grad_logits * grad_loss, None, None, None


_CROSS_ENTROPY = _custom_ops.define(
    "cross_entropy(Tensor logits, Tensor labels, int ignore_index, bool need_grad) "
    "-> (Tensor, Tensor)", _kernel, _fake, backward=_backward, setup_context=_setup_context)


def _forward(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, count: int,
             backend: str, *, need_grad: bool):
    batch, classes = logits.shape
    grad_logits = logits.new_empty(batch, classes) if need_grad else None
    if count == 0:
        # torch: the mean over no rows is NaN and every row's gradient is zero.
        if grad_logits is not None:
            grad_logits.zero_()
        return logits.new_full((), float("nan")), grad_logits
    loss = logits.new_empty(1)
    labels32 = labels if labels.dtype == torch.int32 else labels.to(torch.int32)
    scalar = np.float64 if logits.dtype == torch.float64 else np.float32
    args = (logits, labels32.contiguous(), loss,
            grad_logits if need_grad else logits.new_empty(1),
            np.uint32(batch), np.uint32(classes), np.int32(ignore_index),
            scalar(1.0 / count), np.uint32(need_grad))
    # The whole batch runs in one threadgroup (see the shader): as many threads as rows, in
    # whole SIMD-groups, up to what the pipeline allows (1024 at most).
    name = kernel_name("cross_entropy_forward", logits.dtype)
    limit = _launch.max_threads_per_group(SHADER, name, backend) // SIMD_WIDTH * SIMD_WIDTH
    group = min(limit, -(-batch // SIMD_WIDTH) * SIMD_WIDTH)
    _launch.launch(SHADER, name, args, threads=group, group_size=group, backend=backend)
    return loss.reshape(()), grad_logits
