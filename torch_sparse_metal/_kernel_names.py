"""The one place kernel host names are built: ``<base>_<dtype>``, as the shaders register them."""
from __future__ import annotations

import torch

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
