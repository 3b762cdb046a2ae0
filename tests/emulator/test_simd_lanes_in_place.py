"""SIMD-group functions in barrier regions without the runtime's copies
(``tsm_emu::release_in_place`` and ``lane_exchange``), and variables that cannot change stored
where they are declared rather than at every stop (``_regions._never_changes``).

A plain round whose threads all wait at SIMD-group functions, each SIMD-group's lanes at one
place, releases them where they handed their values over; the next round's lanes hand theirs
to the other of two buffers, as the later lanes of their SIMD-group still read the first. Every
launch here must give the fibers' bits and, where it is computable, NumPy's answer; sanitized
too, where the rounds go through resolve_regions but the calls still hand over their values
inline (lane_exchange) and the constants are still stored where declared.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from torch_sparse_metal._paths import SHADERS_DIR
from torch_sparse_metal.emulator import KernelFault, _compiler

from _hang_guard import call_with_timeout
from _schedules import both_ways, bitwise_equal, grouped

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"

LANES = HEADER + r"""
// Each lane reads its neighbour's value five times in a row: while a round's first lanes hand
// over their next value, the SIMD-group's later lanes still read the last one.
kernel void chain(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]],
                  uint lane [[thread_index_in_simdgroup]]) {
  float v = float(gid);
  for (uint i = 0; i < 5; ++i) {
    v = simd_shuffle(v, ushort((lane + 1) % 32)) * 2.0f + float(i);
  }
  out[gid] = v;
}

// SIMD-group 1 leaves at once and SIMD-group 2 runs one iteration more than the others:
// rounds whose lanes meet beside threads that returned, at one stop in different iterations.
kernel void uneven(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]],
                   uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  if (sg == 1) {
    out[gid] = -1.0f;
    return;
  }
  float v = float(lane);
  const uint n = sg == 2 ? 3u : 2u;
  for (uint i = 0; i < n; ++i) {
    v += simd_sum(v) * 0.5f;
  }
  out[gid] = v;
}

// Even and odd SIMD-groups wait at two different functions in the same round.
kernel void two_places(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]],
                       uint sg [[simdgroup_index_in_threadgroup]]) {
  float v = float(gid);
  if (sg % 2 == 0) {
    v = simd_max(v);
  } else {
    v = simd_prefix_exclusive_sum(v);
  }
  out[gid] = v + simd_shuffle_xor(v, 1u);
}
"""

CONSTANTS = HEADER + r"""
struct Pair {
  float a;
  uint b;
};
// Constants across barriers, one declared in the loop (a new value at each iteration).
kernel void constants(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]],
                      uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  const float base = float(gid) * 0.5f;
  const Pair p{float(lid), lid * 3u};
  float acc = 0.0f;
  for (uint i = 0; i < 3; ++i) {
    const float step = base + float(i * lid);
    t[lid] = step;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += t[(lid + 1) % 64] + step + p.a + float(p.b);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = acc + base;
}

// A const object whose mutable member changes between barriers: kept in its slot.
struct Counter {
  mutable uint n;
};
kernel void mutable_member(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]],
                           uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  const Counter c{lid};
  for (uint i = 0; i < 3; ++i) {
    c.n += 1u;
    t[lid] = float(c.n);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[gid * 3 + i] = t[(lid + 1) % 64] + float(c.n);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
"""


BUILDS = pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitized"])


def run_both(source: str, kernel: str, size: int, threads: int, group: int, monkeypatch,
             sanitize: bool) -> torch.Tensor:
    """The output of `kernel` run as regions, after checking the fibers' is the same to the bit."""
    regions, fibers = both_ways(source, monkeypatch, sanitize=sanitize)
    outs = []
    for lib in (regions, fibers):
        out = torch.full((size,), float("nan"))
        call_with_timeout(lib[kernel], out, threads=threads, group_size=group)  # (a wrong stop's loop may not end)
        outs.append(out)
    assert bitwise_equal(outs[0], outs[1]), f"{kernel}: regions {outs[0]} != fibers {outs[1]}"
    return outs[0]


def test_the_kernels_here_run_as_regions(tmp_path):
    assert grouped(LANES, tmp_path) == {"chain", "uneven", "two_places"}
    assert grouped(CONSTANTS, tmp_path) == {"constants", "mutable_member"}


@BUILDS
def test_lanes_read_the_values_of_the_round_before(monkeypatch, sanitize):
    out = run_both(LANES, "chain", 128, 128, 128, monkeypatch, sanitize).numpy()
    v = np.arange(128, dtype=np.float32).reshape(4, 32)
    for i in range(5):
        v = np.roll(v, -1, axis=1) * np.float32(2) + np.float32(i)
    np.testing.assert_array_equal(out, v.reshape(-1))


def test_a_partial_simd_group_reads_poison_as_fibers_do(monkeypatch):
    # 80 threads: the last SIMD-group has 16 lanes, whose lane 15 reads the missing lane 16.
    out = run_both(LANES, "chain", 80, 80, 80, monkeypatch, sanitize=False)
    assert torch.isnan(out[64:]).any() and not torch.isnan(out[:64]).any()


def test_a_partial_simd_group_read_is_reported_as_by_fibers(monkeypatch):
    """Sanitized, the same read of the missing lane is a fault, the same one both ways."""
    messages = []
    for lib in both_ways(LANES, monkeypatch, sanitize=True):
        with pytest.raises(KernelFault, match="read lane 16 of its SIMD-group") as fault:
            call_with_timeout(lib["chain"], torch.zeros(80), threads=80, group_size=80)
        messages.append(str(fault.value))
    assert messages[0] == messages[1]
    assert "thread (79, 0, 0)" in messages[0]


@BUILDS
def test_lanes_meet_beside_returned_threads_and_in_other_iterations(monkeypatch, sanitize):
    out = run_both(LANES, "uneven", 128, 128, 128, monkeypatch, sanitize).numpy().reshape(4, 32)
    for sg in (0, 2, 3):
        v = np.arange(32, dtype=np.float32)
        for _ in range(3 if sg == 2 else 2):
            v = v + np.float32(v.sum(dtype=np.float32)) * np.float32(0.5)
        np.testing.assert_allclose(out[sg], v, rtol=1e-6)
    assert (out[1] == -1).all()


@BUILDS
def test_simd_groups_at_different_functions_in_one_round(monkeypatch, sanitize):
    out = run_both(LANES, "two_places", 128, 128, 128, monkeypatch, sanitize).numpy().reshape(4, 32)
    gid = np.arange(128, dtype=np.float32).reshape(4, 32)
    v = np.where(np.arange(4)[:, None] % 2 == 0, gid.max(axis=1, keepdims=True),
                 np.cumsum(gid, axis=1) - gid)
    np.testing.assert_allclose(out, v + v[:, np.arange(32) ^ 1], rtol=1e-6)


@BUILDS
def test_constants_keep_their_values_across_stops(monkeypatch, sanitize):
    out = run_both(CONSTANTS, "constants", 128, 128, 64, monkeypatch, sanitize).numpy()
    gid = np.arange(128)
    lid = gid % 64
    base = gid * 0.5
    step = [base + i * lid for i in range(3)]
    neighbour = [s.reshape(2, 64)[:, (np.arange(64) + 1) % 64].reshape(-1) for s in step]
    want = sum(neighbour[i] + step[i] + lid + 3 * lid for i in range(3)) + base
    np.testing.assert_allclose(out, want.astype(np.float32), rtol=1e-6)


@BUILDS
def test_a_mutable_member_of_a_const_object_survives_the_stops(monkeypatch, sanitize):
    out = run_both(CONSTANTS, "mutable_member", 3 * 64, 64, 64, monkeypatch, sanitize).numpy().reshape(64, 3)
    lid = np.arange(64)
    n = [lid + i + 1 for i in range(3)]
    want = np.stack([n[i][(lid + 1) % 64] + n[i] for i in range(3)], axis=1)
    np.testing.assert_array_equal(out, want.astype(np.float32))


def group_of(cxx: str, kernel: str) -> str:
    """The text of `kernel`'s group function in the translation `cxx`."""
    group = cxx[cxx.index(f"{kernel}__tsm_group"):]
    return group[:group.index("run_regions")] + group[group.index("run_regions"):].split("__tsm_group", 1)[0]


def saves_of(cxx: str, kernel: str) -> list:
    """What each stop of `kernel`'s group function stores back, per stop."""
    saves = re.findall(r"auto __tsm_save\d+ = \[&\]\(\) \{([^}]*)\}", group_of(cxx, kernel))
    return [re.findall(r"store_local\(__tsm_r\d+, (\w+?)__tsm\d+\)", s) for s in saves]


def in_slot(cxx: str, kernel: str) -> set:
    """The variables of `kernel`'s group function bound to their slots, not copied out."""
    return set(re.findall(r"auto& (\w+?)__tsm\d+ = __tsm_s\d+\[__tsm_t\];", group_of(cxx, kernel)))


def test_constants_are_stored_where_declared_not_at_the_stops(tmp_path):
    path = tmp_path / "constants.metal"
    path.write_text(CONSTANTS)
    cxx = _compiler.generated_cxx(path).text
    declared = set(re.findall(r"store_declared\(__tsm_m, __tsm_s\d+\.out\(__tsm_t\), (\w+?)__tsm\d+\)", cxx))
    assert declared == {"base", "p", "step"}
    assert saves_of(cxx, "constants") == [["acc", "i"], ["acc", "i"]]
    # The object with a mutable member lives in its slot: its stops store only the loop.
    assert saves_of(cxx, "mutable_member") == [["i"], ["i"]]
    assert in_slot(cxx, "mutable_member") == {"c"}
    assert in_slot(cxx, "constants") == set()


def test_the_shuffle_matmul_stores_its_loop_state_only():
    """matmul_shuffle stops at each of its 256 broadcasts per K step: its stops store the
    loops' state, not the constants (its quarter's origin, lane's column...). Its epilogue
    struct `out` holds a field of a dependent type (Acc, the instantiation decides whether
    it could change): kept in its slot, so no stop stores it either."""
    cxx = _compiler.generated_cxx(SHADERS_DIR / "matmul_shuffle.metal").text
    saves = saves_of(cxx, "matmul_shuffle")
    assert len(saves) == 3
    constants = {"m0", "n0", "col", "quad", "sub", "vec_a", "vec_b", "quads"}
    for stored in saves:
        assert not (constants | {"out"}) & set(stored), stored
        assert {"k", "acc", "a", "b"} <= set(stored), stored
    assert in_slot(cxx, "matmul_shuffle") == {"out"}
