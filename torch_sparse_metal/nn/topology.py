"""Evolving sparse topology: ``prune_and_regrow`` (SET / RigL style) for ``SparseLinear``, and
for ``BlockSparseLinear`` at block granularity.

Every step is a torch op on the layer's device whose output size the host knows, so
nothing is read back (no GPU sync on MPS), and the layer's tensors are rewritten in place
with the same nnz, so an optimizer that holds the weight (including
:class:`torch_sparse_metal.optim.AdamW`, whose parameters are views of its flat buffer)
keeps working: its per-edge state is permuted along with the edges.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .. import _validation as V
from ..checks import check_invariants
from ..ops.block_sparse_linear import BSRPattern
from ..ops.sparse_linear import CSRPattern
from .block_sparse_linear import BlockSparseLinear
from .sparse_linear import SparseLinear

OP = "prune_and_regrow"
MODES = ("magnitude", "random", "gradient")


@torch.no_grad()
def prune_and_regrow(layer: Union[SparseLinear, BlockSparseLinear], fraction: float,
                     mode: str = "magnitude", *,
                     optimizer: Optional[torch.optim.Optimizer] = None,
                     dense_grad: Optional[torch.Tensor] = None,
                     generator: Optional[torch.Generator] = None) -> int:
    """Remove ``round(fraction * nnz)`` edges of ``layer`` and grow as many new ones; for a
    :class:`BlockSparseLinear`, ``round(fraction * nnzb)`` blocks.

    Modes:
        ``"magnitude"`` (SET): drop the edges of smallest ``|weight|``, grow random empty
        cells. ``"random"``: drop random edges, grow random empty cells (a baseline).
        ``"gradient"`` (RigL): drop the edges of smallest ``|weight|``, grow the empty cells
        of largest ``|dense_grad|``, where ``dense_grad`` is ``d loss / d W`` as a dense
        ``(out_features, in_features)`` tensor, e.g. ``grad_output.T @ input`` of a batch.
        At block granularity the magnitude of a block is its Frobenius norm, and a cell's
        gradient the norm of ``dense_grad`` over the block.

    New edges start at weight 0 (as in RigL), so the layer's function is unchanged except
    for the dropped edges. They are grown only in cells empty before the drop (a dropped
    edge does not come straight back); nnz stays fixed. The CSR (by target) is rebuilt in
    row-major order, and the by-source CSR with it.

    ``optimizer``: its state tensors shaped like the weight (``exp_avg``, ...) are
    permuted with the edges, new edges getting zeros; scalar state (``step``) is kept.
    ``layer.weight.grad``, if any, is permuted the same way.

    Returns the number of edges (blocks) replaced. No read-back: the count of empty cells
    comes from the host's knowledge of the pattern (nnz, for a pattern without duplicate
    entries, which ``SparseLinear(density=...)`` and every regrown pattern are), except the
    first time for a pattern given with explicit indices, or always for one with duplicate
    entries (one read-back then). A generator on another device than the layer's costs one
    copy of the random scores to the device.
    """
    if not isinstance(layer, (SparseLinear, BlockSparseLinear)):
        raise TypeError(f"{OP}: layer must be a SparseLinear or a BlockSparseLinear, got "
                        f"{type(layer).__name__}")
    if mode not in MODES:
        raise ValueError(f"{OP}: mode must be one of {list(MODES)}, got {mode!r}")
    fraction = V.check_number(OP, "fraction", fraction, minimum=0, maximum=1)
    out_f, in_f = layer.out_features, layer.in_features
    if mode == "gradient":
        if dense_grad is None:
            raise ValueError(f"{OP}: mode 'gradient' needs dense_grad, the dense "
                             f"(out_features, in_features) = ({out_f}, {in_f}) gradient of W")
        if tuple(dense_grad.shape) != (out_f, in_f):
            raise ValueError(f"{OP}: dense_grad has shape {tuple(dense_grad.shape)}, expected "
                             f"(out_features, in_features) = ({out_f}, {in_f})")

    weight = layer.weight
    device = weight.device
    if isinstance(layer, BlockSparseLinear):
        B = layer.block
        pattern = layer.pattern()
        rows_of, cols_of, n = pattern.block_rows(), pattern.col, pattern.nnzb
        grid = (out_f // B, in_f // B)
        distinct = pattern.distinct_blocks()
        magnitude = weight.detach().float().square().sum((1, 2))  # the norm's order
        if mode == "gradient":
            dense_grad = dense_grad.detach().float().reshape(grid[0], B, grid[1], B)
            dense_grad = dense_grad.square().sum((1, 3))
    else:
        pattern = layer._current_pattern(read_back=check_invariants.is_enabled())
        rows_of, cols_of, n = pattern.row_ids(), pattern.indices, pattern.nnz
        grid = (out_f, in_f)
        distinct = pattern.distinct_cells()
        magnitude = weight.detach().abs().float()
    cells_total = grid[0] * grid[1]
    cells = rows_of.to(device) * grid[1] + cols_of.to(device).long()
    occupied = torch.zeros(cells_total, dtype=torch.bool, device=device).index_fill_(0, cells, True)
    k = min(round(fraction * n), cells_total - distinct)
    if k == 0:
        return 0

    # Drop: the k weakest edges, or k random ones. The kept ones in edge order come first
    # in a stable sort on the drop flag (nonzero() would size its output from the data).
    drop_score = _uniform(n, generator, device) if mode == "random" else magnitude
    drop = torch.topk(drop_score, k, largest=False).indices
    dropped = torch.zeros(n, dtype=torch.int32, device=device).index_fill_(0, drop, 1)
    kept = torch.sort(dropped, stable=True).indices[:n - k]

    # Grow: among cells empty before the drop. Scores are float32 (MPS has no float64).
    if mode == "gradient":
        grow_score = dense_grad.detach().abs().reshape(-1).to(device=device, dtype=torch.float32)
    else:
        grow_score = _uniform(cells_total, generator, device)
    # Every score is >= 0 (|grad|, or uniform in [0, 1)) and an occupied cell gets -1, so
    # no occupied cell is picked while empty ones remain; k <= the empty cells, so none is.
    grow_score = grow_score.masked_fill(occupied, -1.0)
    grown = torch.topk(grow_score, k).indices

    # New pattern: kept edges then grown ones, sorted row-major (stable: duplicate cells
    # of the old pattern keep their order). indptr[r] counts the edges of rows before r.
    new_cells = torch.cat([cells[kept], grown])
    new_cells, order = torch.sort(new_cells, stable=True)
    rows = torch.div(new_cells, grid[1], rounding_mode="floor")
    indptr = torch.searchsorted(rows, torch.arange(grid[0] + 1, device=device))

    def moved(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[kept], t.new_zeros(k, *t.shape[1:])])[order]

    weight.copy_(moved(weight))
    if weight.grad is not None:
        weight.grad.copy_(moved(weight.grad))
    if optimizer is not None:
        for value in optimizer.state.get(weight, {}).values():
            if isinstance(value, torch.Tensor) and value.shape == weight.shape:
                value.copy_(moved(value))
    # In place (same nnz, same tensors), so a compiled model's graph keeps reading them.
    # The new pattern is valid by construction: no validation, no read-back; grown cells
    # were empty, so duplicates are only those the kept edges had.
    known = n if distinct == n else None
    if isinstance(layer, BlockSparseLinear):
        layer.col.copy_((new_cells - rows * grid[1]).to(layer.col.dtype))
        layer.crow.copy_(indptr.to(layer.crow.dtype))
        layer._adopt_pattern(BSRPattern.trusted(layer.crow, layer.col, in_f, out_f, layer.block,
                                                distinct_blocks=known))
    else:
        layer.indices.copy_((new_cells - rows * in_f).to(layer.indices.dtype))
        layer.indptr.copy_(indptr.to(layer.indptr.dtype))
        layer._adopt_pattern(CSRPattern.trusted(layer.indptr, layer.indices, in_f,
                                                distinct_cells=known))
    return k


def _uniform(n: int, generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    """``n`` float32 uniforms in [0, 1) on ``device``, drawn where the generator lives.

    As ``SparseLinear.reset_parameters``: a generator samples on its own device (a CPU
    generator cannot drive ``torch.rand(..., device="mps")``), then the result moves.
    Without a generator, the default one of ``device``.
    """
    where = generator.device if generator is not None else device
    return torch.rand(n, generator=generator, device=where, dtype=torch.float32).to(device)


def edges_per_row(layer: SparseLinear) -> torch.Tensor:
    """Number of edges of each target neuron (int64), e.g. for topology plots."""
    return (layer.indptr[1:] - layer.indptr[:-1]).long()


__all__ = ["prune_and_regrow", "edges_per_row"]
