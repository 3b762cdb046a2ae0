"""``Linear``: ``torch.nn.Linear`` with its product computed by the matmul ladder."""
from __future__ import annotations

from typing import Optional

import torch

from .._validation import flat_batch
from ..ops.matmul import KERNELS, addmm

OP = "Linear"


class Linear(torch.nn.Linear):
    """A drop-in for :class:`torch.nn.Linear`: same constructor, parameters, initialisation
    and ``state_dict`` (it *is* an ``nn.Linear``), with ``forward`` running
    ``torch_sparse_metal.addmm(bias, x, weight.T)``: ``weight.T`` is read in place by the
    kernel variant for a transposed right operand, and the bias is fused into the epilogue.

    Extra keyword-only argument: ``kernel`` pins a rung of the ladder (None: chosen per
    shape and device by :func:`torch_sparse_metal.ops.matmul.choose_kernel`).

    Backends as everywhere in the package: Metal kernels on MPS tensors, the emulator with
    ``use_backend("emulator")``, plain torch otherwise.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None, *, kernel: Optional[str] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"{OP}: kernel must be None or one of {list(KERNELS)}, "
                             f"got {kernel!r}")
        self.kernel = kernel

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # flat_batch checks the shape and flattens without reshape(-1, ...): a (*, 0) input
        # (in_features = 0) is fine, as in torch.
        x, lead = flat_batch(OP, "input", input, self.in_features)
        out = addmm(self.bias, x, self.weight.t(), kernel=self.kernel)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        extra = f", kernel={self.kernel!r}" if self.kernel is not None else ""
        return super().extra_repr() + extra
