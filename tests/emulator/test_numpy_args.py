"""NumPy arrays bind like tensors: the kernel writes into the caller's array."""
import numpy as np
import pytest

from torch_sparse_metal.emulator import LaunchError, compile_shader

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
kernel void twice(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                  uint i [[thread_position_in_grid]]) {
  y[i] = 2.0f * x[i];
}
"""


def test_numpy_output_receives_the_writes():
    lib = compile_shader(SOURCE)
    x = np.arange(50, dtype=np.float32)
    y = np.zeros(50, dtype=np.float32)
    lib.twice(x, y, threads=50, group_size=16)
    np.testing.assert_array_equal(y, 2 * x)


def test_non_contiguous_numpy_array_is_refused():
    lib = compile_shader(SOURCE)
    y = np.zeros(100, dtype=np.float32)[::2]
    with pytest.raises(LaunchError, match="C-contiguous"):
        lib.twice(np.ones(50, dtype=np.float32), y, threads=50)
