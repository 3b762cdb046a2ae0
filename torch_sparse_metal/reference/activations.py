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


def activation_grad_reference(saved: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    """``act'(z)`` from what the kernels save: the output for relu / tanh, z for gelu."""
    check_activation("activation", activation)
    if activation == "relu":
        return (saved > 0).to(saved.dtype)
    if activation == "tanh":
        return 1 - saved * saved
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(torch.ones_like(saved), saved, approximate="tanh")
    return torch.ones_like(saved)
