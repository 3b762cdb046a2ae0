"""A kernel parameter the kernel moves (`in += offset`) is each thread's own under barrier
regions, as under fibers, also when clang leaves the operator unresolved because an
operand has a template parameter's type (MLX's col_reduce_small: `in += in_idx + column`
with `IdxT in_idx`). Shared by the threadgroup, every thread's move added up: thread 3 read
element 6 of a 4-element buffer."""
import pytest
import torch

from _schedules import both_ways, grouped

SOURCE = r"""#include <metal_stdlib>
using namespace metal;
template <typename T, typename IdxT>
kernel void shifted(device const T* in [[buffer(0)]], device T* out [[buffer(1)]],
                    uint lid [[thread_position_in_threadgroup]]) {
  threadgroup T t[4];
  IdxT off = IdxT(lid);
  in += off;         // an unresolved operator+= in the template
  out = out + off;   // an unresolved operator+, then a plain assignment
  t[lid] = in[0];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[0] = t[(lid + 1) % 4];
}
template [[host_name("shifted_f")]] kernel void shifted<float, int>(device const float*, device float*, uint);
"""


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitized"])
def test_moved_parameters_are_per_thread_as_regions_and_as_fibers(monkeypatch, tmp_path, sanitize):
    assert "shifted" in grouped(SOURCE, tmp_path)
    results = []
    for lib in both_ways(SOURCE, monkeypatch, sanitize):
        out = torch.zeros(4)
        lib.shifted_f(torch.arange(4.0), out, threads=4, group_size=4)
        results.append(out.tolist())
    assert results[0] == results[1] == [1.0, 2.0, 3.0, 0.0]
