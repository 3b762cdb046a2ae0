"""The ops: host code that validates, allocates and launches the kernels in ``shaders/``."""
from .sparse_linear import BySource, CSRPattern, sparse_linear, sparse_linear_pattern
from .spmm import spmm
# Not the function block_sparse_linear (tsm.block_sparse_linear): ops.block_sparse_linear
# stays the module.
from .block_sparse_linear import BSRPattern, apply_block_pattern

__all__ = ["sparse_linear", "sparse_linear_pattern", "CSRPattern", "BySource", "spmm",
           "apply_block_pattern", "BSRPattern"]
