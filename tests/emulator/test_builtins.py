"""Built-in kernel parameter attributes on the emulator, against values computed in NumPy.

Every built-in the emulator accepts is declared in one kernel per type family (uint, ushort,
uint2, ushort2, uint3, ushort3 for the positional ones; uint or ushort for the scalar ones)
and written out per thread. The oracle derives each value independently from the dispatch
geometry, following Metal's dispatchThreads semantics (docs: ../shared/notes/metal-semantics.md):

* threadgroup g covers positions g*group .. g*group + group - 1 in each dimension; at the
  grid's edge it is smaller: threads_per_threadgroup = min(group, grid - g*group);
* dispatch_threads_per_threadgroup is the requested group size everywhere;
* thread_index_in_threadgroup = x + y*Tx + z*Tx*Ty with T = threads_per_threadgroup;
  lane = index % 32, SIMD-group = index / 32, quad lane = index % 4, quad = index / 4;
* simdgroups_per_threadgroup = ceil(threads in this group / 32) (and the dispatch_ variant
  uses the requested group), quadgroups likewise with 4;
* threads outside the grid never run: each grid cell is written exactly once (an atomic
  counter per cell), and the cells of the rounded-up grid outside it are never touched.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import compile_shader

NA = 0xFFFFFFFF          # component a narrower type does not have
UNWRITTEN = 0xDEADBEEF   # what the record buffer holds before the launch

FIELDS = (
    ["thread_position_in_grid." + c for c in "xyz"]
    + ["thread_position_in_threadgroup." + c for c in "xyz"]
    + ["threadgroup_position_in_grid." + c for c in "xyz"]
    + ["threads_per_threadgroup." + c for c in "xyz"]
    + ["dispatch_threads_per_threadgroup." + c for c in "xyz"]
    + ["threadgroups_per_grid." + c for c in "xyz"]
    + ["threads_per_grid." + c for c in "xyz"]
    + ["thread_index_in_threadgroup", "thread_index_in_simdgroup",
       "simdgroup_index_in_threadgroup", "threads_per_simdgroup", "thread_execution_width",
       "simdgroups_per_threadgroup", "dispatch_simdgroups_per_threadgroup",
       "thread_index_in_quadgroup", "quadgroup_index_in_threadgroup",
       "quadgroups_per_threadgroup", "dispatch_quadgroups_per_threadgroup"]
)
NF = len(FIELDS)
N_POSITIONAL = 7  # the first 7 built-ins are 3-component positional ones

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

#define NF 32u
#define NA 0xFFFFFFFFu
#ifndef SYNC
#define SYNC()
#endif

inline void put3(device uint* r, uint v)    { r[0] = v; r[1] = NA; r[2] = NA; }
inline void put3(device uint* r, ushort v)  { r[0] = v; r[1] = NA; r[2] = NA; }
inline void put3(device uint* r, uint2 v)   { r[0] = v.x; r[1] = v.y; r[2] = NA; }
inline void put3(device uint* r, ushort2 v) { r[0] = v.x; r[1] = v.y; r[2] = NA; }
inline void put3(device uint* r, uint3 v)   { r[0] = v.x; r[1] = v.y; r[2] = v.z; }
inline void put3(device uint* r, ushort3 v) { r[0] = v.x; r[1] = v.y; r[2] = v.z; }

inline uint3 pos3(uint v)    { return uint3(v, 0u, 0u); }
inline uint3 pos3(ushort v)  { return uint3(uint(v), 0u, 0u); }
inline uint3 pos3(uint2 v)   { return uint3(v.x, v.y, 0u); }
inline uint3 pos3(ushort2 v) { return uint3(uint(v.x), uint(v.y), 0u); }
inline uint3 pos3(uint3 v)   { return v; }
inline uint3 pos3(ushort3 v) { return uint3(uint(v.x), uint(v.y), uint(v.z)); }

// P: type of the positional built-ins, S: type of the scalar ones.
#define BUILTIN_KERNEL(NAME, P, S)                                                        \
kernel void NAME(device uint* rec [[buffer(0)]],                                          \
                 device atomic_uint* count [[buffer(1)]],                                 \
                 constant uint& W [[buffer(2)]],                                          \
                 constant uint& H [[buffer(3)]],                                          \
                 P tpig [[thread_position_in_grid]],                                      \
                 P tpitg [[thread_position_in_threadgroup]],                              \
                 P tgpig [[threadgroup_position_in_grid]],                                \
                 P tptg [[threads_per_threadgroup]],                                      \
                 P dtptg [[dispatch_threads_per_threadgroup]],                            \
                 P tgpg [[threadgroups_per_grid]],                                        \
                 P tpg [[threads_per_grid]],                                              \
                 S tiitg [[thread_index_in_threadgroup]],                                 \
                 S tiisg [[thread_index_in_simdgroup]],                                   \
                 S sgiitg [[simdgroup_index_in_threadgroup]],                             \
                 S tpsg [[threads_per_simdgroup]],                                        \
                 S tew [[thread_execution_width]],                                        \
                 S sgptg [[simdgroups_per_threadgroup]],                                  \
                 S dsgptg [[dispatch_simdgroups_per_threadgroup]],                        \
                 S tiiqg [[thread_index_in_quadgroup]],                                   \
                 S qgiitg [[quadgroup_index_in_threadgroup]],                             \
                 S qgptg [[quadgroups_per_threadgroup]],                                  \
                 S dqgptg [[dispatch_quadgroups_per_threadgroup]]) {                      \
  const uint3 p = pos3(tpig);                                                             \
  const uint cell = p.x + W * (p.y + H * p.z);                                            \
  atomic_fetch_add_explicit(&count[cell], 1u, memory_order_relaxed);                      \
  device uint* r = rec + cell * NF;                                                       \
  put3(r + 0, tpig);                                                                      \
  put3(r + 3, tpitg);                                                                     \
  put3(r + 6, tgpig);                                                                     \
  put3(r + 9, tptg);                                                                      \
  put3(r + 12, dtptg);                                                                    \
  put3(r + 15, tgpg);                                                                     \
  put3(r + 18, tpg);                                                                      \
  r[21] = tiitg;                                                                          \
  r[22] = tiisg;                                                                          \
  r[23] = sgiitg;                                                                         \
  r[24] = tpsg;                                                                           \
  r[25] = tew;                                                                            \
  r[26] = sgptg;                                                                          \
  r[27] = dsgptg;                                                                         \
  r[28] = tiiqg;                                                                          \
  r[29] = qgiitg;                                                                         \
  r[30] = qgptg;                                                                          \
  r[31] = dqgptg;                                                                         \
  SYNC();                                                                                 \
}

BUILTIN_KERNEL(builtins_uint, uint, uint)
BUILTIN_KERNEL(builtins_ushort, ushort, ushort)
BUILTIN_KERNEL(builtins_uint2, uint2, uint)
BUILTIN_KERNEL(builtins_ushort2, ushort2, ushort)
BUILTIN_KERNEL(builtins_uint3, uint3, uint)
BUILTIN_KERNEL(builtins_ushort3, ushort3, ushort)
"""

# The three ways the emulator runs a kernel, which must agree: these kernels do not
# synchronise, so a threadgroup is one loop over its threads calling the kernel; with
# TSM_EMU_REGIONS=0 the runtime calls it once per thread; a helper that synchronises makes
# every kernel that calls it run as fibers.
FIBER_PREFIX = r"""
#include <metal_stdlib>
inline void synchronise() { metal::simdgroup_barrier(metal::mem_flags::mem_none); }
#define SYNC() synchronise()
"""


@pytest.fixture(scope="module", params=["threadgroup_loop", "thread_calls", "fibers"])
def lib(request):
    src = (FIBER_PREFIX if request.param == "fibers" else "") + SOURCE
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TSM_EMU_REGIONS", "0" if request.param == "thread_calls" else "1")
        return compile_shader(src)


def _dim3(v):
    v = (v,) if isinstance(v, int) else tuple(v)
    return np.array(v + (1,) * (3 - len(v)), dtype=np.int64)


def expected_records(grid, group, ndim):
    """(D, H, W, NF) uint32 records of the rounded-up grid, as Metal defines them."""
    grid, group = _dim3(grid), _dim3(group)
    groups = -(-grid // group)
    W, H, D = groups * group
    rec = np.full((D, H, W, NF), UNWRITTEN, dtype=np.uint32)
    z, y, x = np.meshgrid(np.arange(grid[2]), np.arange(grid[1]), np.arange(grid[0]),
                          indexing="ij")
    pos = np.stack([x, y, z], axis=-1)                  # (gz, gy, gx, 3)
    tg = pos // group
    local = pos % group
    actual = np.minimum(group, grid - tg * group)       # smaller threadgroups at the edges
    index = local[..., 0] + local[..., 1] * actual[..., 0] \
        + local[..., 2] * actual[..., 0] * actual[..., 1]
    n_actual = actual.prod(axis=-1)
    n_full = int(group.prod())
    ones = np.ones_like(index)
    cols = [pos, local, tg, actual, np.broadcast_to(group, pos.shape),
            np.broadcast_to(groups, pos.shape), np.broadcast_to(grid, pos.shape)]
    positional = np.concatenate(cols, axis=-1)          # (..., 21)
    if ndim < 3:                                        # the components the type lacks
        positional = positional.reshape(positional.shape[:-1] + (7, 3))
        positional[..., ndim:] = NA
        positional = positional.reshape(positional.shape[:-2] + (21,))
    scalars = np.stack([
        index, index % 32, index // 32, 32 * ones, 32 * ones,
        -(-n_actual // 32), -(-n_full // 32) * ones,
        index % 4, index // 4, -(-n_actual // 4), -(-n_full // 4) * ones,
    ], axis=-1)
    rec[: grid[2], : grid[1], : grid[0]] = np.concatenate([positional, scalars], axis=-1)
    return rec, (int(W), int(H), int(D)), tuple(int(g) for g in grid)


def run_builtins(kernel, grid, group, ndim):
    want, (W, H, D), g = expected_records(grid, group, ndim)
    rec = torch.full((D * H * W * NF,), UNWRITTEN - 2**32, dtype=torch.int32)
    count = torch.zeros(D * H * W, dtype=torch.int32)
    kernel(rec, count, W, H, threads=grid, group_size=group)
    got = rec.numpy().view(np.uint32).reshape(D, H, W, NF)
    count = count.numpy().reshape(D, H, W)

    inside = np.zeros((D, H, W), dtype=bool)
    inside[: g[2], : g[1], : g[0]] = True
    # Every thread of the grid ran exactly once; no thread outside it ran.
    np.testing.assert_array_equal(count[inside], 1, err_msg="grid cells not run exactly once")
    np.testing.assert_array_equal(count[~inside], 0, err_msg="threads outside the grid ran")
    for f, name in enumerate(FIELDS):
        np.testing.assert_array_equal(got[..., f], want[..., f],
                                      err_msg=f"{name} (grid {grid}, group {group})")


GRIDS_1D = [(100, 32), (1000, 256), (37, 64), (70, 7), (1, 1), (1025, 1024)]
GRIDS_2D = [((13, 7), (4, 3)), ((40, 5), (16, 16)), ((33, 2), (32, 1)), ((3, 70), (1, 64))]
GRIDS_3D = [((5, 6, 7), (2, 4, 3)), ((9, 3, 33), (4, 2, 8)), ((50, 3, 2), (48, 1, 2)),
            ((2, 2, 40), (1, 1, 32))]


@pytest.mark.parametrize("grid,group", GRIDS_1D)
@pytest.mark.parametrize("kernel", ["builtins_uint", "builtins_ushort"])
def test_scalar_builtins_1d(lib, kernel, grid, group):
    run_builtins(getattr(lib, kernel), grid, group, ndim=1)


@pytest.mark.parametrize("grid,group", GRIDS_2D)
@pytest.mark.parametrize("kernel", ["builtins_uint2", "builtins_ushort2"])
def test_vector2_builtins_2d(lib, kernel, grid, group):
    run_builtins(getattr(lib, kernel), grid, group, ndim=2)


@pytest.mark.parametrize("grid,group", GRIDS_3D)
@pytest.mark.parametrize("kernel", ["builtins_uint3", "builtins_ushort3"])
def test_vector3_builtins_3d(lib, kernel, grid, group):
    run_builtins(getattr(lib, kernel), grid, group, ndim=3)


@pytest.mark.parametrize("grid,group", GRIDS_1D[:3] + GRIDS_2D[:2])
def test_vector3_builtins_on_lower_dimensional_grids(lib, grid, group):
    # y and z of a 1-D dispatch are position 0 of extent 1.
    run_builtins(lib.builtins_uint3, grid, group, ndim=3)


def test_vector2_builtins_on_a_1d_grid(lib):
    run_builtins(lib.builtins_uint2, 300, 128, ndim=2)


def test_edge_threadgroup_sizes_are_smaller(lib):
    """Spot check, independent of the oracle above: 1000 threads in groups of 256."""
    _, (W, H, D), _ = expected_records(1000, 256, 1)
    rec = torch.zeros(W * NF, dtype=torch.int32)
    count = torch.zeros(W, dtype=torch.int32)
    lib.builtins_uint(rec, count, W, H, threads=1000, group_size=256)
    r = rec.view(W, NF)
    tptg = FIELDS.index("threads_per_threadgroup.x")
    sgptg = FIELDS.index("simdgroups_per_threadgroup")
    dsgptg = FIELDS.index("dispatch_simdgroups_per_threadgroup")
    assert r[0, tptg].item() == 256 and r[999, tptg].item() == 1000 - 3 * 256 == 232
    assert r[999, sgptg].item() == math.ceil(232 / 32) == 8
    assert r[999, dsgptg].item() == 8
    assert r[0, FIELDS.index("threadgroups_per_grid.x")].item() == 4
    assert count[1000:].sum().item() == 0 and count[:1000].eq(1).all()
