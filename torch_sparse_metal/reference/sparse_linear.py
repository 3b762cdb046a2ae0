"""``input @ W.T + bias`` for a CSR ``W``, from plain torch ops (autograd comes for free).

Independent of the kernels on purpose: it gathers every edge's source activation, scales
it by the edge's value and sums the products into the edge's target row with
``index_add``. That costs ``batch x nnz`` memory, fine for an oracle and for small layers,
and runs on any device and floating dtype torch supports.
"""
from __future__ import annotations

from typing import Optional

import torch

from .activations import apply_activation

def csr_row_ids(indptr: torch.Tensor, nnz: Optional[int] = None) -> torch.Tensor:
    """The target row of every edge (int64), e.g. ``[0, 2, 2, 3] -> [0, 0, 2]``.

    ``nnz`` (the number of edges, ``len(indices)``) makes the output's size known without
    reading ``indptr`` back, so ``torch.compile`` traces it; an ``indptr`` that does not
    end at ``nnz`` is then a RuntimeError."""
    indptr = indptr.long()
    n_rows = indptr.shape[0] - 1
    counts = indptr[1:] - indptr[:-1]
    return torch.repeat_interleave(torch.arange(n_rows, device=indptr.device), counts,
                                   output_size=nnz)


def sparse_linear_reference(input: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                            values: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                            activation: Optional[str] = None) -> torch.Tensor:
    """``input (*, in_features) -> (*, out_features)``; ``W`` has ``len(indptr) - 1`` rows.

    Expects a valid pattern (the op validates before calling it). float16 and bfloat16 sum
    in float32 and round the pre-activation once, as the kernels do; the activation then
    runs in that dtype.
    """
    dtype = input.dtype
    if dtype in (torch.float16, torch.bfloat16):
        input, values = input.float(), values.float()
        bias = None if bias is None else bias.float()
    out_features = indptr.shape[0] - 1
    in_features = input.shape[-1]
    lead = input.shape[:-1]
    x = input.reshape(-1, in_features) if in_features else input.reshape(lead.numel(), 0)
    rows = csr_row_ids(indptr, indices.shape[0])
    contributions = x.index_select(1, indices.long()) * values  # (batch, nnz)
    out = x.new_zeros(x.shape[0], out_features).index_add(1, rows, contributions)
    if bias is not None:
        out = out + bias
    return apply_activation(out.to(dtype), activation).reshape(*lead, out_features)
