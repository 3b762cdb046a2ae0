"""The sparse matrices users already hold, read as the CSR arrays the kernels take, and back.

Accepted wherever the package takes a sparse weight (``sparse_linear``, ``spmm``,
``SparseLinear.from_sparse``):

* torch sparse CSR tensors (``torch.sparse_csr_tensor``, ``t.to_sparse_csr()``), int32 or
  int64 indices; autograd flows to their values;
* torch sparse COO tensors, coalesced and converted to CSR (differentiable too);
* SciPy sparse matrices and arrays of any format (``tocsr()``; no autograd).

Only 2-D matrices with scalar values: batched and hybrid tensors are refused.
"""
from __future__ import annotations

import sys
from typing import Any, Tuple

import numpy as np
import torch

_TORCH_SPARSE = (torch.sparse_csr, torch.sparse_coo)


def is_scipy_sparse(obj: Any) -> bool:
    """A SciPy sparse matrix or array (without importing SciPy: if it is not imported,
    nothing can be one)."""
    sparse = sys.modules.get("scipy.sparse")
    return sparse is not None and sparse.issparse(obj)


def is_sparse_weight(obj: Any) -> bool:
    """A torch sparse CSR or COO tensor, or a SciPy sparse matrix or array."""
    return (isinstance(obj, torch.Tensor) and obj.layout in _TORCH_SPARSE) \
        or is_scipy_sparse(obj)


def sparse_weight_parts(op: str, weight: Any) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                        Tuple[int, int]]:
    """``(indptr, indices, values, (rows, cols))`` of a sparse matrix, as tensors.

    For a torch tensor the values are ``weight.values()`` of its CSR form, so a weight that
    requires grad gets a sparse gradient with its pattern. SciPy arrays become CPU tensors
    sharing their memory where NumPy allows. ``op`` starts the error messages.
    """
    if isinstance(weight, torch.Tensor):
        if weight.layout not in _TORCH_SPARSE:
            raise TypeError(f"{op}: expected a sparse CSR or COO tensor, got layout "
                            f"{weight.layout}")
        if weight.dim() != 2 or weight.dense_dim() != 0:
            raise ValueError(f"{op}: the sparse weight must be a 2-D matrix of scalars, got "
                             f"shape {tuple(weight.shape)} with {weight.dense_dim()} dense "
                             "dimension(s)")
        if weight.layout == torch.sparse_coo:
            weight = weight.coalesce().to_sparse_csr()
        return (weight.crow_indices(), weight.col_indices(), weight.values(),
                tuple(weight.shape))
    if is_scipy_sparse(weight):
        if weight.ndim != 2:
            raise ValueError(f"{op}: the sparse weight must be 2-D, got shape {weight.shape}")
        csr = weight.tocsr()
        parts = (np.ascontiguousarray(a) for a in (csr.indptr, csr.indices, csr.data))
        indptr, indices, data = (a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))
                                 for a in parts)
        return (torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(data),
                tuple(csr.shape))
    raise TypeError(f"{op}: expected a torch sparse CSR or COO tensor or a SciPy sparse "
                    f"matrix, got {type(weight).__name__}")


def to_scipy(weight: torch.Tensor):
    """A torch sparse CSR or COO matrix as a ``scipy.sparse.csr_array`` (values detached and
    copied to the CPU; indices as they are, int32 or int64)."""
    if not (isinstance(weight, torch.Tensor) and weight.layout in _TORCH_SPARSE):
        raise TypeError(f"to_scipy: expected a torch sparse CSR or COO tensor, got "
                        f"{type(weight).__name__}")
    import scipy.sparse
    indptr, indices, values, shape = sparse_weight_parts("to_scipy", weight)
    return scipy.sparse.csr_array(
        tuple(t.detach().cpu().numpy() for t in (values, indices, indptr)), shape=shape)
