"""The ops: host code that validates, allocates and launches the kernels in ``shaders/``."""
from .sparse_linear import BySource, CSRPattern, sparse_linear, sparse_linear_pattern
from .spmm import spmm

__all__ = ["sparse_linear", "sparse_linear_pattern", "CSRPattern", "BySource", "spmm"]
