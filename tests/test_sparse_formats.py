"""The sparse formats users hold: torch CSR / COO weights in ``sparse_linear``,
``SparseLinear.from_dense`` (magnitude pruning), ``from_sparse`` (torch or SciPy),
``to_sparse_csr`` / ``to_dense`` back, and state dicts across all of them."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.formats import to_scipy
from torch_sparse_metal.nn import SparseLinear


@pytest.fixture
def emulator():
    with tsm.use_backend("emulator"):
        yield


def trained_linear(in_f=10, out_f=6, seed=0):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_f, out_f).double()
    with torch.no_grad():
        linear.weight.mul_(torch.linspace(0.5, 2.0, in_f, dtype=torch.float64))  # distinct |w|
    return linear


# ---- sparse_linear with a torch sparse weight ------------------------------------------
@pytest.mark.parametrize("layout", ["csr", "coo"])
def test_functional_takes_a_sparse_weight_and_gives_it_a_sparse_gradient(emulator, layout):
    dense = torch.randn(5, 7, dtype=torch.float64) * (torch.rand(5, 7) < 0.4)
    weight = (dense.to_sparse_csr() if layout == "csr" else dense.to_sparse_coo())
    weight.requires_grad_()
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    y = tsm.sparse_linear(x, weight, bias, activation="tanh")
    ref_w = dense.clone().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    ref = torch.tanh(ref_x @ ref_w.T + bias.detach())
    torch.testing.assert_close(y, ref)
    grad = torch.randn(3, 5, dtype=torch.float64)
    y.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad)
    assert weight.grad.layout == weight.layout
    mask = dense != 0
    torch.testing.assert_close(weight.grad.to_dense(), ref_w.grad * mask)


def test_functional_sparse_weight_errors(emulator):
    weight = torch.eye(3, dtype=torch.float64).to_sparse_csr()
    with pytest.raises(ValueError, match=r"^sparse_linear: input has 4 features .* the weight "
                                         r"is \(3, 3\)"):
        tsm.sparse_linear(torch.randn(2, 4, dtype=torch.float64), weight)
    with pytest.raises(TypeError, match=r"^sparse_linear: with a sparse weight the call is "
                                        r"sparse_linear\(input, weight, bias=None\)"):
        tsm.sparse_linear(torch.randn(2, 3), weight, None, torch.randn(3))
    with pytest.raises(TypeError, match=r"^sparse_linear: expected \(input, indptr, indices, "
                                        r"values, bias=None\) or \(input, weight, bias=None\)"):
        tsm.sparse_linear(torch.randn(2, 3), torch.eye(3))


# ---- from_dense ---------------------------------------------------------------------------
def test_from_dense_keeps_the_largest_magnitudes(emulator):
    linear = trained_linear()
    layer = SparseLinear.from_dense(linear, density=0.25, activation="relu")
    k = round(0.25 * 60)
    assert layer.nnz == k and layer.weight.dtype == torch.float64
    kept = layer.to_dense() != 0
    threshold = linear.weight.abs().flatten().sort(descending=True).values[k - 1]
    assert torch.equal(kept, linear.weight.abs() >= threshold)
    torch.testing.assert_close(layer.to_dense(), linear.weight.detach() * kept)
    x = torch.randn(4, 10, dtype=torch.float64)
    torch.testing.assert_close(layer(x), torch.relu(x @ layer.to_dense().T + linear.bias))
    assert SparseLinear.from_dense(linear, density=1.0).nnz == 60
    assert SparseLinear.from_dense(linear, density=0.0).nnz == 0


def test_from_dense_with_a_mask_and_ties():
    weight = torch.ones(3, 4)  # every magnitude ties: the lower row-major positions win
    assert SparseLinear.from_dense(weight, density=0.5).to_dense().flatten().tolist() == \
        [1.0] * 6 + [0.0] * 6
    mask = torch.tensor([[True, False, False, True]] * 3)
    layer = SparseLinear.from_dense(weight * 3, mask=mask)
    assert layer.bias is None and layer.nnz == 6
    assert torch.equal(layer.to_dense(), (weight * 3) * mask)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(), ValueError, "give exactly one of density or mask"),
    (dict(density=0.5, mask=torch.ones(6, 10, dtype=torch.bool)), ValueError, "exactly one"),
    (dict(density=1.5), ValueError, r"density must lie in \[0, 1\]"),
    (dict(mask=torch.ones(6, 10)), ValueError, r"mask must be a bool tensor of shape "
                                               r"\(out_features, in_features\) = \(6, 10\), got "
                                               r"a torch.float32 tensor"),
    (dict(mask=torch.ones(10, 6, dtype=torch.bool)), ValueError, r"shape \(10, 6\)"),
])
def test_from_dense_errors(kwargs, error, match):
    with pytest.raises(error, match="^SparseLinear.from_dense: .*" + match):
        SparseLinear.from_dense(trained_linear(), **kwargs)
    with pytest.raises(TypeError, match="expected an nn.Linear or a dense 2-D weight"):
        SparseLinear.from_dense(torch.randn(3), density=0.5)


# ---- to_sparse_csr, from_sparse ------------------------------------------------------------
def test_to_sparse_csr_is_canonical_and_differentiable():
    indptr = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    indices = torch.tensor([2, 0, 2, 1, 0], dtype=torch.int32)  # unsorted, a duplicate
    layer = SparseLinear(4, 3, indptr=indptr, indices=indices, dtype=torch.float64)
    csr = layer.to_sparse_csr()
    assert csr.layout == torch.sparse_csr and csr.crow_indices().dtype == torch.int64
    assert csr.col_indices().tolist() == [0, 2, 0, 1]  # sorted, the duplicate summed
    torch.testing.assert_close(csr.to_dense(), layer.to_dense())
    csr.to_dense().sum().backward()
    assert layer.weight.grad.tolist() == [1.0] * 5


def test_from_sparse_takes_torch_and_scipy_formats(emulator):
    dense = torch.randn(5, 8, dtype=torch.float64) * (torch.rand(5, 8) < 0.5)
    bias = np.arange(5.0)
    for weight in (dense.to_sparse_csr(), dense.to_sparse_coo(),
                   scipy.sparse.csr_array(dense.numpy()), scipy.sparse.coo_matrix(dense.numpy()),
                   scipy.sparse.csc_matrix(dense.numpy())):
        layer = SparseLinear.from_sparse(weight, bias, activation="gelu")
        assert (layer.out_features, layer.in_features) == (5, 8)
        assert layer.weight.dtype == torch.float64
        torch.testing.assert_close(layer.to_dense(), dense)
        x = torch.randn(3, 8, dtype=torch.float64)
        torch.testing.assert_close(layer(x), torch.nn.functional.gelu(
            x @ dense.T + torch.from_numpy(bias), approximate="tanh"))
    # A SciPy CSR matrix's duplicates stay separate edges and add up; dtype can be chosen.
    with_duplicates = scipy.sparse.csr_matrix(([1.0, 2.0, 4.0], [1, 1, 0], [0, 2, 3]),
                                              shape=(2, 3))
    layer = SparseLinear.from_sparse(with_duplicates, dtype=torch.float32)
    assert layer.nnz == 3 and layer.bias is None and layer.weight.dtype == torch.float32
    assert layer.to_dense().tolist() == [[0.0, 3.0, 0.0], [4.0, 0.0, 0.0]]


def test_from_sparse_errors():
    weight = torch.eye(3).to_sparse_csr()
    with pytest.raises(ValueError, match=r"^SparseLinear.from_sparse: bias has shape \(2,\), "
                                         r"expected \(out_features,\) = \(3,\)"):
        SparseLinear.from_sparse(weight, torch.zeros(2))
    with pytest.raises(TypeError, match="^SparseLinear.from_sparse: expected a torch sparse"):
        SparseLinear.from_sparse(torch.eye(3).numpy())


# ---- the round trip -----------------------------------------------------------------------
def test_round_trip_linear_sparse_layer_torch_csr_scipy_sparse_layer(emulator):
    linear = trained_linear(12, 7)
    first = SparseLinear.from_dense(linear, density=0.3)
    csr = first.to_sparse_csr()
    matrix = to_scipy(csr)
    assert isinstance(matrix, scipy.sparse.csr_array) and matrix.nnz == first.nnz
    np.testing.assert_array_equal(matrix.toarray(), first.to_dense().detach().numpy())
    second = SparseLinear.from_sparse(matrix, linear.bias.detach())
    for name in ("indptr", "indices", "weight", "bias"):
        assert torch.equal(getattr(second, name), getattr(first, name)), name
    x = torch.randn(5, 12, dtype=torch.float64)
    torch.testing.assert_close(second(x), first(x), rtol=0, atol=0)
    # State dicts load across every way of building a layer, whatever their nnz.
    random_layer = SparseLinear(12, 7, density=0.8, dtype=torch.float64)
    random_layer.load_state_dict(second.state_dict())
    torch.testing.assert_close(random_layer(x), first(x), rtol=0, atol=0)
    first.load_state_dict(SparseLinear.from_dense(linear, density=0.9).state_dict())
    assert first.nnz == round(0.9 * 84)
    torch.testing.assert_close(first(x), torch.nn.functional.linear(x, first.to_dense(),
                                                                    linear.bias))


def test_to_scipy_refuses_what_is_not_a_torch_sparse_tensor():
    with pytest.raises(TypeError, match="^to_scipy: expected a torch sparse CSR or COO tensor"):
        to_scipy(scipy.sparse.eye(3))
