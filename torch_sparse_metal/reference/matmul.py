"""Plain-torch ``mm`` / ``addmm`` with the fused epilogue: the "reference" backend and the
tests' oracle for ``torch_sparse_metal.ops.matmul``."""
from __future__ import annotations

from typing import Optional

import torch

from .activations import apply_activation

def addmm_reference(bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor, *,
                    alpha: float = 1.0, beta: float = 1.0,
                    activation: Optional[str] = None) -> torch.Tensor:
    """``activation(beta * bias + alpha * a @ b)`` (``bias`` None: no bias term)."""
    if bias is None:
        z = torch.mm(a, b) if alpha == 1 else torch.mm(a, b) * alpha
    else:
        z = torch.addmm(bias, a, b, beta=beta, alpha=alpha)
        if alpha == 0:
            # torch.addmm's float32 and float64 BLAS skip a @ b when alpha = 0 (its half and
            # bfloat16 paths do not); the kernels scale it, so 0 * inf and 0 * NaN are NaN.
            z = z + torch.mm(a, b) * 0.0
    return apply_activation(z, activation)
