"""torch_sparse_metal: hand-written Metal kernels for PyTorch on Apple GPUs.

Every kernel lives once, in ``shaders/*.metal``; it runs on the GPU for MPS tensors and
through the package's Metal emulator for CPU tensors (see :mod:`torch_sparse_metal.emulator`).
"""
from ._version import __version__ as __version__  # the package's public version
from . import emulator
from ._record import record
from . import syncs
from ._backend import get_backend, use_backend
from .checks import InvalidInputError, check_errors, check_invariants
from ._metal_backend import is_available as metal_available
from .ops.sparse_linear import sparse_linear
from .ops.spmm import spmm
from .ops.block_sparse_linear import block_sparse_linear
from . import formats
from .ops.matmul import addmm, mm
from . import nn
from .cluster import KMeans
from . import optim

__all__ = ["emulator", "record", "use_backend", "get_backend", "metal_available", "sparse_linear", "nn",
           "optim", "KMeans"]
__all__ += ["mm", "addmm", "spmm", "block_sparse_linear", "formats", "syncs", "check_errors", "check_invariants",
            "InvalidInputError", "show_config"]


def show_config(build: bool = True) -> None:
    """Print what this machine can run and why not: ``python -m torch_sparse_metal.doctor``."""
    from .doctor import show_config as show   # not at import: `python -m ...doctor` runs it
    show(build)
