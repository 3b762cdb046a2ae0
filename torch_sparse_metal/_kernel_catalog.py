"""Every kernel the package's host code can launch, by shader: what ``doctor`` builds and
``selftest`` must cover."""
from __future__ import annotations

import importlib
from typing import Dict, Tuple


def kernels_by_shader(backend: str) -> Dict[str, Tuple[str, ...]]:
    """``shaders/`` file -> the kernel names the ops can ask ``backend`` ("metal" or
    "emulator") for: each op module's ``kernel_names``, grouped by the shader holding them."""
    # ops/__init__ exports the function sparse_linear under its module's name.
    sparse_linear = importlib.import_module(".ops.sparse_linear", __package__)
    from .nn import functional as cross_entropy
    from .ops import block_sparse_linear, kmeans, matmul
    from .optim import adamw

    catalog: Dict[str, Tuple[str, ...]] = {}
    for module in (sparse_linear, block_sparse_linear, cross_entropy, adamw, kmeans):
        catalog[module.SHADER] = module.kernel_names(backend)
    for rung in matmul.RUNGS.values():
        catalog[rung.shader] = tuple(name for name in matmul.kernel_names(backend)
                                     if name.startswith(f"matmul_{rung.name}_"))
    return dict(sorted(catalog.items()))


def dtype_of(kernel: str) -> str:
    """The ``_<dtype>`` suffix :func:`~torch_sparse_metal._kernel_names.kernel_name` gives."""
    return kernel.rsplit("_", 1)[-1]
