"""``tsm.KMeans`` keeps scikit-learn's habits: its estimator checks pass (but for the ones
listed below, with the reason), ``get_params`` / ``set_params`` / ``clone``,
``n_features_in_``, ``sample_weight``, and NumPy out when NumPy came in."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.cluster import KMeans as SKKMeans
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import check_estimator

import torch_sparse_metal as tsm

# The checks of sklearn.utils.estimator_checks that do not apply, and why.
NOT_APPLICABLE = {
    "check_no_attributes_set_in_init":
        "KMeans is an nn.Module, whose constructor sets the public attribute `training`; "
        "the check allows only constructor arguments and private names",
    "check_do_not_raise_errors_in_init_or_set_params":
        "the project's rule (docs/errors-and-determinism.md): a bad argument raises at once, before any "
        "work; set_params checks like the constructor and changes nothing when it raises",
    "check_sample_weight_equivalence_on_dense_data":
        "k-means++ seeding depends on the order of the samples, which the check shuffles "
        "between the weighted and the repeated data, so the fits start from different "
        "centroids; scikit-learn lists its own KMeans as an expected failure of it",
}
# Skipped by scikit-learn itself on this machine (not failures): pandas is not installed,
# SCIPY_ARRAY_API is not set.
SKIPPED = {"check_sample_weights_pandas_series", "check_array_api_input"}


# Expected advice from the checks: KMeans implements the estimator protocol itself (it is
# an nn.Module, not a BaseEstimator) and validates in set_params (see NOT_APPLICABLE).
@pytest.mark.filterwarnings("ignore:Estimator KMeans does not inherit:UserWarning",
                            "ignore:.*occurred during set_params:UserWarning",
                            "ignore::sklearn.exceptions.SkipTestWarning")
@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_estimator_checks(backend):
    with tsm.use_backend(backend):
        results = check_estimator(tsm.KMeans(3, seed=0), on_fail=None)
    status = {}
    for r in results:  # some checks run twice (with and without a read-only memmap)
        if status.get(r["check_name"]) != "failed":
            status[r["check_name"]] = r["status"]
    failed = {r["check_name"]: r["exception"] for r in results if r["status"] == "failed"}
    assert set(failed) == set(NOT_APPLICABLE), failed
    assert {name for name, s in status.items() if s == "skipped"} <= SKIPPED
    assert sum(s == "passed" for s in status.values()) >= 45


def blobs(seed=0, n=20):
    g = torch.Generator().manual_seed(seed)
    centers = torch.tensor([[0.0, 0.0], [6.0, 0.0], [0.0, 6.0]], dtype=torch.float64)
    return (centers.repeat_interleave(n, 0)
            + torch.randn(3 * n, 2, generator=g, dtype=torch.float64) * 0.5)


def test_params_clone_and_set_params():
    km = tsm.KMeans(3, init="random", n_init=2, seed=np.int64(5), tol=np.float32(1e-3))
    params = km.get_params()
    assert params == dict(n_clusters=3, init="random", n_init=2, max_iter=300,
                          tol=pytest.approx(1e-3), seed=5, verbose=False, accumulate="auto")
    twin = clone(km)
    assert twin is not km and twin.get_params() == params
    assert km.set_params(n_clusters=4, accumulate="deterministic") is km
    assert (km.n_clusters, km.accumulate) == (4, "deterministic")
    for bad in (dict(n_clusters=0), dict(max_iter=2, tol=-1.0), dict(verbose=-np.inf)):
        with pytest.raises(ValueError, match="^KMeans: "):
            km.set_params(**bad)
        assert km.get_params()["n_clusters"] == 4 and km.max_iter == 300  # nothing changed
    with pytest.raises(ValueError, match=r"^KMeans.set_params: invalid parameter\(s\) "
                                         r"\['random_state'\]"):
        km.set_params(random_state=0)


def test_arrays_in_arrays_out_tensors_in_tensors_out():
    x = blobs()
    km = tsm.KMeans(3, seed=0)
    labels = km.fit_predict(x.numpy())
    assert isinstance(labels, np.ndarray) and labels.dtype == np.int64
    assert isinstance(km.labels_, np.ndarray)
    assert isinstance(km.cluster_centers_, torch.Tensor)  # a buffer: .to(), state_dict
    assert isinstance(km.transform(x.numpy()), np.ndarray)
    np.testing.assert_array_equal(km.predict(x.tolist()), labels)  # any array-like
    assert isinstance(km.fit_transform(x), torch.Tensor)
    assert isinstance(km.labels_, torch.Tensor) and isinstance(km.predict(x), torch.Tensor)
    np.testing.assert_array_equal(km.labels_.numpy(), labels)


def test_n_features_in_follows_the_centroids():
    km = tsm.KMeans(3, seed=0)
    assert not hasattr(km, "n_features_in_")
    assert km.fit(blobs()).n_features_in_ == 2
    fresh = tsm.KMeans(3)
    fresh.load_state_dict(km.state_dict())
    assert fresh.n_features_in_ == 2


@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_integer_weights_are_repeated_points(backend):
    """With the same initial centroids, weight w is w copies of a point: the same
    centroids and inertia, as scikit-learn's weighted fit."""
    x = blobs(1)
    w = torch.randint(0, 4, (x.shape[0],), generator=torch.Generator().manual_seed(2))
    init = x[[0, 20, 40]].clone()
    with tsm.use_backend(backend):
        weighted = tsm.KMeans(3, init=init).fit(x, sample_weight=w)
        repeated = tsm.KMeans(3, init=init).fit(x.repeat_interleave(w, 0))
        score = weighted.score(x, sample_weight=w)
    torch.testing.assert_close(weighted.cluster_centers_, repeated.cluster_centers_)
    assert weighted.inertia_ == pytest.approx(repeated.inertia_, rel=1e-9)
    assert score == pytest.approx(-weighted.inertia_, rel=1e-9)
    sk = SKKMeans(3, init=init.numpy(), n_init=1).fit(x.numpy(), sample_weight=w.numpy())
    np.testing.assert_allclose(weighted.cluster_centers_.numpy(), sk.cluster_centers_,
                               rtol=1e-9)
    assert weighted.inertia_ == pytest.approx(sk.inertia_, rel=1e-9)


@pytest.mark.parametrize("init", ["k-means++", "random"])
@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_points_of_weight_zero_are_never_seeds(init, backend):
    """Far points of weight 0: no centroid is seeded on them, and none moves to them."""
    x = torch.cat([blobs(3), torch.full((60, 2), 1000.0, dtype=torch.float64)])
    w = torch.cat([torch.ones(60), torch.zeros(60)])
    for seed in range(4):
        with tsm.use_backend(backend):
            km = tsm.KMeans(3, init=init, seed=seed).fit(x, sample_weight=w.numpy())
        assert bool((km.cluster_centers_.abs() < 20).all()), km.cluster_centers_


@pytest.mark.parametrize("weights, match", [
    (np.ones(5), r"sample_weight must have shape \(n_samples,\) = \(60,\), got \(5,\)"),
    (-np.ones(60), "sample_weight must be non-negative"),
    (np.full(60, np.nan), "sample_weight contains NaN or infinity"),
    (np.zeros(60), "every sample weight is zero"),
    (np.r_[np.ones(2), np.zeros(58)], r"sample_weight has 2 positive weight\(s\); it needs at "
                                      "least n_clusters = 3"),
])
def test_bad_sample_weights(weights, match):
    with pytest.raises(ValueError, match="^KMeans.fit: " + match):
        tsm.KMeans(3, seed=0).fit(blobs(), sample_weight=weights)


def test_pipelines_and_grid_search():
    x = blobs().numpy()
    pipe = make_pipeline(StandardScaler(), tsm.KMeans(3, seed=0)).fit(x)
    assert pipe.predict(x).shape == (60,)
    search = GridSearchCV(tsm.KMeans(seed=0), {"n_clusters": [2, 3]}, cv=3).fit(x)
    assert search.best_params_ == {"n_clusters": 3}


def test_not_fitted_error_is_also_sklearns():
    from sklearn.exceptions import NotFittedError as SKNotFittedError
    with pytest.raises(SKNotFittedError):
        tsm.KMeans(2).predict(np.ones((3, 2)))
    with pytest.raises(tsm.cluster.NotFittedError):
        tsm.KMeans(2).transform(np.ones((3, 2)))
