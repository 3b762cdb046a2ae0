"""Modules built on the package's ops, the fused loss, and evolving sparse topology."""
from . import functional
from .linear import Linear
from .sparse_linear import SparseLinear, random_csr_pattern
from .block_sparse_linear import BlockSparseLinear
from .topology import edges_per_row, prune_and_regrow

__all__ = ["SparseLinear", "random_csr_pattern", "functional", "prune_and_regrow",
           "edges_per_row"]
__all__ += ["Linear", "BlockSparseLinear"]
