"""The activations kernels fuse: names, and the codes ``shaders/activations.h`` defines."""
from __future__ import annotations

from typing import Optional

# "gelu" is the tanh approximation (torch's gelu(approximate="tanh")): MSL has no erf.
ACTIVATION_CODES = {None: 0, "relu": 1, "gelu": 2, "tanh": 3}


def check_activation(op: str, activation: Optional[str]) -> Optional[str]:
    """``activation`` is one of None, "relu", "gelu" (tanh approximation), "tanh"."""
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"{op}: activation must be one of {list(ACTIVATION_CODES)}, "
                         f"got {activation!r}")
    return activation
