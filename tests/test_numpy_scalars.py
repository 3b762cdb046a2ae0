"""NumPy scalars are numbers: every public argument that takes an int or a float takes the
NumPy kinds too (and stores a Python int / float), while bools, strings and fractional
values for integers are rejected with a message that names the argument and the value."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.nn import SparseLinear, prune_and_regrow
from torch_sparse_metal.ops import kmeans as K
from torch_sparse_metal.ops.sparse_linear import CSRPattern


@pytest.fixture
def emulator():
    with tsm.use_backend("emulator"):
        yield


INTS = [np.int64(3), np.int32(3), np.uint8(3), np.int16(3)]
FLOATS = [np.float32(1e-4), np.float64(1e-4), np.float16(1e-4)]


@pytest.mark.parametrize("n", INTS)
@pytest.mark.parametrize("tol", FLOATS)
def test_kmeans_takes_numpy_ints_and_floats(emulator, n, tol):
    km = tsm.KMeans(n_clusters=n, n_init=n, max_iter=n, tol=tol, seed=n)
    for name in ("n_clusters", "n_init", "max_iter", "seed"):
        value = getattr(km, name)
        assert type(value) is int and value == 3, name
    assert type(km.tol) is float and km.tol == float(tol)
    km.fit(torch.randn(20, 2))
    assert km.cluster_centers_.shape == (3, 2) and km.n_iter_ <= 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_clusters=True), r"n_clusters must be an int >= 1, got True"),
    (dict(n_clusters=np.float64(3.0)), r"n_clusters must be an int >= 1, got np\.float64\(3\.0\)"),
    (dict(n_clusters=np.int64(0)), r"n_clusters must be an int >= 1, got np\.int64\(0\)"),
    (dict(n_clusters=2, tol=True), r"tol must be a number >= 0, got True"),
    (dict(n_clusters=2, tol=np.float32(-1)), r"tol must be a number >= 0, got np\.float32\(-1\.0\)"),
    (dict(n_clusters=2, tol=float("nan")), r"tol must be a number >= 0, got nan"),
    (dict(n_clusters=2, tol="1e-4"), r"tol must be a number >= 0, got '1e-4'"),
    (dict(n_clusters=2, seed=np.bool_(True)), r"seed must be an int, got np\.True_"),
    (dict(n_clusters=2, max_iter=np.int8(-1)), r"max_iter must be an int >= 1, got np\.int8\(-1\)"),
])
def test_kmeans_rejects_what_is_not_the_number_it_wants(kwargs, match):
    with pytest.raises(ValueError, match="^KMeans: " + match + "$"):
        tsm.KMeans(**kwargs)


def test_sparse_linear_module_takes_numpy_sizes_and_density(emulator):
    layer = SparseLinear(np.int64(4), np.int32(3), density=np.float32(0.5))
    assert type(layer.in_features) is int and type(layer.out_features) is int
    assert (layer.in_features, layer.out_features, layer.nnz) == (4, 3, 6)
    assert layer(torch.randn(2, 4)).shape == (2, 3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(in_features=4.0, out_features=3, density=0.5), "in_features must be an int >= 0, got 4.0"),
    (dict(in_features=4, out_features=True, density=0.5), "out_features must be an int >= 0, got True"),
    (dict(in_features=np.int64(-1), out_features=3, density=0.5),
     r"in_features must be an int >= 0, got np\.int64\(-1\)"),
    (dict(in_features=4, out_features=3, density=np.float32(1.5)),
     r"density must lie in \[0, 1\], got np\.float32\(1\.5\)"),
    (dict(in_features=4, out_features=3, density="0.5"), r"density must lie in \[0, 1\], got '0\.5'"),
])
def test_sparse_linear_module_rejects_non_numbers(kwargs, match):
    with pytest.raises(ValueError, match="^SparseLinear: " + match + "$"):
        SparseLinear(**kwargs)


def test_csr_pattern_in_features(emulator):
    indptr, indices = torch.tensor([0, 1, 2]), torch.tensor([0, 2])
    assert CSRPattern(indptr, indices, np.int64(3)).in_features == 3
    with pytest.raises(ValueError, match=r"^sparse_linear: in_features must be an int >= 0, got 3\.7$"):
        CSRPattern(indptr, indices, 3.7)  # was silently truncated to 3


def test_prune_and_regrow_fraction(emulator):
    layer = SparseLinear(8, 8, density=0.25, generator=torch.Generator().manual_seed(0))
    assert prune_and_regrow(layer, np.float32(0.25), "magnitude") == 4
    with pytest.raises(ValueError, match=r"fraction must lie in \[0, 1\], got True"):
        prune_and_regrow(layer, True, "magnitude")


def test_kmeans_accumulate_k(emulator):
    sums, counts = K.accumulate(torch.ones(4, 2), torch.zeros(4, dtype=torch.int32), np.int64(2))
    assert counts.tolist() == [4, 0] and sums[0].tolist() == [4.0, 4.0]
