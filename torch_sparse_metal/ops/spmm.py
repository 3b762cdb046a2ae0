"""``spmm``: a sparse CSR matrix times a dense matrix, on the sparse layer's kernels.

``A @ B`` for ``A`` sparse ``(m, k)`` and ``B`` dense ``(k, n)`` is ``(B.T @ A.T).T``, and
``B.T @ A.T`` is what :func:`~torch_sparse_metal.sparse_linear` computes with ``A`` as its
weight and the ``n`` columns of ``B`` as its batch: one thread per output element walking
a row of ``A``, and its one-dispatch backward for the gradients of ``B`` (through the
by-source CSR) and of ``A``'s values. The price of reusing them is two transposing copies,
of ``B`` (``k x n``) and of the result (``m x n``), beside the ``nnz x n`` products.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .. import _validation as V
from .._autocast import kernel_dtype
from ..formats import sparse_weight_parts
from .sparse_linear import CSRPattern, apply_pattern

OP = "spmm"


def spmm(sparse: Any, dense: torch.Tensor, *,
         deterministic: Optional[bool] = None) -> torch.Tensor:
    """``sparse @ dense``: ``(m, k)`` sparse by ``(k, n)`` dense, a dense ``(m, n)`` result.

    Args:
        sparse: a torch sparse CSR tensor, a sparse COO tensor (coalesced and converted to
            CSR on each call) or a SciPy sparse matrix (no gradient); its values the dtype
            and device of ``dense``.
        dense: ``(k, n)`` floating point, any strides.
        deterministic: the backward kernel, as in :func:`~torch_sparse_metal.sparse_linear`.

    Differentiable in both: the gradient of a sparse tensor that requires grad is a sparse
    CSR tensor with its pattern (as ``torch.sparse.mm`` gives), the gradient of ``dense`` is
    dense. Backends as everywhere: Metal kernels on MPS (where torch has no CSR product),
    the emulator with ``use_backend("emulator")``, plain torch otherwise.
    """
    indptr, indices, values, (m, k) = sparse_weight_parts(OP, sparse)
    V.check_tensor(OP, "dense", dense)
    V.check_dim(OP, "dense", dense, 2)
    V.check_floating(OP, "dense", dense)
    if dense.shape[0] != k:
        raise ValueError(f"{OP}: sparse is {(m, k)} and dense is {tuple(dense.shape)}; sparse's "
                         "columns must equal dense's rows")
    kernel_dtype(OP, {"dense": dense, "the sparse matrix's values": values})
    V.check_same_device(OP, {"dense": dense, "the sparse matrix": indptr})
    pattern = CSRPattern(indptr, indices, k, out_features=m, op=OP)
    product_t = apply_pattern(dense.t(), pattern, values, deterministic=deterministic, op=OP)
    return product_t.t().contiguous()
