"""Modules built on the package's ops."""
from .sparse_linear import SparseLinear, random_csr_pattern

__all__ = ["SparseLinear", "random_csr_pattern"]
