"""The argument tables' rules, as Apple's compiler applies them: a kernel's [[buffer(n)]] and
[[threadgroup(n)]] indices lie in [0, 30], [[texture(n)]] in [0, 127], [[sampler(n)]] in
[0, 15], and no two parameters ask for one index of one table. Both
programs below were rejected by Apple's compiler ("cannot reserve 'buffer' resource location
at index 0"; "'buffer' attribute parameter is out of bounds: must be between 0 and 30") and
accepted here before the check."""
from __future__ import annotations

import pytest

from torch_sparse_metal.emulator import MetalCompileError, compile_shader
from torch_sparse_metal.emulator import _msl_text

KERNEL = """#include <metal_stdlib>
using namespace metal;
kernel void k(device float* a [[buffer(0)]], {second}, uint i [[thread_position_in_grid]]) {{
  a[i] = 1.0f;
}}
"""


@pytest.mark.parametrize("second, message", [
    ("device float* b [[buffer(0)]]",
     r"kernel k: cannot reserve 'buffer' resource location at index 0: parameters "
     r"`device float\* a \[\[buffer\(0\)\]\]` and `device float\* b \[\[buffer\(0\)\]\]`"),
    ("device float* b [[buffer(31)]]",
     r"kernel k: 'buffer' attribute parameter is out of bounds: must be between 0 and 30"),
    ("threadgroup float* t [[threadgroup(31)]]",
     r"kernel k: 'threadgroup' attribute parameter is out of bounds: must be between 0 and 30"),
    ("texture2d<float> t [[texture(128)]]",
     r"kernel k: 'texture' attribute parameter is out of bounds: must be between 0 and 127"),
    ("sampler s [[sampler(16)]]",
     r"kernel k: 'sampler' attribute parameter is out of bounds: must be between 0 and 15"),
    ("texture2d<float> t [[texture(3)]], texture2d<float> u [[texture(3)]]",
     r"kernel k: cannot reserve 'texture' resource location at index 3"),
    ("sampler s [[sampler(1)]], sampler r [[sampler(1)]]",
     r"kernel k: cannot reserve 'sampler' resource location at index 1"),
])
def test_apples_rejections_are_rejected(second, message):
    with pytest.raises(MetalCompileError, match=message):
        compile_shader(KERNEL.format(second=second))


def test_the_tables_are_separate_and_30_is_the_last_index():
    source = KERNEL.format(second="device float* b [[buffer(30)]], "
                                  "threadgroup float* t [[threadgroup(0)]]")
    (kernel,) = _msl_text.find_kernels(source)
    assert [(p.kind, p.index) for p in kernel.params[:3]] == [
        (_msl_text.P_BUFFER, 0), (_msl_text.P_BUFFER, 30), (_msl_text.P_THREADGROUP, 0)]



def test_textures_and_samplers_have_tables_of_their_own():
    source = KERNEL.format(second="texture2d<float> t [[texture(0)]], texture2d<float> u, "
                                  "sampler s [[sampler(15)]], texture3d<float> v [[texture(127)]]")
    (kernel,) = _msl_text.find_kernels(source)
    assert [(p.kind, p.index) for p in kernel.params[:5]] == [
        (_msl_text.P_BUFFER, 0), (_msl_text.P_TEXTURE, 0), (_msl_text.P_TEXTURE, 1),
        (_msl_text.P_SAMPLER, 15), (_msl_text.P_TEXTURE, 127)]
