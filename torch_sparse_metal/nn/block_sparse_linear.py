"""``BlockSparseLinear``: ``nn.Linear`` with a weight of ``B x B`` blocks in BSR form."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from .. import _validation as V
from ..ops.block_sparse_linear import (BSRPattern, BySource, apply_block_pattern,
                                       check_block)

_MODULE = "BlockSparseLinear"


def balanced_block_pattern(block_rows: int, block_cols: int, density: float, *,
                           generator: Optional[torch.Generator] = None
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``round(density * block_rows * block_cols)`` distinct blocks, spread over the block
    rows as evenly as they divide (random rows get the remainder's one more), uniform among
    a row's columns. A block row without blocks is ``block`` dead outputs, which a uniform
    draw leaves often at low density (a 16-output last layer of 8x8 blocks at 10% has
    three blocks for two rows). Returns ``(crow, col)`` int32 on the generator's device
    (CPU by default), columns sorted within each row."""
    density = V.check_number(_MODULE, "density", density, minimum=0, maximum=1)
    device = generator.device if generator is not None else torch.device("cpu")
    n = round(density * block_rows * block_cols)
    base, extra = divmod(n, max(block_rows, 1))
    per_row = torch.full((block_rows,), base, dtype=torch.long, device=device)
    per_row[torch.randperm(block_rows, generator=generator, device=device)[:extra]] += 1
    # Each cell's rank in its row under random scores: a row keeps its per_row lowest.
    scores = torch.rand(block_rows, block_cols, generator=generator, device=device)
    rank = scores.argsort(1).argsort(1)
    col = (rank < per_row[:, None]).nonzero()[:, 1]  # row-major: columns sorted per row
    crow = torch.cat([per_row.new_zeros(1), per_row.cumsum(0)])
    return crow.to(torch.int32), col.to(torch.int32)


class BlockSparseLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` (out_features x in_features) made of ``block x block``
    blocks (``block`` 8, 16 or 32; both sizes multiples of it), stored as BSR: block rows by
    target neuron, a by-source twin for the backward. One forward dispatch and one fused
    backward dispatch on ``simdgroup_matrix`` 8x8 fragments (the SIMD-shuffle kernels on a GPU
    without them); float32, float16 and bfloat16 on Metal, and float64 on the emulator;
    ``torch.autocast`` as ``nn.Linear``.

    Give exactly one of ``density`` (a random pattern with that fraction of the blocks,
    spread evenly over the block rows: :func:`balanced_block_pattern`) or ``crow`` + ``col``
    (block indices: ``crow`` has ``out_features / block + 1`` entries).

    Attributes:
        weight: ``(nnzb, block, block)``: ``weight[k][i][j] = W[r block + i, c block + j]``
            for block ``k`` at block row ``r``, block column ``c``.
        bias: ``(out_features,)`` or None.
        crow, col: the block pattern (int32 buffers, saved in the state dict).
        src_ptr, src_rows, src_perm: the pattern by block column (derived, rebuilt when it
            changes).

    Initialisation follows ``nn.Linear`` with each row's real fan-in (its blocks times
    ``block``). :meth:`from_dense` keeps the blocks of largest norm of a dense weight;
    :meth:`from_sparse_bsr` takes a torch BSR tensor; :meth:`to_dense` and
    :meth:`to_sparse_bsr` give ``W`` back. A pattern is validated when it changes as torch
    sees it (one read-back); the kernels check the indices they follow, so an edit behind
    torch's back shows as NaN outputs and :func:`~torch_sparse_metal.check_errors`.
    """

    def __init__(self, in_features: int, out_features: int, block: int, *,
                 density: Optional[float] = None, crow: Optional[torch.Tensor] = None,
                 col: Optional[torch.Tensor] = None, bias: bool = True, device=None,
                 dtype=None, generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        self.block = check_block(_MODULE, block)
        self.in_features = V.check_int(_MODULE, "in_features", in_features, minimum=0)
        self.out_features = V.check_int(_MODULE, "out_features", out_features, minimum=0)
        given = crow is not None or col is not None
        if (density is not None) == given:
            raise ValueError(f"{_MODULE}: give exactly one of density or crow + col")
        if given and (crow is None or col is None):
            raise ValueError(f"{_MODULE}: crow and col go together")
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            if n % block:
                raise ValueError(f"{_MODULE}: {name} = {n} is not a multiple of the block "
                                 f"size {block}")
        if density is not None:
            crow, col = balanced_block_pattern(out_features // block, in_features // block,
                                               density, generator=generator)
            pattern = BSRPattern.trusted(crow, col, in_features, out_features, block,
                                         distinct_blocks=col.shape[0])
        else:
            pattern = BSRPattern(crow, col, in_features, out_features, block, op=_MODULE)
        self.weight = nn.Parameter(torch.empty(pattern.nnzb, block, block, device=device,
                                               dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        device = self.weight.device
        pattern = BSRPattern.trusted(pattern.crow.to(device), pattern.col.to(device),
                                     in_features, out_features, block,
                                     distinct_blocks=pattern._distinct)
        self.register_buffer("crow", pattern.crow)
        self.register_buffer("col", pattern.col)
        src = pattern.by_source()
        self.register_buffer("src_ptr", src.indptr, persistent=False)
        self.register_buffer("src_rows", src.rows, persistent=False)
        self.register_buffer("src_perm", src.perm, persistent=False)
        self._pattern, self._pattern_key = pattern, self._buffers_key()
        self.reset_parameters(generator=generator)

    # -- the pattern -----------------------------------------------------------------------

    def _buffers_key(self) -> tuple:
        return tuple((t.device, t.data_ptr(), t._version, t.shape, t.dtype)
                     for t in (self.crow, self.col))

    def pattern(self) -> BSRPattern:
        """The current pattern: validated and transposed again only after its buffers
        changed as torch sees them (a new tensor, an in-place write, ``load_state_dict``)."""
        if self._buffers_key() != self._pattern_key:
            self._adopt_pattern(BSRPattern(self.crow, self.col, self.in_features,
                                           self.out_features, self.block, op=_MODULE))
        return self._pattern

    def _adopt_pattern(self, pattern: BSRPattern) -> None:
        src: BySource = pattern.by_source()
        self.crow, self.col = pattern.crow, pattern.col
        self.src_ptr, self.src_rows, self.src_perm = src
        self._pattern, self._pattern_key = pattern, self._buffers_key()

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """L2 norm of this layer's gradients as the last :class:`torch_sparse_metal.optim.AdamW`
        step read them (see ``SparseLinear.grad_norm``), or None before such a step."""
        from ..optim.adamw import grad_norm_of
        return grad_norm_of(p for p in (self.weight, self.bias) if p is not None)

    @property
    def nnzb(self) -> int:
        return self.col.shape[0]

    @property
    def nnz(self) -> int:
        return self.nnzb * self.block * self.block

    @property
    def density(self) -> float:
        cells = self.in_features * self.out_features
        return self.nnz / cells if cells else 0.0

    def block_rows(self) -> torch.Tensor:
        """The block row of every block (int64)."""
        return self.pattern().block_rows()

    # -- nn.Module API -------------------------------------------------------------------

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Uniform in ``+-1/sqrt(fan_in)`` per row, fan_in = the row's blocks x ``block``."""
        pattern = self.pattern()
        device = generator.device if generator is not None else self.weight.device
        dtype = torch.float64 if self.weight.dtype == torch.float64 else torch.float32
        fan_in = ((pattern.crow[1:] - pattern.crow[:-1]) * self.block).to(device=device,
                                                                            dtype=dtype)
        bound = torch.where(fan_in > 0, fan_in.clamp(min=1).rsqrt(), torch.zeros_like(fan_in))
        with torch.no_grad():
            u = torch.rand(self.weight.shape, generator=generator, device=device, dtype=dtype)
            self.weight.copy_((2 * u - 1) * bound[pattern.block_rows().to(device)][:, None, None])
            if self.bias is not None:
                u = torch.rand(self.out_features, generator=generator, device=device,
                               dtype=dtype)
                self.bias.copy_((2 * u - 1) * bound.repeat_interleave(self.block))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # No validation inside a graph: the buffers as eager code left them.
            pattern = BSRPattern.trusted(self.crow, self.col, self.in_features,
                                         self.out_features, self.block)
            pattern._by_source = BySource(self.src_ptr, self.src_rows, self.src_perm)
        else:
            pattern = self.pattern()
        return apply_block_pattern(input, pattern, self.weight, self.bias, op=_MODULE)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={self.block}, nnzb={self.nnzb}, density={self.density:.4g}, "
                f"bias={self.bias is not None}")

    # -- other formats -------------------------------------------------------------------

    def to_dense(self) -> torch.Tensor:
        """``W`` as a dense ``(out_features, in_features)`` tensor (differentiable)."""
        B, pattern = self.block, self.pattern()
        dense = self.weight.new_zeros(self.out_features // B, self.in_features // B, B, B)
        dense = dense.index_put((pattern.block_rows(), pattern.col.long()), self.weight)
        return dense.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)

    def to_sparse_bsr(self) -> torch.Tensor:
        """``W`` as a torch sparse BSR tensor with blocks ``(block, block)`` (int64 indices),
        differentiable in ``weight``."""
        pattern = self.pattern()
        return torch.sparse_bsr_tensor(pattern.crow.long(), pattern.col.long(), self.weight,
                                       (self.out_features, self.in_features),
                                       check_invariants=False)  # validated when adopted

    @classmethod
    def from_sparse_bsr(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
                        ) -> "BlockSparseLinear":
        """A layer holding a torch sparse BSR tensor's blocks (square blocks of 8, 16 or 32)
        and ``bias``; values and bias are copied."""
        if not isinstance(weight, torch.Tensor) or weight.layout != torch.sparse_bsr:
            raise TypeError(f"{_MODULE}.from_sparse_bsr: weight must be a torch sparse BSR "
                            f"tensor (Tensor.to_sparse_bsr(block)), got "
                            f"{getattr(weight, 'layout', type(weight).__name__)}")
        values = weight.values()
        if values.dim() != 3 or values.shape[1] != values.shape[2]:
            raise ValueError(f"{_MODULE}.from_sparse_bsr: blocks must be square, got "
                             f"{tuple(values.shape[1:])}")
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, values.shape[-1], crow=weight.crow_indices(),
                    col=weight.col_indices(), bias=bias is not None, device=values.device,
                    dtype=values.dtype)
        with torch.no_grad():
            layer.weight.copy_(values)
            if bias is not None:
                layer.bias.copy_(bias)
        return layer

    @classmethod
    def from_dense(cls, linear: Union[nn.Linear, torch.Tensor], block: int, *,
                   density: float, bias: Optional[torch.Tensor] = None) -> "BlockSparseLinear":
        """Prune an ``nn.Linear`` (or a dense ``(out, in)`` weight, with ``bias``) to the
        ``round(density * blocks)`` blocks of largest Frobenius norm, at least one."""
        if isinstance(linear, nn.Linear):
            weight, bias = linear.weight.detach(), linear.bias
        else:
            weight = V.check_floating_tensor(f"{_MODULE}.from_dense", "weight", linear, 2)
        density = V.check_number(_MODULE, "density", density, minimum=0, maximum=1)
        block = check_block(_MODULE, block)
        out_features, in_features = weight.shape
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            if n % block:
                raise ValueError(f"{_MODULE}.from_dense: {name} = {n} is not a multiple of "
                                 f"the block size {block}")
        R, C = out_features // block, in_features // block
        blocks = weight.reshape(R, block, C, block).permute(0, 2, 1, 3)  # (R, C, B, B)
        norms = blocks.float().square().sum((2, 3)).flatten()
        keep = max(1, round(density * R * C)) if R * C else 0
        chosen, _ = torch.sort(torch.topk(norms, keep).indices)
        rows, cols = chosen // C, chosen % C
        crow = torch.cat([rows.new_zeros(1), torch.bincount(rows, minlength=R).cumsum(0)])
        layer = cls(in_features, out_features, block, crow=crow, col=cols,
                    bias=bias is not None, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(blocks[rows, cols])
            if bias is not None:
                layer.bias.copy_(bias.detach())
        return layer


__all__ = ["BlockSparseLinear", "balanced_block_pattern"]
