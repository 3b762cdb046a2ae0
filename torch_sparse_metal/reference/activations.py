"""Plain-torch activations and derivatives, as the kernels compute them."""
from __future__ import annotations

from typing import Optional

import torch

from .._activations import check_activation


def apply_activation(z: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    """``activation(z)`` with torch's own functions (differentiable)."""
    check_activation("activation", activation)
    if activation == "relu":
        return torch.relu(z)
    if activation == "gelu":
        return torch.nn.functional.gelu(z, approximate="tanh")
    if activation == "tanh":
        return torch.tanh(z)
    return z


def activation_backward_reference(grad: torch.Tensor, saved: torch.Tensor,
                                  activation: Optional[str]) -> torch.Tensor:
    """``d loss / d z`` from ``grad = d loss / d y`` and what the kernels save (the output for
    relu / tanh, z for gelu), by torch's own backward formulas. relu's selects where a
    product would not: ``grad`` where the output is not <= 0 (NaN included), else 0, an
    infinite ``grad`` too."""
    check_activation("activation", activation)
    if activation == "relu":
        return torch.ops.aten.threshold_backward(grad, saved, 0)
    if activation == "tanh":
        return torch.ops.aten.tanh_backward(grad, saved)
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(grad, saved, approximate="tanh")
    return grad


def activation_grad_reference(saved: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    """``act'(z)`` from what the kernels save: the output for relu / tanh, z for gelu."""
    return activation_backward_reference(torch.ones_like(saved), saved, activation)
