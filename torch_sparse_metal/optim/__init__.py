"""Optimizers whose step is one kernel dispatch for every parameter."""
from .adamw import AdamW, grad_norm_of

__all__ = ["AdamW", "grad_norm_of"]
