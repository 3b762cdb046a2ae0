"""Plain-torch implementations of the ops: the "reference" backend and the tests' oracle."""
from .sparse_linear import csr_row_ids, sparse_linear_reference

__all__ = ["sparse_linear_reference", "csr_row_ids"]
