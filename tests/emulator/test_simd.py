"""SIMD-group and quad-group functions on the emulator, against NumPy.

Semantics (../shared/notes/metal-semantics.md): a SIMD-group is 32 consecutive thread indices
of a threadgroup (the last one may be partial: its missing lanes do not exist); a quad is 4
consecutive lanes. Reductions, scans, ballots and votes cover the *active* lanes only (lanes
in another branch, or that returned, are inactive); simd_shuffle_up/down do not wrap (lanes
whose source would fall outside keep their own value), the rotates wrap; exclusive scans
give the identity in the first lane. Shuffles never cross SIMD-groups: a threadgroup
reduction needs threadgroup memory and a barrier (the mistake of seed 002).

Inputs are small integers (or +-1, 2, 0.5 for products) so float results are exact.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import compile_shader

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"

# Every collective call is on a line of its own: the emulator identifies a collective by its
# source line (and column where the compiler provides it).
SOURCE = HEADER + r"""
kernel void reductions(device const float* xs [[buffer(0)]],
                       device const float* xp [[buffer(1)]],
                       device const int* xi [[buffer(2)]],
                       device const uint* xu [[buffer(3)]],
                       device float* of [[buffer(4)]],
                       device int* oi [[buffer(5)]],
                       device uint* ou [[buffer(6)]],
                       uint gid [[thread_position_in_grid]]) {
  const float s = xs[gid];
  const float p = xp[gid];
  const int i = xi[gid];
  const uint u = xu[gid];
  device float* f = of + gid * 8;
  f[0] = simd_sum(s);
  f[1] = simd_product(p);
  f[2] = simd_min(s);
  f[3] = simd_max(s);
  f[4] = simd_prefix_inclusive_sum(s);
  f[5] = simd_prefix_exclusive_sum(s);
  f[6] = simd_prefix_inclusive_product(p);
  f[7] = simd_prefix_exclusive_product(p);
  device int* r = oi + gid * 5;
  r[0] = simd_sum(i);
  r[1] = simd_min(i);
  r[2] = simd_max(i);
  r[3] = simd_prefix_inclusive_sum(i);
  r[4] = simd_prefix_exclusive_sum(i);
  device uint* q = ou + gid * 4;
  q[0] = simd_and(u);
  q[1] = simd_or(u);
  q[2] = simd_xor(u);
  q[3] = simd_max(u);
}

kernel void shuffles(device const float* x [[buffer(0)]],
                     device float* o [[buffer(1)]],
                     constant uint& d [[buffer(2)]],
                     uint gid [[thread_position_in_grid]],
                     ushort lane [[thread_index_in_simdgroup]]) {
  const float v = x[gid];
  device float* r = o + gid * 10;
  r[0] = simd_shuffle(v, ushort((lane * 7u + d) % 32u));
  r[1] = simd_shuffle_up(v, ushort(d));
  r[2] = simd_shuffle_down(v, ushort(d));
  r[3] = simd_shuffle_rotate_up(v, ushort(d));
  r[4] = simd_shuffle_rotate_down(v, ushort(d));
  r[5] = simd_shuffle_xor(v, ushort(d));
  r[6] = simd_broadcast(v, ushort(d));
  r[7] = simd_broadcast_first(v);
  r[8] = simd_is_first() ? 1.0f : 0.0f;
  r[9] = simd_shuffle(v, ushort(31u - lane));
}

kernel void typed_shuffles(device const float4* x4 [[buffer(0)]],
                           device const int* xi [[buffer(1)]],
                           device const half* xh [[buffer(2)]],
                           device float4* o4 [[buffer(3)]],
                           device int* oi [[buffer(4)]],
                           device half* oh [[buffer(5)]],
                           uint gid [[thread_position_in_grid]]) {
  o4[2 * gid + 0] = simd_shuffle_xor(x4[gid], ushort(5));
  o4[2 * gid + 1] = simd_sum(x4[gid]);
  oi[gid] = simd_shuffle_down(xi[gid], ushort(3));
  oh[2 * gid + 0] = simd_sum(xh[gid]);
  oh[2 * gid + 1] = simd_shuffle_up(xh[gid], ushort(2));
}

kernel void votes(device const int* pred [[buffer(0)]],
                  device uint* o [[buffer(1)]],
                  uint gid [[thread_position_in_grid]]) {
  const bool b = pred[gid] != 0;
  device uint* r = o + gid * 6;
  const simd_vote v = simd_ballot(b);
  r[0] = uint(ulong(v) & 0xFFFFFFFFul);
  r[1] = uint(ulong(v) >> 32);
  r[2] = simd_all(b) ? 1u : 0u;
  r[3] = simd_any(b) ? 1u : 0u;
  r[4] = simd_is_first() ? 1u : 0u;
  r[5] = uint(simd_vote::vote_t(simd_active_threads_mask()));
}

kernel void quads(device const float* x [[buffer(0)]],
                  device const float* xp [[buffer(1)]],
                  device const uint* xu [[buffer(2)]],
                  device float* o [[buffer(3)]],
                  device uint* ou [[buffer(4)]],
                  constant uint& d [[buffer(5)]],
                  uint gid [[thread_position_in_grid]],
                  ushort lane [[thread_index_in_simdgroup]]) {
  const float v = x[gid];
  device float* r = o + gid * 11;
  r[0] = quad_sum(v);
  r[1] = quad_product(xp[gid]);
  r[2] = quad_min(v);
  r[3] = quad_max(v);
  r[4] = quad_shuffle(v, ushort((lane + d) % 4u));
  r[5] = quad_shuffle_up(v, ushort(d));
  r[6] = quad_shuffle_down(v, ushort(d));
  r[7] = quad_shuffle_rotate_up(v, ushort(d));
  r[8] = quad_shuffle_rotate_down(v, ushort(d));
  r[9] = quad_shuffle_xor(v, ushort(d));
  r[10] = quad_broadcast(v, ushort(d));
  device uint* q = ou + gid * 3;
  q[0] = quad_and(xu[gid]);
  q[1] = quad_or(xu[gid]);
  q[2] = quad_xor(xu[gid]);
}

// Lanes made inactive by branches, a loop break and returning. `which` (uniform) picks one
// construct per launch, so lanes that skip it have no later collective to run ahead to.
// -1 marks "did not take part".
kernel void branches(device const float* x [[buffer(0)]],
                     device float* o [[buffer(1)]],
                     device uint* ob [[buffer(2)]],
                     constant uint& which [[buffer(3)]],
                     uint gid [[thread_position_in_grid]],
                     uint lane [[thread_index_in_simdgroup]]) {
  const float v = x[gid];
  device float* r = o + gid * 9;
  if (which == 0) {
    float a = -1.0f;
    if (lane % 3 == 0) {
      a = simd_sum(v);
    }
    r[0] = a;
  } else if (which == 1) {
    float b = -1.0f;
    if (lane % 3 == 0) {
      b = simd_prefix_exclusive_sum(v);
    }
    r[1] = b;
  } else if (which == 2) {
    float c = -1.0f;
    if (lane >= 5) {
      c = simd_broadcast_first(v);
    }
    r[2] = c;
  } else if (which == 3) {
    float e = -1.0f;
    if (lane >= 5) {
      e = simd_is_first() ? 1.0f : 0.0f;
    }
    r[3] = e;
  } else if (which == 4) {
    float f;
    if (lane < 10) {
      f = simd_max(v);
    } else {
      f = simd_min(v);
    }
    r[4] = f;
  } else if (which == 5) {
    float g = -1.0f;
    if (lane % 2 == 0) {
      g = simd_shuffle_xor(v, ushort(2));
    }
    r[5] = g;
  } else if (which == 6) {
    float h = -1.0f;
    if (lane % 4 < 2) {
      h = quad_sum(v);
    }
    r[6] = h;
  } else if (which == 7) {
    float k = 0.0f;
    for (uint it = 0; it < 4; ++it) {
      if (lane % 4 < it) {
        break;
      }
      k += simd_sum(1.0f);
    }
    r[7] = k;
  } else if (which == 8) {
    if (lane >= 20) {
      return;
    }
    r[8] = simd_sum(v);
  } else if (which == 9) {
    uint bal = 0xFFFFFFFFu;
    if (lane % 2 == 1) {
      bal = uint(simd_vote::vote_t(simd_ballot(v > 4.0f)));
    }
    ob[gid] = bal;
  }
}

// ---- seed 002: a threadgroup reduction with shuffles only --------------------------------
// The seed's "fix": one shuffle_down per halving of the threadgroup size, with barriers.
kernel void seed002_shuffle_only(device const float* x [[buffer(0)]],
                                 device float* out [[buffer(1)]],
                                 uint gid [[thread_position_in_grid]],
                                 uint lid [[thread_position_in_threadgroup]],
                                 uint lsize [[threads_per_threadgroup]],
                                 uint tg [[threadgroup_position_in_grid]]) {
  float val = x[gid];
  for (uint s = lsize / 2; s > 0; s >>= 1) {
    val += simd_shuffle_down(val, ushort(s));
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 0) {
    out[tg] = val;
  }
}

// What a shuffle-down tree gives: one partial per SIMD-group, in its lane 0.
kernel void simd_partials(device const float* x [[buffer(0)]],
                          device float* partial [[buffer(1)]],
                          uint gid [[thread_position_in_grid]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint nsg [[simdgroups_per_threadgroup]],
                          uint tg [[threadgroup_position_in_grid]]) {
  float val = x[gid];
  for (ushort s = 16; s > 0; s >>= 1) {
    val += simd_shuffle_down(val, s);
  }
  if (lane == 0) {
    partial[tg * nsg + sg] = val;
  }
}

// The correct version: SIMD partials through threadgroup memory and a barrier. (simd_sum,
// not a shuffle_down tree, so that partial SIMD-groups of edge threadgroups are right too.)
kernel void threadgroup_sum(device const float* x [[buffer(0)]],
                            device float* out [[buffer(1)]],
                            uint gid [[thread_position_in_grid]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint nsg [[simdgroups_per_threadgroup]],
                            uint tg [[threadgroup_position_in_grid]]) {
  threadgroup float partial[32];
  const float val = simd_sum(x[gid]);
  if (lane == 0) {
    partial[sg] = val;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float p = lane < nsg ? partial[lane] : 0.0f;
    p = simd_sum(p);
    if (lane == 0) {
      out[tg] = p;
    }
  }
}

kernel void quad_votes_and_scans(device const float* x [[buffer(0)]],
                                 device float* o [[buffer(1)]],
                                 uint gid [[thread_position_in_grid]]) {
  const float v = x[gid];
  device float* r = o + gid * 10;
  r[0] = quad_broadcast_first(v);
  r[1] = quad_all(v > 2.0f) ? 1.0f : 0.0f;
  r[2] = quad_any(v > 2.0f) ? 1.0f : 0.0f;
  r[3] = quad_is_first() ? 1.0f : 0.0f;
  r[4] = float(quad_vote::vote_t(quad_ballot(v > 2.0f)));
  r[5] = quad_prefix_inclusive_sum(v);
  r[6] = quad_prefix_exclusive_sum(v);
  r[7] = quad_prefix_inclusive_product(v);
  r[8] = quad_prefix_exclusive_product(v);
  r[9] = float(quad_vote::vote_t(quad_active_threads_mask()));
}

// simd_shuffle_and_fill_up/down (MSL 2.4): lanes whose source falls off the (modulo)
// window take `filling` from the lane on the other side of the window.
kernel void shuffle_and_fill(device const float* x [[buffer(0)]],
                             device const float* fill [[buffer(1)]],
                             device float* o [[buffer(2)]],
                             constant uint& d [[buffer(3)]],
                             uint gid [[thread_position_in_grid]]) {
  device float* r = o + gid * 4;
  r[0] = simd_shuffle_and_fill_up(x[gid], fill[gid], ushort(d));
  r[1] = simd_shuffle_and_fill_down(x[gid], fill[gid], ushort(d));
  r[2] = simd_shuffle_and_fill_up(x[gid], fill[gid], ushort(d), ushort(8));
  r[3] = simd_shuffle_and_fill_down(x[gid], fill[gid], ushort(d), ushort(8));
}

// Reconvergence: after a branch or a loop the SIMD-group is whole again.
kernel void collective_after_a_branch(device float* o [[buffer(0)]],
                                      uint gid [[thread_position_in_grid]],
                                      uint lane [[thread_index_in_simdgroup]]) {
  float a = 0.0f;
  if (lane % 2 == 0) {
    a = simd_sum(1.0f);
  }
  const float b = simd_sum(1.0f);
  o[2 * gid + 0] = a;
  o[2 * gid + 1] = b;
}

kernel void collective_after_a_loop(device float* o [[buffer(0)]],
                                    uint gid [[thread_position_in_grid]],
                                    uint lane [[thread_index_in_simdgroup]]) {
  float k = 0.0f;
  for (uint it = 0; it < 4; ++it) {
    if (lane % 4 < it) {
      break;
    }
    k += simd_sum(1.0f);
  }
  const float after = simd_sum(k);
  o[2 * gid + 0] = k;
  o[2 * gid + 1] = after;
}

// Two collectives on one line, in the two arms of a conditional: two collectives.
kernel void two_collectives_on_one_line(device const float* x [[buffer(0)]],
                                        device float* o [[buffer(1)]],
                                        uint gid [[thread_position_in_grid]],
                                        uint lane [[thread_index_in_simdgroup]]) {
  o[gid] = (lane & 1u) ? simd_sum(x[gid]) : simd_sum(x[gid] * 2.0f);
}
"""

# Collectives reached from divergent branches through one helper function: in Metal each
# branch executes its own simd_sum over its own active lanes.
HELPER_FUNCTION_SOURCE = HEADER + r"""
inline float helper_sum(float v) {
  return simd_sum(v);
}

kernel void helper_from_two_branches(device const float* x [[buffer(0)]],
                                     device float* o [[buffer(1)]],
                                     uint gid [[thread_position_in_grid]],
                                     uint lane [[thread_index_in_simdgroup]]) {
  float r;
  if (lane < 16) {
    r = helper_sum(x[gid]);
  } else {
    r = helper_sum(x[gid] * 2.0f);
  }
  o[gid] = r;
}

// Reconvergence through a helper defined above the kernel: the helper's simd_sum comes
// *first* in the source, yet runs after the branch, on all 32 lanes.
kernel void helper_after_a_branch(device float* o [[buffer(0)]],
                                  uint gid [[thread_position_in_grid]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  float a = 0.0f;
  if (lane % 2 == 0) {
    a = simd_sum(1.0f);
  }
  const float b = helper_sum(1.0f);
  o[2 * gid + 0] = a;
  o[2 * gid + 1] = b;
}
"""

@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE)


# ---- NumPy model of the SIMD-groups of a 1-D dispatch ------------------------------------
def simd_groups(n, group):
    """Global ids of each SIMD-group of a 1-D dispatch of n threads in groups of `group`."""
    out = []
    for start in range(0, n, group):
        size = min(group, n - start)
        for s in range(0, size, 32):
            out.append(np.arange(start + s, start + min(size, s + 32)))
    return out


def per_group(fn, x, groups, out_shape=None, dtype=None):
    out = np.empty(len(x) if out_shape is None else out_shape, dtype=dtype or x.dtype)
    for g in groups:
        out[g] = fn(x[g])
    return out


def exclusive(fn, identity):
    return lambda v: np.concatenate([[identity], fn(v)[:-1]]).astype(v.dtype)


def _rng(seed):
    return np.random.default_rng(seed)


# Full SIMD-groups; a partial last SIMD-group (40 = 32 + 8); edge threadgroups whose
# SIMD-groups are 32 + 16 and a last threadgroup of 4 threads.
CONFIGS = [(128, 64), (40, 40), (100, 48), (7, 7)]


@pytest.mark.parametrize("n,group", CONFIGS)
def test_reductions_and_scans(lib, n, group):
    rng = _rng(n)
    xs = rng.integers(-8, 9, size=n).astype(np.float32)
    xp = rng.choice(np.array([1.0, -1.0, 2.0, 0.5], dtype=np.float32), size=n)
    xi = rng.integers(-1000, 1001, size=n).astype(np.int32)
    xu = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    of = torch.full((n, 8), np.nan)
    oi = torch.zeros((n, 5), dtype=torch.int32)
    ou = torch.zeros((n, 4), dtype=torch.int32)
    lib.reductions(torch.from_numpy(xs), torch.from_numpy(xp), torch.from_numpy(xi),
                   torch.from_numpy(xu.view(np.int32)), of, oi, ou, threads=n, group_size=group)
    G = simd_groups(n, group)
    f, i, u = of.numpy(), oi.numpy(), ou.numpy().view(np.uint32)
    b = lambda fn, x: per_group(fn, x, G)  # noqa: E731 - broadcast a group value to lanes
    checks = {
        "simd_sum(float)": (f[:, 0], b(lambda v: v.sum(), xs)),
        "simd_product(float)": (f[:, 1], b(lambda v: np.prod(v), xp)),
        "simd_min(float)": (f[:, 2], b(lambda v: v.min(), xs)),
        "simd_max(float)": (f[:, 3], b(lambda v: v.max(), xs)),
        "simd_prefix_inclusive_sum(float)": (f[:, 4], b(np.cumsum, xs)),
        "simd_prefix_exclusive_sum(float)": (f[:, 5], b(exclusive(np.cumsum, 0), xs)),
        "simd_prefix_inclusive_product(float)": (f[:, 6], b(np.cumprod, xp)),
        "simd_prefix_exclusive_product(float)": (f[:, 7], b(exclusive(np.cumprod, 1), xp)),
        "simd_sum(int)": (i[:, 0], b(lambda v: v.sum(), xi)),
        "simd_min(int)": (i[:, 1], b(lambda v: v.min(), xi)),
        "simd_max(int)": (i[:, 2], b(lambda v: v.max(), xi)),
        "simd_prefix_inclusive_sum(int)": (i[:, 3], b(np.cumsum, xi)),
        "simd_prefix_exclusive_sum(int)": (i[:, 4], b(exclusive(np.cumsum, 0), xi)),
        "simd_and(uint)": (u[:, 0], b(np.bitwise_and.reduce, xu)),
        "simd_or(uint)": (u[:, 1], b(np.bitwise_or.reduce, xu)),
        "simd_xor(uint)": (u[:, 2], b(np.bitwise_xor.reduce, xu)),
        "simd_max(uint)": (u[:, 3], b(lambda v: v.max(), xu)),
    }
    for name, (got, want) in checks.items():
        np.testing.assert_array_equal(got, want, err_msg=f"{name}, n={n}, group={group}")


def _shuffle_oracle(x, d, G):
    """(n, 10) expected values; NaN where the source lane does not exist."""
    want = np.full((len(x), 10), np.nan, dtype=np.float32)
    for g in G:
        m = len(g)
        v = x[g]
        lane = np.arange(m)

        def read(src):
            src = np.asarray(src)
            return np.where((src >= 0) & (src < m), v[np.clip(src, 0, m - 1)], np.nan)

        want[g, 0] = read((lane * 7 + d) % 32)
        want[g, 1] = np.where(lane < d, v, read(lane - d))          # edge lanes keep theirs
        want[g, 2] = np.where(lane + d >= 32, v, read(lane + d))
        want[g, 3] = read((lane - d) % 32)
        want[g, 4] = read((lane + d) % 32)
        want[g, 5] = read(lane ^ d)
        want[g, 6] = read(np.full(m, d))
        want[g, 7] = v[0]
        want[g, 8] = (lane == 0).astype(np.float32)
        want[g, 9] = read(31 - lane)
    return want


@pytest.mark.parametrize("d", [0, 1, 3, 16, 31])
def test_shuffles_full_simdgroups(lib, d):
    n, group = 128, 64
    x = _rng(d).integers(-100, 100, size=n).astype(np.float32)
    o = torch.full((n, 10), -12345.0)
    lib.shuffles(torch.from_numpy(x), o, d, threads=n, group_size=group)
    want = _shuffle_oracle(x, d, simd_groups(n, group))
    assert not np.isnan(want).any()
    names = ["shuffle", "shuffle_up", "shuffle_down", "rotate_up", "rotate_down", "xor",
             "broadcast", "broadcast_first", "is_first", "shuffle(reverse)"]
    for k, name in enumerate(names):
        np.testing.assert_array_equal(o.numpy()[:, k], want[:, k], err_msg=f"{name}, d={d}")


@pytest.mark.parametrize("d", [1, 3, 6])
def test_shuffles_partial_simdgroup(lib, d):
    """40 threads: SIMD-group 1 has lanes 0-7 only. Where the source lane exists the value is
    Metal's; where it does not (unspecified in Metal) the emulator returns its poison, NaN."""
    n = 40
    x = _rng(d).integers(-100, 100, size=n).astype(np.float32)
    o = torch.full((n, 10), -12345.0)
    lib.shuffles(torch.from_numpy(x), o, d, threads=n, group_size=n)
    want = _shuffle_oracle(x, d, simd_groups(n, n))
    got = o.numpy()
    defined = ~np.isnan(want)
    np.testing.assert_array_equal(got[defined], want[defined])
    assert np.isnan(got[~defined]).all(), "reading a lane that does not exist is not poisoned"
    # shuffle_up, broadcast_first and is_first are defined for every existing lane.
    assert defined[:, [1, 7, 8]].all()


def test_shuffles_and_sums_of_vectors_ints_and_halves(lib):
    n = 64
    rng = _rng(5)
    x4 = rng.integers(-50, 50, size=(n, 4)).astype(np.float32)
    xi = rng.integers(-50, 50, size=n).astype(np.int32)
    xh = rng.integers(-20, 20, size=n).astype(np.float16)
    o4 = torch.zeros((n, 2, 4))
    oi = torch.zeros(n, dtype=torch.int32)
    oh = torch.zeros((n, 2), dtype=torch.float16)
    lib.typed_shuffles(torch.from_numpy(x4), torch.from_numpy(xi), torch.from_numpy(xh),
                       o4, oi, oh, threads=n, group_size=n)
    lane = np.arange(n) % 32
    base = np.arange(n) - lane
    np.testing.assert_array_equal(o4.numpy()[:, 0], x4[base + (lane ^ 5)])
    np.testing.assert_array_equal(o4.numpy()[:, 1],
                                  np.repeat(x4.reshape(2, 32, 4).sum(axis=1), 32, axis=0))
    down3 = xi[np.minimum(base + lane + 3, n - 1)]
    np.testing.assert_array_equal(oi.numpy(), np.where(lane + 3 >= 32, xi, down3))
    np.testing.assert_array_equal(oh.numpy()[:, 0],
                                  np.repeat(xh.reshape(2, 32).astype(np.float32).sum(axis=1), 32))
    up2 = xh[np.maximum(base + lane - 2, 0)]
    np.testing.assert_array_equal(oh.numpy()[:, 1], np.where(lane < 2, xh, up2))


PATTERNS = {
    "all_true": lambda n, rng: np.ones(n, dtype=np.int32),
    "all_false": lambda n, rng: np.zeros(n, dtype=np.int32),
    "random": lambda n, rng: rng.integers(0, 2, size=n).astype(np.int32),
    "only_lane_5": lambda n, rng: (np.arange(n) % 32 == 5).astype(np.int32),
}


@pytest.mark.parametrize("n,group", [(64, 64), (40, 40), (100, 48)])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_ballot_all_any_is_first(lib, n, group, pattern):
    pred = PATTERNS[pattern](n, _rng(n))
    o = torch.zeros((n, 6), dtype=torch.int32)
    lib.votes(torch.from_numpy(pred), o, threads=n, group_size=group)
    got = o.numpy().view(np.uint32)
    for g in simd_groups(n, group):
        p = pred[g].astype(bool)
        bits = int(sum(1 << k for k in range(len(g)) if p[k]))
        np.testing.assert_array_equal(got[g, 0], bits, err_msg="simd_ballot low word")
        np.testing.assert_array_equal(got[g, 1], 0, err_msg="simd_ballot high word")
        np.testing.assert_array_equal(got[g, 2], int(p.all()), err_msg="simd_all")
        np.testing.assert_array_equal(got[g, 3], int(p.any()), err_msg="simd_any")
        np.testing.assert_array_equal(got[g, 4], (np.arange(len(g)) == 0).astype(np.uint32),
                                      err_msg="simd_is_first")
        np.testing.assert_array_equal(got[g, 5], (1 << len(g)) - 1,
                                      err_msg="simd_active_threads_mask")


@pytest.mark.parametrize("d", [0, 1, 2, 3])
@pytest.mark.parametrize("n,group", [(64, 64), (42, 42)])
def test_quad_functions(lib, d, n, group):
    rng = _rng(10 + d)
    x = rng.integers(-30, 30, size=n).astype(np.float32)
    xp = rng.choice(np.array([1.0, -1.0, 2.0, 0.5], dtype=np.float32), size=n)
    xu = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    o = torch.full((n, 11), -12345.0)
    ou = torch.zeros((n, 3), dtype=torch.int32)
    lib.quads(torch.from_numpy(x), torch.from_numpy(xp), torch.from_numpy(xu.view(np.int32)),
              o, ou, d, threads=n, group_size=group)
    got, gotu = o.numpy(), ou.numpy().view(np.uint32)
    want = np.full((n, 11), np.nan, dtype=np.float32)
    wantu = np.zeros((n, 3), dtype=np.uint32)
    for start in range(0, n, 4):   # quads: 4 consecutive thread indices (group is 1-D here)
        q = np.arange(start, min(start + 4, n))
        m = len(q)
        v = x[q]
        ql = np.arange(m)

        def read(src):
            return np.where((src >= 0) & (src < m), v[np.clip(src, 0, m - 1)], np.nan)

        want[q, 0] = v.sum()
        want[q, 1] = np.prod(xp[q])
        want[q, 2] = v.min()
        want[q, 3] = v.max()
        want[q, 4] = read((ql + d) % 4)
        want[q, 5] = np.where(ql < d, v, read(ql - d))
        want[q, 6] = np.where(ql + d >= 4, v, read(ql + d))
        want[q, 7] = read((ql - d) % 4)
        want[q, 8] = read((ql + d) % 4)
        want[q, 9] = read(ql ^ d)
        want[q, 10] = read(np.full(m, d))
        wantu[q, 0] = np.bitwise_and.reduce(xu[q])
        wantu[q, 1] = np.bitwise_or.reduce(xu[q])
        wantu[q, 2] = np.bitwise_xor.reduce(xu[q])
    defined = ~np.isnan(want)
    assert defined[:40].all()
    np.testing.assert_array_equal(got[defined], want[defined])
    assert np.isnan(got[~defined]).all()
    np.testing.assert_array_equal(gotu, wantu)


BRANCH_CASES = ["sum in branch", "exclusive scan in branch", "broadcast_first in branch",
                "is_first in branch", "if/else max/min", "shuffle_xor in branch",
                "quad_sum in branch", "sum in a loop with break", "sum after some lanes returned",
                "ballot in branch"]


def _branch_oracle(x, n, group):
    want = np.full((n, 10), -1.0, dtype=np.float64)
    for g in simd_groups(n, group):
        lane = np.arange(len(g))
        v = x[g].astype(np.float64)

        def on(mask, values):
            col = np.full(len(g), -1.0)
            col[mask] = values
            return col

        m3 = lane % 3 == 0
        want[g, 0] = on(m3, v[m3].sum())
        want[g, 1] = on(m3, np.concatenate([[0], np.cumsum(v[m3])[:-1]]))
        m5 = lane >= 5
        if m5.any():
            want[g, 2] = on(m5, v[m5][0])
            want[g, 3] = on(m5, (lane[m5] == lane[m5][0]).astype(np.float64))
        lo = lane < 10
        want[g, 4] = np.where(lo, v[lo].max(), v[~lo].min() if (~lo).any() else 0)
        ev = lane % 2 == 0
        src = lane ^ 2
        want[g, 5] = on(ev, np.where(src[ev] < len(g), v[np.minimum(src[ev], len(g) - 1)], np.nan))
        qm = lane % 4 < 2
        qsum = np.array([v[(lane // 4 == lane[k] // 4) & qm].sum() for k in range(len(g))])
        want[g, 6] = on(qm, qsum[qm])
        # iteration `it` of the loop runs on the lanes with lane % 4 >= it
        want[g, 7] = [sum(np.count_nonzero(lane % 4 >= it) for it in range(4) if l % 4 >= it)
                      for l in lane]
        alive = lane < 20
        want[g, 8] = np.where(alive, v[alive].sum(), -1.0)
        od = lane % 2 == 1
        want[g, 9] = np.where(od, sum(1 << int(k) for k in lane[od & (v > 4)]), 0xFFFFFFFF)
    return want


@pytest.mark.parametrize("n,group", [(64, 64), (40, 40)])
@pytest.mark.parametrize("which", range(len(BRANCH_CASES)))
def test_inactive_lanes_do_not_take_part(lib, n, group, which):
    x = _rng(3).integers(0, 10, size=n).astype(np.float32)
    o = torch.full((n, 9), -1.0)
    ob = torch.full((n,), -1, dtype=torch.int32)
    lib.branches(torch.from_numpy(x), o, ob, which, threads=n, group_size=group)
    want = _branch_oracle(x, n, group)[:, which]
    got = ob.numpy().view(np.uint32) if which == 9 else o.numpy()[:, which]
    np.testing.assert_array_equal(got, want, err_msg=BRANCH_CASES[which])


# ---- seed 002 --------------------------------------------------------------------------
def _seed_input(n, seed=0):
    return _rng(seed).integers(1, 10, size=n).astype(np.float32)


def test_seed002_shuffle_only_reduction_is_not_the_threadgroup_sum(lib):
    n, group = 1024, 256
    x = _seed_input(n)
    out = torch.zeros(n // group)
    lib.seed002_shuffle_only(torch.from_numpy(x), out, threads=n, group_size=group)
    total = x.reshape(-1, group).sum(axis=1)
    first_simd = x.reshape(-1, group)[:, :32].sum(axis=1)
    assert not np.array_equal(out.numpy(), total)
    # Deltas 128, 64 and 32 are >= 32: every lane keeps its own value and doubles it; the
    # deltas 16..1 then sum SIMD-group 0 only. Lane 0 reports 8x SIMD-group 0's partial.
    np.testing.assert_array_equal(out.numpy(), 8 * first_simd)


def test_shuffle_down_tree_gives_per_simdgroup_partials(lib):
    n, group = 1024, 256
    x = _seed_input(n, 1)
    partial = torch.full((n // 32,), -1.0)
    lib.simd_partials(torch.from_numpy(x), partial, threads=n, group_size=group)
    np.testing.assert_array_equal(partial.numpy(), x.reshape(-1, 32).sum(axis=1))
    assert not np.array_equal(partial.numpy()[:: group // 32], x.reshape(-1, group).sum(axis=1))


def test_shuffle_down_tree_on_a_partial_simdgroup_reads_missing_lanes(lib):
    # 1000 = 3*256 + 232: the last SIMD-group has 8 lanes; its shuffle_down tree reads lanes
    # 8..31, which do not exist. Metal leaves that unspecified; the emulator poisons (NaN).
    n, group = 1000, 256
    x = _seed_input(n, 2)
    partial = torch.full((32,), -1.0)
    lib.simd_partials(torch.from_numpy(x), partial, threads=n, group_size=group)
    full = x[: 31 * 32].reshape(31, 32).sum(axis=1)
    np.testing.assert_array_equal(partial.numpy()[:31], full)
    assert np.isnan(partial.numpy()[31])


@pytest.mark.parametrize("n,group", [(1024, 256), (1000, 256), (4096, 1024), (300, 96)])
def test_threadgroup_reduction_through_threadgroup_memory_is_right(lib, n, group):
    x = _rng(n).standard_normal(n).astype(np.float32)
    ngroups = -(-n // group)
    out = torch.zeros(ngroups)
    lib.threadgroup_sum(torch.from_numpy(x), out, threads=n, group_size=group)
    padded = np.zeros(ngroups * group, dtype=np.float64)
    padded[:n] = x
    want = padded.reshape(ngroups, group).sum(axis=1)
    # float32 tree sum of <= 1024 N(0,1) values vs float64: error well below 1e-4 abs.
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-4)


# ---- quad votes and scans, shuffle_and_fill, reconvergence -------------------------------
@pytest.mark.parametrize("n", [32, 42])
def test_quad_votes_and_scans(lib, n):
    x = np.tile(np.array([1.0, 3.0, 2.0, 4.0], dtype=np.float32), 11)[:n]
    o = torch.zeros((n, 10))
    lib.quad_votes_and_scans(torch.from_numpy(x), o, threads=n, group_size=n)
    want = np.zeros((n, 10))
    for start in range(0, n, 4):
        q = np.arange(start, min(start + 4, n))
        v = x[q].astype(np.float64)
        m = len(q)
        want[q, 0] = v[0]
        want[q, 1] = float((v > 2).all())
        want[q, 2] = float((v > 2).any())
        want[q, 3] = (np.arange(m) == 0)
        want[q, 4] = sum(1 << k for k in range(m) if v[k] > 2)
        want[q, 5] = np.cumsum(v)
        want[q, 6] = np.concatenate([[0], np.cumsum(v)[:-1]])
        want[q, 7] = np.cumprod(v)
        want[q, 8] = np.concatenate([[1], np.cumprod(v)[:-1]])
        want[q, 9] = (1 << m) - 1   # a partial last quad (n = 42) has 2 lanes
    np.testing.assert_array_equal(o.numpy(), want)


@pytest.mark.parametrize("d", [0, 1, 3, 7])
def test_shuffle_and_fill(lib, d):
    n = 64
    x = np.arange(n, dtype=np.float32)
    fill = 1000 + np.arange(n, dtype=np.float32)
    o = torch.zeros((n, 4))
    lib.shuffle_and_fill(torch.from_numpy(x), torch.from_numpy(fill), o, d, threads=n,
                         group_size=n)
    gid = np.arange(n)
    want = np.zeros((n, 4), dtype=np.float32)
    for col, (w, up) in enumerate([(32, True), (32, False), (8, True), (8, False)]):
        base, i = gid - gid % w, gid % w
        if up:   # lanes i < d take filling from the top d lanes of the window
            want[:, col] = np.where(i >= d, x[base + (i - d) % w], fill[base + (i - d) % w])
        else:    # lanes i + d >= w take filling from the bottom d lanes of the window
            want[:, col] = np.where(i + d < w, x[base + (i + d) % w], fill[base + (i + d) % w])
    np.testing.assert_array_equal(o.numpy(), want)


def test_collective_after_a_branch_sees_all_lanes(lib):
    o = torch.zeros((64, 2))
    lib.collective_after_a_branch(o, threads=64, group_size=64)
    lane = np.arange(64) % 32
    np.testing.assert_array_equal(o.numpy()[:, 0], np.where(lane % 2 == 0, 16.0, 0.0))
    np.testing.assert_array_equal(o.numpy()[:, 1], 32.0)


@pytest.mark.parametrize("n", [32, 40])
def test_collective_after_a_loop_with_break_sees_all_lanes(lib, n):
    o = torch.zeros((n, 2))
    lib.collective_after_a_loop(o, threads=n, group_size=n)
    got = o.numpy()
    for g in simd_groups(n, n):
        lane = np.arange(len(g))
        k = np.array([sum(np.count_nonzero(lane % 4 >= it) for it in range(4) if l % 4 >= it)
                      for l in lane], dtype=np.float64)
        np.testing.assert_array_equal(got[g, 0], k)
        np.testing.assert_array_equal(got[g, 1], k.sum())


def test_two_collectives_on_one_line_in_divergent_branches(lib):
    x = np.ones(32, dtype=np.float32)
    o = torch.zeros(32)
    lib.two_collectives_on_one_line(torch.from_numpy(x), o, threads=32, group_size=32)
    # odd lanes: sum of 1 over 16 odd lanes; even lanes: sum of 2 over 16 even lanes
    np.testing.assert_array_equal(o.numpy(), np.where(np.arange(32) % 2 == 1, 16.0, 32.0))


# ---- collectives inside helper functions --------------------------------------------------
def test_collectives_in_a_shared_helper_from_divergent_branches():
    lib = compile_shader(HELPER_FUNCTION_SOURCE)
    x = np.ones(32, dtype=np.float32)
    o = torch.zeros(32)
    lib.helper_from_two_branches(torch.from_numpy(x), o, threads=32, group_size=32)
    # lanes 0-15: sum of 1 over 16 lanes; lanes 16-31: sum of 2 over 16 lanes
    np.testing.assert_array_equal(o.numpy(), [16.0] * 16 + [32.0] * 16)


def test_collective_in_a_helper_after_a_branch_sees_all_lanes():
    lib = compile_shader(HELPER_FUNCTION_SOURCE)
    o = torch.zeros((32, 2))
    lib.helper_after_a_branch(o, threads=32, group_size=32)
    lane = np.arange(32)
    np.testing.assert_array_equal(o.numpy()[:, 0], np.where(lane % 2 == 0, 16.0, 0.0))
    np.testing.assert_array_equal(o.numpy()[:, 1], 32.0)


# ---- collectives inside loops: iterations are told apart --------------------------------
LOOP_SOURCE = HEADER + r"""
kernel void skip_an_iteration(device float* o [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  for (uint i = 0; i < 2; ++i) {
    if (lane == 1 && i == 0) continue;   // lane 1 sits out iteration 0's collective
    o[lane * 2 + i] = simd_sum(1.0f);
  }
}
"""


def test_a_lane_skipping_an_iteration_does_not_join_the_next_ones_collective():
    lib = compile_shader(LOOP_SOURCE)
    o = torch.full((64,), -1.0)
    lib.skip_an_iteration(o, threads=32, group_size=32)
    got = o.view(32, 2).numpy()
    np.testing.assert_array_equal(got[:, 1], 32.0)           # iteration 1: every lane
    np.testing.assert_array_equal(np.delete(got[:, 0], 1), 31.0)  # iteration 0: 31 lanes
    assert got[1, 0] == -1.0                                 # lane 1 wrote nothing there
