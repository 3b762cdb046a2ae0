"""The one place kernel host names are built: ``<base>_<dtype>``, as the shaders register them."""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch

from ._validation import KERNEL_DTYPES

_DTYPE_SUFFIX = {
    torch.float32: "float",
    torch.float16: "half",
    torch.bfloat16: "bfloat",
    torch.float64: "double",  # emulator builds only: Metal has no double
}


def dtype_suffix(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_SUFFIX[dtype]
    except KeyError:
        raise TypeError(f"no kernel for dtype {dtype}; supported: "
                        f"{', '.join(str(d) for d in _DTYPE_SUFFIX)}") from None


def kernel_name(base: str, dtype: torch.dtype) -> str:
    return f"{base}_{dtype_suffix(dtype)}"


def kernel_names_for(bases: Iterable[str], backend: str, table: Optional[
        Dict[str, Tuple[torch.dtype, ...]]] = None) -> Tuple[str, ...]:
    """Every ``<base>_<dtype>`` an op's host code can ask ``backend`` for: the ops' own
    ``kernel_names()``, which the tests check against the compiled libraries. ``table``:
    the op's backend -> dtypes map (default :data:`KERNEL_DTYPES`)."""
    dtypes = (KERNEL_DTYPES if table is None else table)[backend]
    return tuple(kernel_name(base, dtype) for base in bases for dtype in dtypes)


def library_kernels(shader: str, bases: Iterable[str], dtype: torch.dtype
                    ) -> Tuple[Tuple[str, str], ...]:
    """``(shader, <base>_<dtype>)`` for each base: what an op tells ``resolve_backend`` it
    may launch for ``dtype``, so that ``"auto"`` checks they build before the first."""
    return tuple((shader, kernel_name(base, dtype)) for base in bases)
