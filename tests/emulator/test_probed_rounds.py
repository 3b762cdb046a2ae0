"""Probed rounds: a barrier region's bounds checks made for the whole round before it runs.

For a uniform barrier-region kernel whose indices and branches never depend on what it
reads from memory (torch_sparse_metal/emulator/_bounds_probe.py), a round first runs as a
probe (every access a bounds test that touches nothing) and then unchecked, a loop the C++
compiler can vectorise, or checked as before when the probe found an access out of bounds
(csrc/emulator/include/tsm_emu/probe.h). The verdicts are checked kernel by kernel, each
"not probed" one a way the probe could test other indices than the round uses or have an
effect; probed kernels must agree with fibers bit for bit; and a fault in a probed round
must be the fault fibers report, at the same thread, with memory left as fibers leave it.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from torch_sparse_metal._paths import SHADERS_DIR
from torch_sparse_metal.emulator import KernelFault, _compiler, compile_shader

from _hang_guard import call_with_timeout
from _schedules import both_ways

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"

_PROBED = re.compile(r"inline void (\w+?)__tsm_group.*?(?:__tsm_not_probed = \"(.*?)\"; )?"
                     r"::tsm_emu::run_regions<\d+, (?:true|false), (false|::tsm_emu::probe_elements)", re.S)


def probed(cxx: str) -> dict:
    """Kernel name -> None when its rounds are probed, else the translation's reason."""
    return {name: None if flag != "false" else (why or "") for name, why, flag in _PROBED.findall(cxx)}


PROBED = HEADER + r"""
kernel void reduce(device const float* x [[buffer(0)]], device float* partial [[buffer(1)]],
                   constant uint& count [[buffer(2)]], threadgroup float* s [[threadgroup(0)]],
                   uint gid [[thread_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                   uint group [[threadgroup_position_in_grid]], uint size [[threads_per_threadgroup]]) {
  s[lid] = gid < count ? x[gid] : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = size / 2; stride > 0; stride /= 2) {
    if (lid < stride) s[lid] += s[lid + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 0) partial[group] = s[0];
}

// A 2-D threadgroup array of vectors, a value read from memory that only flows into
// stores. (Run in rows of threads, which are probed, and in 2-D threadgroups, which are not.)
kernel void rotate_rows(device const float4* in [[buffer(0)]], device float4* out [[buffer(1)]],
                        uint lid [[thread_index_in_threadgroup]], uint2 tg [[threadgroup_position_in_grid]],
                        uint2 groups [[threadgroups_per_grid]]) {
  threadgroup float4 tile[4][8];
  const uint gid = (tg.y * groups.x + tg.x) * 32 + lid;
  float4 v = in[gid];
  v.y = fma(v.y, 2.0f, 1.0f);
  tile[lid / 8][lid % 8] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float4 w = tile[(lid / 8 + 1) % 4][lid % 8];
  w.x += float(lid % 8);
  out[gid] = w;
}

// Faults in the round after the barrier, at the thread `at` of the threadgroup `group`.
kernel void overruns(device float* out [[buffer(0)]], constant uint& at [[buffer(1)]],
                     constant uint& group [[buffer(2)]], threadgroup float* t [[threadgroup(0)]],
                     uint lid [[thread_position_in_threadgroup]], uint gid [[thread_position_in_grid]],
                     uint tg [[threadgroup_position_in_grid]], uint size [[threads_per_threadgroup]]) {
  t[lid] = float(gid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid + (lid == at && tg == group ? 1000u : 0u)] = t[size - 1 - lid] + 0.5f;
}
"""

NOT_PROBED = HEADER + r"""
#define KERNEL(name) \
  kernel void name(device float* out [[buffer(0)]], device const uint* idx [[buffer(1)]], \
                   threadgroup float* t [[threadgroup(0)]], uint lid [[thread_position_in_threadgroup]])
#define SYNC threadgroup_barrier(mem_flags::mem_threadgroup)

float helper(float v) { return v * 2.0f; }

KERNEL(index_from_memory) { uint j = idx[lid]; t[lid] = 1.0f; SYNC; out[j] = t[lid]; }
KERNEL(index_through_a_variable) { uint j = lid; if (lid > 3) j += idx[0]; t[lid] = 1.0f; SYNC; out[j] = t[lid]; }
KERNEL(condition_from_memory) { t[lid] = 1.0f; SYNC; if (idx[lid] > 0) out[lid + 64] = t[lid]; }
KERNEL(condition_from_threadgroup_memory) { t[lid] = float(lid); SYNC; if (t[lid] > 3.0f) out[lid] = 1.0f; }
KERNEL(short_circuit_on_memory) { t[lid] = 1.0f; SYNC; out[lid] = (idx[0] > 0 && out[lid + 64] > 0.0f) ? 1.0f : 0.0f; }
KERNEL(pointer_arithmetic) { device float* p = out + lid; t[lid] = 1.0f; SYNC; *p = t[lid]; }
KERNEL(address_taken) { float v = 1.0f; thread float* p = &v; t[lid] = *p; SYNC; out[lid] = t[lid]; }
KERNEL(user_function) { t[lid] = helper(1.0f); SYNC; out[lid] = t[lid]; }
KERNEL(local_array) { float a[4] = {1, 2, 3, 4}; t[lid] = a[lid % 4]; SYNC; out[lid] = t[lid]; }
KERNEL(vector_element) { float4 v = float4(1.0f); t[lid] = v[lid % 4]; SYNC; out[lid] = t[lid]; }
KERNEL(simd_function) { t[lid] = 1.0f; SYNC; const float v = t[lid]; const float s = simd_sum(v); out[lid] = s; }
KERNEL(a_loop_between_barriers) { t[lid] = 1.0f; SYNC; float s = 0.0f; for (uint k = 0; k < 4; ++k) s += t[k]; out[lid] = s; }
KERNEL(not_uniform) { t[lid] = 1.0f; for (uint k = 0; k < lid % 2 + 1; ++k) SYNC; out[lid] = t[lid]; }
KERNEL(threadgroup_scalar) { threadgroup float total; total = 0.0f; SYNC; out[lid] = total; }

kernel void atomic_counter(device atomic_uint* c [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                           uint lid [[thread_position_in_threadgroup]]) {
  t[lid] = 1.0f; SYNC; atomic_fetch_add_explicit(c, 1u, memory_order_relaxed);
}
kernel void device_reference(device uint& n [[buffer(0)]], device float* out [[buffer(1)]],
                             threadgroup float* t [[threadgroup(0)]], uint lid [[thread_position_in_threadgroup]]) {
  t[lid] = 1.0f; SYNC; out[lid + n] = t[lid];
}
"""

WHY_NOT = {
    "index_from_memory": "an index that depends on memory",
    "index_through_a_variable": "an index that depends on memory",
    "condition_from_memory": "a condition that depends on memory",
    "condition_from_threadgroup_memory": "a condition that depends on memory",
    "short_circuit_on_memory": "a condition that depends on memory",
    "pointer_arithmetic": "variable `p` of type",
    "address_taken": "a variable whose address is taken",
    "user_function": "a call of `helper`",
    "local_array": "variable `a` of type",
    "vector_element": "an index into something other than a buffer or a threadgroup array",
    "simd_function": "a SIMD-group function",
    "a_loop_between_barriers": "a loop between two barriers",
    "not_uniform": "not uniform",
    "threadgroup_scalar": "variable `total",
    "atomic_counter": "pointer `c` to",
    "device_reference": "reference parameter `n` outside constant memory",
}


def test_kernels_whose_indices_and_branches_do_not_read_memory_are_probed(tmp_path):
    path = tmp_path / "probed.metal"
    path.write_text(PROBED)
    assert probed(_compiler.generated_cxx(path).text) == dict.fromkeys(["reduce", "rotate_rows", "overruns"])


def test_each_way_the_probe_could_miss_an_access_is_not_probed(tmp_path):
    path = tmp_path / "not_probed.metal"
    path.write_text(NOT_PROBED)
    said = probed(_compiler.generated_cxx(path).text)
    assert set(said) == set(WHY_NOT)
    for kernel, why in WHY_NOT.items():
        assert said[kernel] is not None and said[kernel].startswith(why), (kernel, said[kernel])


def test_the_project_kernels_verdicts():
    """The benchmark's tree reduction is probed; its tiled matmul and the project's shaders
    not (a loop between barriers, SIMD-group functions, helpers, pinned variables, atomics:
    each says why)."""
    said = {}
    for path in sorted(SHADERS_DIR.glob("*.metal")) + [SHADERS_DIR / "bench" / "barrier_heavy.metal"]:
        said.update(probed(_compiler.generated_cxx(path).text))
    assert {k for k, v in said.items() if v is None} == {"tree_reduce"}
    assert said["tiled_matmul"] == "a loop between two barriers"
    assert all(v for k, v in said.items() if k != "tree_reduce")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.fixture(scope="module")
def builds():
    mp = pytest.MonkeyPatch()
    try:
        yield both_ways(PROBED, mp, False)
    finally:
        mp.undo()


@pytest.mark.parametrize("n, group", [(1000, 256), (1000, 64), (37, 32)])
def test_a_probed_reduction_agrees_with_fibers_bit_for_bit(builds, n, group):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    groups = -(-n // group)
    outs = []
    for lib in builds:
        partial = torch.full((groups,), float("nan"))
        call_with_timeout(lib.reduce, x, partial, n, threads=groups * group, group_size=group,
                          threadgroup_memory=[4 * group])
        outs.append(partial)
    assert torch.equal(bits(outs[0]), bits(outs[1]))
    padded = np.zeros(groups * group)
    padded[:n] = x.double().numpy()
    np.testing.assert_allclose(outs[0].numpy(), padded.reshape(groups, group).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_size", [32, (8, 4)], ids=["row", "2d"])
def test_a_probed_kernel_agrees_with_fibers(builds, group_size):
    x = torch.randn(192, 4, generator=torch.Generator().manual_seed(7))
    outs = []
    for lib in builds:
        out = torch.full((192, 4), float("nan"))
        threads = 192 if group_size == 32 else (8, 24)
        call_with_timeout(lib.rotate_rows, x, out, threads=threads, group_size=group_size)
        outs.append(out)
    assert torch.equal(bits(outs[0]), bits(outs[1]))
    v = x.numpy().reshape(6, 4, 8, 4).copy()  # threadgroup, row of the tile, column, lane
    v[..., 1] = v[..., 1] * np.float32(2) + np.float32(1)  # (doubling is exact: one rounding, as fma)
    want = np.roll(v, -1, axis=1)
    want[..., 0] += np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(outs[0].numpy().reshape(6, 4, 8, 4), want)


@pytest.mark.parametrize("at, group", [(63, 2), (0, 0), (17, 3)])
def test_a_fault_in_a_probed_round_is_the_fault_fibers_report(builds, at, group):
    """The probe touches nothing: the round runs checked and faults at the same thread and
    access, the threads before it having stored what fibers' did, those after nothing."""
    results = []
    for lib in builds:
        out = torch.full((256,), float("nan"))
        with pytest.raises(KernelFault) as e:
            call_with_timeout(lib.overruns, out, at, group, threads=256, group_size=64,
                              threadgroup_memory=[4 * 64])
        results.append((e.value.kind, str(e.value), out))
    assert results[0][:2] == results[1][:2]
    assert results[0][0] == "out_of_bounds"
    gid = group * 64 + at
    assert f"thread ({gid}, 0, 0) (index {at} in threadgroup ({group}, 0, 0))" in results[0][1]
    assert torch.equal(bits(results[0][2]), bits(results[1][2]))
    # Threadgroups before it complete; in its own, the threads before it stored.
    done = results[0][2][:group * 64 + at]
    lid = torch.arange(group * 64 + at) % 64
    base = torch.arange(group * 64 + at) - lid
    assert torch.equal(done, (base + 63 - lid).float() + 0.5)
    assert torch.isnan(results[0][2][gid:]).all()


def test_a_guarded_read_past_the_end_is_the_fault_fibers_report(builds):
    """`gid < count ? x[gid] : 0` with `count` past x's end: each thread's probe flags its
    own access only where its guard lets it run (the round's flag is the OR of the
    threads'), so the round runs checked and faults at the first thread past the end."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    faults = []
    for lib in builds:
        with pytest.raises(KernelFault) as e:
            call_with_timeout(lib.reduce, x, torch.zeros(16), 1010, threads=1024, group_size=64,
                              threadgroup_memory=[4 * 64])
        faults.append((e.value.kind, str(e.value)))
    assert faults[0] == faults[1]
    assert faults[0][0] == "out_of_bounds"
    assert "thread (1000, 0, 0) (index 40 in threadgroup (15, 0, 0))" in faults[0][1]


def test_probed_kernels_run_clean_and_alike_under_the_sanitizer(builds):
    """A sanitized build compiles the same translation (the probe's bindings in checked mode)
    and runs every round checked: no report, and the plain probed build's bits."""
    sanitized = compile_shader(PROBED, sanitize=True)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    partials = []
    for lib in (builds[0], sanitized):
        partial = torch.full((4,), float("nan"))
        call_with_timeout(lib.reduce, x, partial, 1000, threads=1024, group_size=256, threadgroup_memory=[4 * 256])
        partials.append(partial)
    assert torch.equal(bits(partials[0]), bits(partials[1]))
    rows = torch.randn(192, 4, generator=torch.Generator().manual_seed(5))
    outs = []
    for lib in (builds[0], sanitized):
        out = torch.full((192, 4), float("nan"))
        call_with_timeout(lib.rotate_rows, rows, out, threads=192, group_size=32)
        outs.append(out)
    assert torch.equal(bits(outs[0]), bits(outs[1]))
