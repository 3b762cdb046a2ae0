"""k-means: every kernel of shaders/kmeans.metal (sanitized, on the emulator) against the
plain-torch reference, and the KMeans estimator against scikit-learn on real data.

The suite runs the package's kernels under the sanitizer (tests/conftest.py), one CPU
thread at a time. The few tests that need real concurrency (atomics racing across worker
threads, determinism run to run) or real data sizes switch it off with ``unsanitized``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse
import torch
from torch import nn

import torch_sparse_metal as tsm
from torch_sparse_metal._paths import SHADERS_DIR
from torch_sparse_metal.cluster import NotFittedError
from torch_sparse_metal.emulator import compile_shader, load_shader_file, record
from torch_sparse_metal.ops import kmeans as K
from torch_sparse_metal.reference import kmeans as R

# Tolerances are data: the kernels and the reference differ by summation order only.
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-10),
       torch.float32: dict(rtol=1e-5, atol=1e-4)}
DTYPES = (torch.float32, torch.float64)
# (n, k, d): partial 16x16 distance tiles, k past one tile, d past one 32-wide feature tile,
# k = 1, d = 1, and a k large enough to shrink the accumulate threadgroups.
SHAPES = [(37, 3, 5), (70, 20, 70), (50, 1, 1), (33, 300, 3)]


@pytest.fixture
def emulator():
    with tsm.use_backend("emulator"):
        yield


@pytest.fixture
def unsanitized(monkeypatch):
    """The plain emulator build on two worker threads: atomics really race, and it is fast."""
    monkeypatch.setenv("TSM_SANITIZE", "0")
    monkeypatch.setenv("TSM_EMU_WORKERS", "2")


def data(n, k, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=dtype),
            torch.randn(k, d, generator=g, dtype=dtype),
            torch.randint(0, k, (n,), generator=g, dtype=torch.int32))


def blobs(n_per, centers, spread=0.3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    centers = torch.as_tensor(centers, dtype=dtype)
    pts = [c + spread * torch.randn(n_per, centers.shape[1], generator=g, dtype=dtype)
           for c in centers]
    x = torch.cat(pts)
    return x[torch.randperm(x.shape[0], generator=g)].contiguous()


BLOB_CENTERS = [[0.0, 0.0], [5.0, 5.0], [-5.0, 5.0], [5.0, -5.0]]


# ---------------------------------------------------------------------------------------
# Kernels


def test_every_kernel_name_exists():
    lib = load_shader_file(K.SHADER)
    assert set(K.kernel_names("emulator")) <= set(lib.kernel_names)
    # Metal (float only) asks for a subset: no double, and the CAS kernel is float.
    assert set(K.kernel_names("metal")) <= set(K.kernel_names("emulator"))
    assert not any(n.endswith("_double") for n in K.kernel_names("metal"))


def test_native_atomic_kernel_is_guarded_by_metal_version():
    # Older language versions have no atomic_float: the library must still compile there,
    # with the CAS kernel, so the native one sits under __METAL_VERSION__ >= 300.
    src = (SHADERS_DIR / K.SHADER).read_text()
    guarded = src.split("#if __METAL_VERSION__ >= 300")
    assert len(guarded) == 3
    assert all("kmeans_accumulate_atomic" in part.split("#endif")[0] for part in guarded[1:])
    assert "kmeans_accumulate_cas_float" not in "".join(p.split("#endif")[0] for p in guarded[1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, d", SHAPES)
def test_norms_distances_assign(emulator, n, k, d, dtype):
    x, c, _ = data(n, k, d, dtype)
    c[k // 2] = x[0]  # a point on a centroid: distance exactly 0 after the clamp
    torch.testing.assert_close(K.sq_norms(x), R.sq_norms_reference(x), **TOL[dtype])
    dist = K.distances(x, c)
    ref = R.distances_reference(x, c)
    torch.testing.assert_close(dist, ref, **TOL[dtype])
    assert bool((dist >= 0).all())
    labels, min_dist = K.assign_from_distances(dist)
    ref_labels, ref_min = R.assign_reference(dist)
    assert labels.dtype == torch.int32
    assert torch.equal(labels, ref_labels)
    assert torch.equal(min_dist, ref_min)


def test_assign_takes_lowest_index_on_ties(emulator):
    dist = torch.tensor([[3.0, 1.0, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0], [5.0, 4.0, 3.0, 3.0]])
    labels, min_dist = K.assign_from_distances(dist)
    assert labels.tolist() == [1, 0, 2]
    assert min_dist.tolist() == [1.0, 0.0, 3.0]


@pytest.mark.parametrize("mode, dtype", [("atomic", torch.float32), ("atomic", torch.float64),
                                         ("cas", torch.float32),
                                         ("deterministic", torch.float32),
                                         ("deterministic", torch.float64)])
@pytest.mark.parametrize("n, k, d", SHAPES + [(600, 4, 2)])
def test_accumulate_modes(emulator, mode, dtype, n, k, d):
    x, _, labels = data(n, k, d, dtype, seed=n + k)
    sums, counts = K.accumulate(x, labels, k, mode=mode)
    ref_sums, ref_counts = R.accumulate_reference(x, labels, k)
    assert counts.dtype == torch.int32
    assert torch.equal(counts, ref_counts)
    torch.testing.assert_close(sums, ref_sums, **TOL[dtype])


def test_accumulate_launches_zero_then_one_kernel(emulator):
    x, _, labels = data(40, 3, 4)
    with record() as launches:
        K.accumulate(x, labels, 3, mode="cas")
        K.accumulate(x, labels, 3, mode="deterministic")
    assert [l.kernel for l in launches] == [
        "kmeans_zero_float", "kmeans_accumulate_cas_float",
        "kmeans_accumulate_blocks_float", "kmeans_reduce_blocks_float"]


def test_cas_is_float32_only(emulator):
    x, _, labels = data(10, 2, 3, torch.float64)
    with pytest.raises(ValueError, match="float32 only"):
        K.accumulate(x, labels, 2, mode="cas")


CAS_HAMMER = r"""
#include "kmeans.metal"
// Every thread adds 1 to the same float through the CAS loop: the worst contention.
kernel void cas_hammer(device atomic_uint* total [[buffer(0)]],
                       uint gid [[thread_position_in_grid]]) {
  kmeans_atomic_add_float_cas(total, 1.0f);
}
"""


@pytest.mark.parametrize("sanitize", [True, False])
def test_cas_loop_under_contention(sanitize, monkeypatch):
    # Sanitized: every third weak CAS fails spuriously, so a loop that gave up would lose
    # adds. Plain, on 4 workers: real threads race for one address.
    monkeypatch.setenv("TSM_EMU_WORKERS", "4")
    lib = compile_shader(CAS_HAMMER, include_dirs=[str(SHADERS_DIR)], sanitize=sanitize)
    total = torch.zeros(1)
    n = 2048 if sanitize else 1 << 16
    lib.cas_hammer(total, threads=n, group_size=256)
    assert total.item() == float(n)  # integers below 2^24 add exactly in float32


@pytest.mark.parametrize("mode", ["cas", "atomic"])
def test_accumulate_all_points_in_one_cluster(unsanitized, emulator, mode):
    # Every block of points flushes into the same cluster row: contended device atomics.
    n, k, d = 4096, 5, 32
    x = torch.randint(-8, 8, (n, d)).float()  # small integers: every sum is exact
    labels = torch.full((n,), 3, dtype=torch.int32)
    assert K.accumulate_shape(n, k, d, 4).blocks > 4
    sums, counts = K.accumulate(x, labels, k, mode=mode)
    assert counts.tolist() == [0, 0, 0, n, 0]
    assert torch.equal(sums[3], x.sum(0))
    assert not bool(sums[[0, 1, 2, 4]].any())


def test_accumulate_contention_sanitized(emulator):
    n, k, d = 700, 2, 3
    x = torch.randint(-8, 8, (n, d)).float()
    labels = torch.zeros(n, dtype=torch.int32)
    sums, counts = K.accumulate(x, labels, k, mode="cas")
    assert counts.tolist() == [n, 0]
    assert torch.equal(sums[0], x.sum(0))


def test_deterministic_accumulate_is_bit_identical(unsanitized, emulator):
    x, _, labels = data(20000, 7, 9, seed=3)
    first = K.accumulate(x, labels, 7, mode="deterministic")
    for _ in range(3):
        again = K.accumulate(x, labels, 7, mode="deterministic")
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_finalize_keeps_empty_clusters(emulator, dtype):
    x, old, labels = data(30, 4, 6, dtype)
    labels[labels == 2] = 1  # cluster 2 empty
    sums, counts = K.accumulate(x, labels, 4)
    new = K.finalize(sums, counts, old)
    assert counts[2] == 0
    assert torch.equal(new[2], old[2])
    assert bool(torch.isfinite(new).all())
    torch.testing.assert_close(new, R.finalize_reference(sums, counts, old), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, d", [(1, 1), (5, 3), (300, 4)])
def test_drift(emulator, dtype, k, d):
    _, old, _ = data(1, k, d, dtype)
    new = old + torch.linspace(0, 1, k, dtype=dtype)[:, None]
    torch.testing.assert_close(K.drift(old, new), R.drift_reference(old, new), **TOL[dtype])
    assert K.drift(old, old).tolist() == [0.0, 0.0]
    # The norms the Lloyd loop takes from drift for the next GEMM: the same bits as sq_norms
    # (same fma order), so folding them in changes no result.
    shift, new_sq = K.drift_and_norms(old, new)
    assert torch.equal(shift, K.drift(old, new))
    assert torch.equal(new_sq, K.sq_norms(new))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, d", [(1, 3), (7, 5), (300, 2)])
def test_assign_one(emulator, dtype, k, d):
    x, c, _ = data(5, k, d, dtype)
    for point in x:
        label, dist = K.assign_one(point, c)
        ref_label, ref_dist = R.assign_one_reference(point, c)
        assert label.item() == ref_label.item()
        torch.testing.assert_close(dist, ref_dist, **TOL[dtype])


def test_assign_one_ties_go_to_lowest_index(emulator):
    c = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, -1.0], [1.0, 0.0]])
    label, dist = K.assign_one(torch.tensor([0.0, 0.0]), c)
    assert (label.item(), dist.item()) == (0, 1.0)
    label, _ = K.assign_one(torch.tensor([2.0, 0.0]), c)
    assert label.item() == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_pp_update(emulator, dtype):
    x, c, _ = data(45, 3, 7, dtype)
    start = torch.full((45,), math.inf, dtype=dtype)
    first = K.pp_update(x, c[0].contiguous(), start)
    torch.testing.assert_close(first, ((x - c[0]) ** 2).sum(1), **TOL[dtype])
    second = K.pp_update(x, c[1].contiguous(), first)
    torch.testing.assert_close(second, R.pp_update_reference(x, c[1], first), **TOL[dtype])
    assert torch.equal(start, torch.full((45,), math.inf, dtype=dtype))  # input untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_update_affected_moves_only_touched_clusters(emulator, dtype):
    x, c, labels = data(25, 5, 3, dtype)
    labels[labels == 4] = 0
    counts = torch.tensor([3, 0, 10, 1, 7], dtype=torch.int32)
    bsums, bcounts = K.accumulate(x, labels, 5)
    new, new_counts = K.update_affected(c, counts, bsums, bcounts)
    ref, ref_counts = R.update_affected_reference(c, counts, bsums, bcounts)
    torch.testing.assert_close(new, ref, **TOL[dtype])
    assert torch.equal(new_counts, ref_counts)
    assert torch.equal(new[4], c[4])  # untouched: bit for bit
    # A cluster that had no points becomes the mean of the batch's points.
    torch.testing.assert_close(new[1], x[labels == 1].mean(0), **TOL[dtype])


def test_empty_inputs_launch_nothing(emulator):
    with record() as launches:
        assert K.distances(torch.empty(0, 3), torch.randn(2, 3)).shape == (0, 2)
        labels, _ = K.assign_from_distances(torch.empty(0, 2))
        sums, counts = K.accumulate(torch.empty(0, 3), labels, 2, mode="deterministic")
    assert launches == []
    assert not bool(sums.any()) and counts.tolist() == [0, 0]


def test_one_lloyd_iteration_dispatches(emulator):
    x = blobs(20, BLOB_CENTERS)
    km = tsm.KMeans(4, init=torch.tensor(BLOB_CENTERS), max_iter=1)
    with record() as launches:
        km.fit(x)
    names = [l.kernel.rsplit("_", 1)[0] for l in launches]
    # The distances run on the project's GEMM (-2 x @ c.T + ||c||^2; 80 x 4 x 2 is a tiny
    # product, so the chooser picks the naive rung; c.T is a transposed view: variant "nt")
    # and kmeans_assign adds ||x||^2 as it scans: the GEMM replaced the old kmeans_distances
    # dispatch one for one. kmeans_drift also writes ||c||^2 of the new centroids, so only
    # the initial centroids need kmeans_sq_norms: 6 dispatches per iteration, was 7.
    gemm = "matmul_naive_nt"
    assert names == ["kmeans_sq_norms", "kmeans_sq_norms",         # ||x||^2, ||c0||^2: once
                     gemm, "kmeans_assign",
                     "kmeans_zero", "kmeans_accumulate_atomic",
                     "kmeans_finalize", "kmeans_drift",
                     gemm, "kmeans_assign"]  # final labels
    # Two iterations: the second adds exactly one iteration's six dispatches.
    km = tsm.KMeans(4, init=torch.tensor(BLOB_CENTERS) + 0.5, max_iter=2, tol=0.0)
    with record() as launches:
        km.fit(x)
    assert km.n_iter_ == 2
    names2 = [l.kernel.rsplit("_", 1)[0] for l in launches]
    assert names2 == names[:8] + names[2:8] + names[8:]


# ---------------------------------------------------------------------------------------
# Accumulate-mode choice


@pytest.mark.parametrize("metal3, requested, expected", [
    (True, "auto", "atomic"), (False, "auto", "cas"), (False, "cas", "cas"),
    (True, "cas", "cas"), (True, "deterministic", "deterministic")])
def test_metal_mode_follows_capabilities(monkeypatch, metal3, requested, expected):
    from torch_sparse_metal import _metal_backend
    monkeypatch.setattr(_metal_backend, "device_capabilities", lambda: {"supports_metal3": metal3})
    assert K.choose_accumulate_mode(requested, "metal", torch.float32) == expected


def test_metal_native_atomics_need_metal3(monkeypatch):
    from torch_sparse_metal import _metal_backend
    monkeypatch.setattr(_metal_backend, "device_capabilities", lambda: {"supports_metal3": False})
    with pytest.raises(ValueError, match="Metal 3"):
        K.choose_accumulate_mode("atomic", "metal", torch.float32)


def test_emulator_and_reference_modes():
    assert K.choose_accumulate_mode("auto", "emulator", torch.float64) == "atomic"
    assert K.choose_accumulate_mode("cas", "emulator", torch.float32) == "cas"
    assert K.choose_accumulate_mode("cas", "reference", torch.float64) == "deterministic"
    with pytest.raises(ValueError, match="accumulate mode"):
        K.choose_accumulate_mode("fast", "emulator", torch.float32)


# ---------------------------------------------------------------------------------------
# Estimator on the emulator (sanitized, small data)


@pytest.mark.parametrize("mode", ["atomic", "cas", "deterministic"])
@pytest.mark.parametrize("init", ["k-means++", "random"])
def test_fit_blobs_matches_reference_backend(emulator, mode, init):
    x = blobs(30, BLOB_CENTERS, seed=1)
    km = tsm.KMeans(4, init=init, seed=5, accumulate=mode).fit(x)
    with tsm.use_backend("reference"):
        ref = tsm.KMeans(4, init=init, seed=5).fit(x)
    torch.testing.assert_close(km.cluster_centers_, ref.cluster_centers_, rtol=1e-5, atol=1e-5)
    assert torch.equal(km.labels_, ref.labels_)
    assert km.n_iter_ == ref.n_iter_
    assert km.inertia_ == pytest.approx(ref.inertia_, rel=1e-5)
    # The blobs are found: each true centre has a centroid within the spread.
    found = torch.cdist(torch.tensor(BLOB_CENTERS), km.cluster_centers_).min(1).values
    assert bool((found < 0.3).all())


def test_fit_float64(emulator):
    x = blobs(20, BLOB_CENTERS, dtype=torch.float64)
    km = tsm.KMeans(4, seed=0).fit(x)
    assert km.cluster_centers_.dtype == torch.float64
    with tsm.use_backend("reference"):
        ref = tsm.KMeans(4, seed=0).fit(x)
    torch.testing.assert_close(km.cluster_centers_, ref.cluster_centers_, **TOL[torch.float64])


def test_sklearn_api(emulator):
    x = blobs(15, BLOB_CENTERS)
    km = tsm.KMeans(4, seed=2)
    assert km.fit(x) is km
    assert km.labels_.dtype == torch.int64 and km.labels_.shape == (60,)
    assert isinstance(km.inertia_, float) and isinstance(km.n_iter_, int)
    assert torch.equal(km.predict(x), km.labels_)
    assert torch.equal(tsm.KMeans(4, seed=2).fit_predict(x), km.labels_)
    dist = km.transform(x)
    assert dist.shape == (60, 4)
    torch.testing.assert_close(dist, torch.cdist(x, km.cluster_centers_), rtol=1e-4, atol=1e-3)
    assert km.score(x) == pytest.approx(-km.inertia_, rel=1e-5)
    # NumPy in, NumPy out.
    labels = km.predict(x.numpy())
    assert isinstance(labels, np.ndarray) and labels.dtype == np.int64
    np.testing.assert_array_equal(labels, km.labels_.numpy())


def test_inputs_are_never_modified(emulator):
    x = blobs(10, BLOB_CENTERS)
    init = torch.tensor(BLOB_CENTERS) + 0.5
    x_copy, init_copy = x.clone(), init.clone()
    km = tsm.KMeans(4, init=init).fit(x)
    km.partial_fit(x[:7])
    km.predict(x), km.transform(x), km.assign(x[0])
    assert torch.equal(x, x_copy) and torch.equal(init, init_copy)
    assert km.cluster_centers_.data_ptr() != init.data_ptr()


def test_verbose_prints_progress(emulator, capsys):
    x = blobs(10, BLOB_CENTERS)
    tsm.KMeans(4, seed=0, verbose=True).fit(x)
    lines = capsys.readouterr().out.strip().splitlines()
    iterations = [l for l in lines if "iteration" in l and "inertia" in l]
    assert iterations and iterations[0].startswith("KMeans: iteration 1/300, inertia ")
    assert "converged" in lines[-1]


def test_empty_cluster_is_reseeded_to_farthest_point(emulator):
    # Two identical initial centroids: ties go to the lower index, so cluster 1 starts
    # empty and must be re-seeded (never NaN) to the point farthest from its centroid.
    x = torch.tensor([[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [10.0, 10.0], [10.1, 10.0]])
    init = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    km = tsm.KMeans(2, init=init, max_iter=10).fit(x)
    assert bool(torch.isfinite(km.cluster_centers_).all())
    assert sorted(km.labels_.tolist()) == [0, 0, 0, 1, 1]
    assert km.labels_[3] == km.labels_[4] != km.labels_[0]
    # The fit ends at the k-means fixed point: each centroid the mean of its points.
    xd = x.double().numpy()
    lab = km.labels_.numpy()
    want = np.stack([xd[lab == j].mean(0) for j in range(2)])
    np.testing.assert_allclose(km.cluster_centers_.double().numpy(), want, rtol=1e-6, atol=1e-7)
    # A centroid far from all data: empty at once, re-seeded, everything finite.
    km = tsm.KMeans(3, init=torch.tensor([[0.0, 0.0], [10.0, 10.0], [1e4, 1e4]])).fit(x)
    assert bool(torch.isfinite(km.cluster_centers_).all())
    assert km.cluster_counts_.min() >= 1


def test_more_clusters_than_distinct_points(emulator):
    x = torch.tensor([[1.0, 1.0]] * 4 + [[2.0, 2.0]] * 4)
    km = tsm.KMeans(3, seed=0).fit(x)
    assert bool(torch.isfinite(km.cluster_centers_).all())
    assert km.inertia_ == 0.0


@pytest.mark.parametrize("bad, match", [
    (torch.randn(3, 2), "n_samples = 3 should be >= n_clusters = 4"),
    (torch.tensor([[0.0, 1.0]] * 5 + [[float("nan"), 0.0]]), "NaN or infinity"),
    (torch.tensor([[0.0, 1.0]] * 5 + [[float("inf"), 0.0]]), "NaN or infinity"),
    (torch.empty(0, 2), "empty"),
    (torch.empty(5, 0), "0 features"),
    (torch.randn(8), "2-D .*one sample"),
    (torch.randn(2, 4, 2), "2-D"),
])
def test_fit_rejects_bad_input(emulator, bad, match):
    with pytest.raises(ValueError, match=match):
        tsm.KMeans(4).fit(bad)


def test_bad_use_errors(emulator):
    km = tsm.KMeans(2)
    for method in (km.predict, km.transform, km.assign, km):
        with pytest.raises(NotFittedError, match="not fitted"):
            method(torch.randn(3, 2))
    with pytest.raises(ValueError, match="init has shape"):
        tsm.KMeans(2, init=torch.randn(3, 2)).fit(torch.randn(5, 2))
    km.fit(torch.randn(6, 2))
    with pytest.raises(ValueError, match="X has 3 features, but KMeans is expecting 2 features"):
        km.predict(torch.randn(4, 3))
    with pytest.raises(ValueError, match="one point"):
        km.assign(torch.randn(2, 2))
    with pytest.raises(ValueError, match="NaN"):
        km.predict(torch.tensor([[0.0, float("nan")]]))
    with tsm.use_backend("metal"), pytest.raises(ValueError, match="needs tensors on the 'mps'"):
        tsm.KMeans(2).fit(torch.randn(6, 2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_clusters=0), "n_clusters"), (dict(n_clusters=2.5), "n_clusters"),
    (dict(n_clusters=2, init="kmeans"), "init"), (dict(n_clusters=2, max_iter=0), "max_iter"),
    (dict(n_clusters=2, tol=-1.0), "tol"), (dict(n_clusters=2, n_init=0), "n_init"),
    (dict(n_clusters=2, accumulate="fast"), "accumulate"), (dict(n_clusters=2, seed=1.5), "seed"),
])
def test_constructor_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tsm.KMeans(**kwargs)


def test_state_dict_round_trip(emulator):
    x = blobs(10, BLOB_CENTERS)
    km = tsm.KMeans(4, seed=0).fit(x)
    state = km.state_dict()
    assert set(state) == {"cluster_centers_", "cluster_counts_"}
    fresh = tsm.KMeans(4)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.cluster_centers_, km.cluster_centers_)
    assert torch.equal(fresh.predict(x), km.labels_)
    assert fresh.assign(x[0]) == int(km.labels_[0])
    # .to() carries the buffers (dtype here: this machine has no MPS device).
    assert fresh.to(torch.float64) is fresh
    assert fresh.cluster_centers_.dtype == torch.float64
    assert torch.equal(fresh.predict(x.double()), km.labels_)
    with pytest.raises(RuntimeError, match="n_clusters is 3"):
        tsm.KMeans(3).load_state_dict(state)


def test_forward_is_a_quantizer_stage(emulator):
    x = blobs(10, BLOB_CENTERS)
    km = tsm.KMeans(4, seed=0).fit(x)
    model = nn.Sequential(nn.Identity(), km)
    out = model(x.reshape(5, 8, 2))
    assert out.shape == (5, 8) and out.dtype == torch.int64
    assert torch.equal(out.reshape(-1), km.labels_)


def test_assign_and_partial_fit(emulator):
    x = blobs(20, BLOB_CENTERS, seed=4)
    km = tsm.KMeans(4, seed=0).fit(x)
    for i in range(5):
        assert km.assign(x[i]) == int(km.labels_[i])
    before = km.cluster_centers_.clone()
    counts_before = km.cluster_counts_.clone()
    # A batch falling only near blob (5, 5): only that centroid moves.
    batch = torch.tensor([[5.5, 5.5], [5.4, 5.6]])
    target = km.assign(batch[0])
    km.partial_fit(batch)
    moved = (km.cluster_centers_ != before).any(1)
    assert moved.tolist() == [j == target for j in range(4)]
    expected = (before[target] * counts_before[target] + batch.sum(0)) / (counts_before[target] + 2)
    torch.testing.assert_close(km.cluster_centers_[target], expected)
    assert km.cluster_counts_[target] == counts_before[target] + 2


def test_partial_fit_from_scratch(emulator):
    x = blobs(25, BLOB_CENTERS, seed=6)
    km = tsm.KMeans(4, init=torch.tensor(BLOB_CENTERS))
    for batch in x.split(20):
        km.partial_fit(batch)
    assert int(km.cluster_counts_.sum()) == x.shape[0]
    found = torch.cdist(torch.tensor(BLOB_CENTERS), km.cluster_centers_).min(1).values
    assert bool((found < 0.3).all())
    with pytest.raises(ValueError, match="first batch"):
        tsm.KMeans(4).partial_fit(x[:3])


def test_deterministic_fit_is_bit_identical(unsanitized, emulator):
    x = blobs(150, BLOB_CENTERS + [[0.0, 9.0], [9.0, 0.0]], spread=2.0, seed=8)
    runs = [tsm.KMeans(6, seed=1, accumulate="deterministic").fit(x) for _ in range(3)]
    for r in runs[1:]:
        assert torch.equal(r.cluster_centers_, runs[0].cluster_centers_)
        assert torch.equal(r.labels_, runs[0].labels_)
        assert r.inertia_ == runs[0].inertia_


# ---------------------------------------------------------------------------------------
# Against scikit-learn on real data (scikit-learn's digits: 1797 x 64)


@pytest.fixture(scope="module")
def digits():
    datasets = pytest.importorskip("sklearn.datasets")
    return torch.from_numpy(datasets.load_digits().data.astype(np.float32))


@pytest.mark.parametrize("backend, mode", [("reference", "auto"),
                                           ("emulator", "deterministic")])
def test_digits_same_init_as_sklearn(unsanitized, digits, backend, mode):
    from sklearn.cluster import KMeans as SKKMeans
    init = digits[::180][:10].clone()
    sk = SKKMeans(10, init=init.numpy(), n_init=1).fit(digits.numpy())
    with tsm.use_backend(backend):
        km = tsm.KMeans(10, init=init, accumulate=mode).fit(digits)
    assert km.inertia_ <= 1.01 * sk.inertia_
    assert km.inertia_ == pytest.approx(sk.inertia_, rel=1e-4)
    assert (km.labels_.numpy() == sk.labels_).mean() > 0.99


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_digits_kmeans_plusplus_vs_sklearn(digits, seed):
    # Same number of inits (3) from k-means++ on both sides; plain torch backend (the same
    # algorithm as the kernels, as the next test checks) keeps this fast.
    from sklearn.cluster import KMeans as SKKMeans
    sk = SKKMeans(10, n_init=3, random_state=seed).fit(digits.numpy())
    with tsm.use_backend("reference"):
        km = tsm.KMeans(10, n_init=3, seed=seed).fit(digits)
    assert km.inertia_ <= 1.01 * sk.inertia_


def test_digits_kmeans_plusplus_kernels_match_reference(unsanitized, digits):
    x = digits[:600].contiguous()
    with tsm.use_backend("emulator"):
        km = tsm.KMeans(10, seed=0, accumulate="cas").fit(x)
    with tsm.use_backend("reference"):
        ref = tsm.KMeans(10, seed=0).fit(x)
    assert km.inertia_ == pytest.approx(ref.inertia_, rel=1e-5)
    assert km.n_iter_ == ref.n_iter_


# ---------------------------------------------------------------------------------------
# Argument checks of the public ops (the kernels trust the sizes they are given)


def _f(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _i(*shape, dtype=torch.int32):
    return torch.zeros(*shape, dtype=dtype)


BAD_OP_CALLS = [
    # features differ: the distance kernel would read past centroids' rows
    ("distances", lambda: K.distances(_f(4, 5), _f(2, 3)), r"kmeans\.distances: x has 5 features but centroids has 3"),
    ("distances", lambda: K.distances(_f(4, 3), _f(2, 3), x_sq=_f(3)), r"kmeans\.distances: x_sq has 3 elements but the number of points is 4"),
    ("distances", lambda: K.distances(_f(4, 3), _f(2, 3), c_sq=_f(5)), r"kmeans\.distances: c_sq has 5 elements but the number of centroids is 2"),
    ("distances", lambda: K.distances(_f(4, 3), _f(2, 3, dtype=torch.float64)), r"kmeans\.distances: centroids has dtype torch\.float64 but x has dtype torch\.float32"),
    ("distances", lambda: K.distances(_f(4, 3, 1), _f(2, 3)), r"kmeans\.distances: x must be 2-D"),
    ("distances", lambda: K.distances(_f(4, 3), _f(3)), r"kmeans\.distances: centroids must be 2-D"),
    ("assign", lambda: K.assign(_f(4, 5), _f(2, 3)), r"kmeans\.assign: x has 5 features but centroids has 3"),
    # one point with 7 features against 3-feature centroids: silently used 3 of them
    ("assign_one", lambda: K.assign_one(_f(7), _f(2, 3)), r"kmeans\.assign_one: point has 7 features but centroids has 3"),
    ("assign_one", lambda: K.assign_one(_f(1, 3), _f(2, 3)), r"kmeans\.assign_one: point must be 1-D"),
    ("pp_update", lambda: K.pp_update(_f(4, 3), _f(5), _f(4)), r"kmeans\.pp_update: chosen has 5 features but x has 3"),
    ("pp_update", lambda: K.pp_update(_f(4, 3), _f(3), _f(2)), r"kmeans\.pp_update: min_dist has 2 elements but the number of points is 4"),
    ("accumulate", lambda: K.accumulate(_f(4, 3), _i(3), 2), r"kmeans\.accumulate: labels has 3 elements but the number of points is 4"),
    ("accumulate", lambda: K.accumulate(_f(4, 3), _f(4), 2), r"kmeans\.accumulate: labels must be an int32 tensor"),
    ("accumulate", lambda: K.accumulate(_f(4, 3), _i(4), -1), r"kmeans\.accumulate: k must be an int >= 0"),
    ("finalize", lambda: K.finalize(_f(2, 3), _i(2), _f(2, 4)), r"kmeans\.finalize: sums has 3 features but old_centroids has 4"),
    ("finalize", lambda: K.finalize(_f(3, 3), _i(3), _f(2, 3)), r"kmeans\.finalize: sums has 3 rows but old_centroids has 2"),
    ("finalize", lambda: K.finalize(_f(2, 3), _i(3), _f(2, 3)), r"kmeans\.finalize: counts has 3 elements but the number of centroids is 2"),
    ("drift", lambda: K.drift(_f(2, 3), _f(2, 4)), r"kmeans\.drift: new has 4 features but old has 3"),
    ("drift", lambda: K.drift(_f(2, 3), _f(3, 3)), r"kmeans\.drift: new has 3 rows but old has 2"),
    ("update_affected", lambda: K.update_affected(_f(2, 3), _i(2), _f(2, 4), _i(2)), r"kmeans\.update_affected: batch_sums has 4 features but centroids has 3"),
    ("update_affected", lambda: K.update_affected(_f(2, 3), _i(2), _f(2, 3), _i(5)), r"kmeans\.update_affected: batch_counts has 5 elements but the number of centroids is 2"),
    ("sq_norms", lambda: K.sq_norms(_f(4)), r"kmeans\.sq_norms: rows must be 2-D"),
    ("assign_from_distances", lambda: K.assign_from_distances(_f(4)), r"kmeans\.assign_from_distances: dist must be 2-D"),
]


@pytest.mark.parametrize("backend", ["emulator", "reference"])
@pytest.mark.parametrize("op, call, match", BAD_OP_CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_OP_CALLS)])
def test_ops_check_shapes_dtypes_before_running(backend, op, call, match):
    with tsm.use_backend(backend), record() as launches:
        with pytest.raises(ValueError, match=match):
            call()
    assert launches == []


def test_kernels_need_int32_counts(emulator):
    with pytest.raises(ValueError, match=r"kmeans\.finalize: counts must be int32 for backend 'emulator'"):
        K.finalize(_f(2, 3), _i(2, dtype=torch.int64), _f(2, 3))
    with pytest.raises(ValueError, match=r"kmeans\.update_affected: counts must be int32"):
        K.update_affected(_f(2, 3), _i(2, dtype=torch.int64), _f(2, 3), _i(2))
    with pytest.raises(ValueError, match=r"kmeans\.accumulate: labels must be int32"):
        K.accumulate(_f(4, 3), _i(4, dtype=torch.int64), 2)
    # The reference backend takes any integer labels and counts.
    with tsm.use_backend("reference"):
        K.finalize(_f(2, 3), _i(2, dtype=torch.int64), _f(2, 3))


def test_ops_checks_accept_the_documented_shapes(emulator):
    x, c, labels = data(9, 3, 4)
    K.distances(x, c, x_sq=K.sq_norms(x), c_sq=K.sq_norms(c))
    K.assign_one(x[0].contiguous(), c)
    K.pp_update(x, c[0].contiguous(), torch.full((9,), math.inf))
    sums, counts = K.accumulate(x, labels, 3)
    K.drift(c, K.finalize(sums, counts, c))
    K.update_affected(c, counts, sums, counts)
    # Empty inputs are still fine: 0 points, 0 features.
    K.distances(x[:0], c)
    K.assign(torch.empty(3, 0), torch.empty(2, 0))


# ---------------------------------------------------------------------------------------
# Estimator internals


def test_comm_results_are_new_tensors():
    # _relocate_empty edits the summed sums / counts in place: with one process the "sum"
    # must still be a copy, or it would write into whatever tensor the caller passed.
    from torch_sparse_metal.cluster.kmeans import _Comm
    comm = _Comm(False)
    t = torch.arange(4.0)
    for reduce in (comm.sum, comm.max):
        out = reduce(t)
        assert out is not t and out.data_ptr() != t.data_ptr()
        assert torch.equal(out, t)
        out += 1
        assert torch.equal(t, torch.arange(4.0))
    local = torch.arange(6.0).reshape(3, 2)
    fetched = comm.fetch(local, torch.tensor([1]), 0)
    fetched.zero_()
    assert torch.equal(local, torch.arange(6.0).reshape(3, 2))


def test_relocate_empty_leaves_the_accumulated_tensors_alone(emulator, monkeypatch):
    # The fit passes accumulate's results through comm.sum, then relocation edits the
    # copies: accumulate's own outputs stay as they were.
    seen = []
    real = K.accumulate

    def spy(*args, **kwargs):
        sums, counts = real(*args, **kwargs)
        seen.append((sums, sums.clone(), counts, counts.clone()))
        return sums, counts

    monkeypatch.setattr(K, "accumulate", spy)
    x = torch.tensor([[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [10.0, 10.0], [10.1, 10.0]])
    tsm.KMeans(3, init=torch.tensor([[0.0, 0.0], [10.0, 10.0], [1e4, 1e4]])).fit(x)
    assert seen and int((seen[0][3] == 0).sum()) == 1  # the first iteration had an empty cluster
    for sums, sums0, counts, counts0 in seen:
        assert torch.equal(sums, sums0) and torch.equal(counts, counts0)


def test_numpy_inputs_in_any_byte_order(emulator):
    x = blobs(10, BLOB_CENTERS)
    km = tsm.KMeans(4, seed=0).fit(x)
    swapped = x.numpy().astype(">f4")  # big-endian: torch.from_numpy refuses it as is
    np.testing.assert_array_equal(km.predict(swapped), km.labels_.numpy())
    assert km.assign(swapped[3]) == int(km.labels_[3])
    assert torch.equal(tsm.KMeans(4, seed=0).fit(swapped).cluster_centers_, km.cluster_centers_)
    strided = x.numpy()[:, ::-1][:, ::-1]
    np.testing.assert_array_equal(km.predict(strided), km.labels_.numpy())


@pytest.mark.parametrize("method", ["fit", "predict", "assign", "partial_fit"])
def test_unconvertible_numpy_input_names_the_method(emulator, method):
    km = tsm.KMeans(2, seed=0).fit(torch.randn(6, 2))
    # Numbers held as objects convert (as in scikit-learn); other objects do not.
    bad = np.array([[1.0, {}]], dtype=object)
    with pytest.raises(TypeError, match=rf"KMeans\.{method}: cannot convert a NumPy array of dtype object"):
        getattr(km, method)(bad[0] if method == "assign" else bad)
    with pytest.raises(TypeError, match=rf"KMeans\.{method}: cannot convert a list of dtype <U1"):
        getattr(km, method)(["a", "b"] if method == "assign" else [["a", "b"]])
    with pytest.raises(TypeError, match=rf"KMeans\.{method}: sparse input is not supported"):
        getattr(km, method)(scipy.sparse.csr_array(np.ones((1 if method == "assign" else 6, 2))))


# Every limit of the kernels is checked before any work: a fit that cannot finish fails
# before seeding (which took 436 s for n_clusters=4200 when the limit was found only by
# the first accumulation).
@pytest.mark.parametrize("k, dtype", [(4200, torch.float32), (2800, torch.float64)])
@pytest.mark.parametrize("method", ["fit", "partial_fit"])
def test_too_many_clusters_fail_before_any_kernel_runs(emulator, k, dtype, method):
    x = torch.randn(k + 10, 2, dtype=dtype)
    km = tsm.KMeans(k, n_init=1, max_iter=1, seed=0)
    with tsm.record() as launches, pytest.raises(
            ValueError, match=rf"^KMeans\.{method}: n_clusters = {k} is too many for the kernels' "
                              r"threadgroup partial sums \(32 KB\); use backend 'reference'$"):
        getattr(km, method)(x)
    assert launches == [] and km.cluster_centers_ is None


def test_too_many_clusters_for_a_fitted_model_fail_before_any_kernel_runs(emulator):
    km = tsm.KMeans(4200)
    km.load_state_dict({"cluster_centers_": torch.randn(4200, 2)})
    with tsm.record() as launches, pytest.raises(ValueError, match="^KMeans.partial_fit: "
                                                                        "n_clusters = 4200"):
        km.partial_fit(torch.randn(8, 2))
    assert launches == []


def test_the_largest_cluster_count_that_fits_does_fit():
    from torch_sparse_metal.ops import kmeans as K
    K.check_fit_limits("KMeans.fit", 5000, 4096, 2, torch.float32, "emulator")
    K.check_fit_limits("KMeans.fit", 5000, 2730, 2, torch.float64, "emulator")
    K.check_fit_limits("KMeans.fit", 5000, 10**6, 2, torch.float64, "reference")
    with pytest.raises(ValueError, match="n_clusters = 4097 is too many"):
        K.check_fit_limits("KMeans.fit", 5000, 4097, 2, torch.float32, "emulator")
    with pytest.raises(ValueError, match=r"^KMeans.fit: n \* k is 4294967296, past the 32-bit"):
        K.check_fit_limits("KMeans.fit", 2**22, 2**10, 1, torch.float32, "emulator")


def test_auto_accumulation_follows_torch_deterministic_mode(emulator):
    x, labels = torch.randn(64, 3), torch.randint(0, 4, (64,), dtype=torch.int32)

    def accumulate_kernels():
        with tsm.record() as launches:
            K.accumulate(x, labels, 4, mode="auto")
        return {l.kernel.rsplit("_", 1)[0] for l in launches}

    assert "kmeans_accumulate_atomic" in accumulate_kernels()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert accumulate_kernels() == {"kmeans_accumulate_blocks", "kmeans_reduce_blocks"}
        assert K.choose_accumulate_mode("atomic", "emulator", torch.float32) == "atomic"
    finally:
        torch.use_deterministic_algorithms(previous)
