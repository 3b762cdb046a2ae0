"""Plain-torch ``mm`` / ``addmm`` with the fused epilogue: the "reference" backend and the
tests' oracle for ``torch_sparse_metal.ops.matmul``."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# The activations the kernels fuse (same names and codes as the sparse layer's).
MATMUL_ACTIVATIONS = (None, "relu", "gelu", "tanh")


def matmul_activation(z: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    """``activation(z)``; ``"gelu"`` is the tanh approximation, as the kernels compute it."""
    if activation is None:
        return z
    if activation == "relu":
        return torch.relu(z)
    if activation == "gelu":
        return F.gelu(z, approximate="tanh")
    if activation == "tanh":
        return torch.tanh(z)
    raise ValueError(f"unknown activation {activation!r}; expected one of {MATMUL_ACTIVATIONS}")


def addmm_reference(bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor, *,
                    alpha: float = 1.0, beta: float = 1.0,
                    activation: Optional[str] = None) -> torch.Tensor:
    """``activation(beta * bias + alpha * a @ b)`` (``bias`` None: no bias term)."""
    if bias is None:
        z = torch.mm(a, b) if alpha == 1 else torch.mm(a, b) * alpha
    else:
        z = torch.addmm(bias, a, b, beta=beta, alpha=alpha)
    return matmul_activation(z, activation)
