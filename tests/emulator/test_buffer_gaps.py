"""A kernel whose [[buffer(i)]] indices have a gap (MLX's copy_g* binds 0, 1 and 3) takes None
at the gap, which binds nothing; None anywhere else, or an argument at the gap, is a
LaunchError naming the index."""
import pytest
import torch

from torch_sparse_metal.emulator import LaunchError, compile_shader

SOURCE = r"""#include <metal_stdlib>
using namespace metal;
kernel void copy_g(device const float* src [[buffer(0)]], device float* dst [[buffer(1)]],
                   constant int& n [[buffer(3)]], constant float& scale [[buffer(5)]],
                   uint i [[thread_position_in_grid]]) {
  if (i < uint(n)) dst[i] = scale * src[i];
}
"""


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "sanitized"])
def lib(request):
    return compile_shader(SOURCE, sanitize=request.param)


def test_none_at_each_gap_runs_the_kernel(lib):
    src, dst = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    lib.copy_g(src, dst, None, 6, None, 2.0, threads=8, group_size=4)
    assert dst.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 0.0, 0.0]


@pytest.mark.parametrize("args, match", [
    ((None, None, 6, None, 2.0), r"^copy_g: argument 1 \(\[\[buffer\(1\)\]\] `[^`]*\bdst\b[^`]*`\): got None; "
                                 r"only an index the kernel declares no \[\[buffer\(i\)\]\] for takes None$"),
    (("dst", None, None, None, 2.0), r"^copy_g: argument 3 \(\[\[buffer\(3\)\]\] `[^`]*\bn\b[^`]*`\): got None"),
    (("dst", 0, 6, None, 2.0), r"^copy_g: argument 2 has no \[\[buffer\(2\)\]\] parameter; pass None there$"),
    (("dst", None, 6, 0, 2.0), r"^copy_g: argument 4 has no \[\[buffer\(4\)\]\] parameter"),
    (("dst", 6, 2.0), r"^copy_g: expected 6 arguments \(one per \[\[buffer\(i\)\]\]; None at 2, 4, where it "
                      r"has none\), got 4$"),
])
def test_a_missing_or_misplaced_argument_names_the_index(lib, args, match):
    src, dst = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    args = [src] + [dst if a == "dst" else a for a in args]
    with pytest.raises(LaunchError, match=match):
        lib.copy_g(*args, threads=8, group_size=4)
    assert dst.tolist() == [0.0] * 8
