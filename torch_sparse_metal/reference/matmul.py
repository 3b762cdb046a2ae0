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
    return apply_activation(z, activation)
