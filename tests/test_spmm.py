"""``tsm.spmm``: sparse (CSR, COO, SciPy) @ dense on the sparse layer's kernels, against
SciPy and torch.sparse.mm, with gradients on both sides (gradcheck through the kernels)."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
import torch

import torch_sparse_metal as tsm


@pytest.fixture
def emulator():
    with tsm.use_backend("emulator"):
        yield


def random_sparse(m, k, density, seed=0, dtype=torch.float64):
    """A SciPy CSR matrix and the same matrix as a torch CSR tensor."""
    rng = np.random.default_rng(seed)
    matrix = scipy.sparse.random(m, k, density=density, format="csr", random_state=rng,
                                 dtype=np.float64)
    matrix.sort_indices()
    tensor = torch.sparse_csr_tensor(torch.from_numpy(matrix.indptr).long(),
                                     torch.from_numpy(matrix.indices).long(),
                                     torch.from_numpy(matrix.data).to(dtype), (m, k))
    return matrix, tensor


@pytest.mark.parametrize("m, k, n, density", [(7, 5, 3, 0.4), (1, 9, 1, 1.0), (30, 20, 17, 0.1),
                                              (4, 6, 5, 0.0)])
def test_matches_scipy(emulator, m, k, n, density):
    matrix, tensor = random_sparse(m, k, density)
    dense = torch.randn(k, n, dtype=torch.float64)
    with tsm.record() as launches:
        out = tsm.spmm(tensor, dense)
    assert out.shape == (m, n) and out.is_contiguous()
    np.testing.assert_allclose(out.numpy(), matrix @ dense.numpy(), rtol=1e-12, atol=1e-12)
    kernel = "sparse_linear_forward_batch_lanes_double" if n >= 3 else "sparse_linear_forward_double"
    assert [l.kernel for l in launches] == ([kernel] if matrix.nnz else [])


def test_gradients_on_both_sides_match_torch_sparse_mm(emulator):
    _, tensor = random_sparse(8, 6, 0.4, seed=1)
    a = tensor.detach().clone().requires_grad_()
    b = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    ref_a = tensor.detach().clone().requires_grad_()
    ref_b = b.detach().clone().requires_grad_()
    grad = torch.randn(8, 5, dtype=torch.float64)
    with tsm.record() as launches:
        tsm.spmm(a, b).backward(grad)
    assert [l.kernel for l in launches] == ["sparse_linear_forward_batch_lanes_double",
                                            "sparse_linear_backward_batch_lanes_double"]
    torch.sparse.mm(ref_a, ref_b).backward(grad)
    assert a.grad.layout == torch.sparse_csr
    assert torch.equal(a.grad.crow_indices(), ref_a.grad.crow_indices())
    assert torch.equal(a.grad.col_indices(), ref_a.grad.col_indices())
    torch.testing.assert_close(a.grad.values(), ref_a.grad.values(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.grad, ref_b.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("deterministic", [False, True])
def test_gradcheck_float64_through_the_kernels(emulator, deterministic):
    _, tensor = random_sparse(6, 5, 0.5, seed=2)
    crow, col = tensor.crow_indices(), tensor.col_indices()
    values = tensor.values().clone().requires_grad_()
    dense = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def product(v, d):
        return tsm.spmm(torch.sparse_csr_tensor(crow, col, v, (6, 5)), d,
                        deterministic=deterministic)

    assert torch.autograd.gradcheck(product, (values, dense), nondet_tol=1e-12)


def test_coo_scipy_and_int32_indices(emulator):
    matrix, tensor = random_sparse(9, 7, 0.3, seed=3)
    dense = torch.randn(7, 4, dtype=torch.float64)
    want = torch.from_numpy(matrix @ dense.numpy())
    int32 = torch.sparse_csr_tensor(tensor.crow_indices().int(), tensor.col_indices().int(),
                                    tensor.values(), tensor.shape)
    for sparse in (tensor.to_sparse_coo(), matrix, matrix.tocoo(), matrix.tocsc(), int32):
        torch.testing.assert_close(tsm.spmm(sparse, dense), want, rtol=1e-12, atol=1e-12)


def test_reference_backend_and_float32():
    matrix, tensor = random_sparse(6, 4, 0.5, seed=4, dtype=torch.float32)
    dense = torch.randn(4, 3)
    want = torch.from_numpy((matrix @ dense.double().numpy()).astype(np.float32))
    for backend in ("reference", "emulator"):
        with tsm.use_backend(backend):
            torch.testing.assert_close(tsm.spmm(tensor, dense), want)


@pytest.mark.parametrize("sparse, dense, error, match", [
    (lambda t: t, torch.randn(5, 3, dtype=torch.float64), ValueError,
     r"^spmm: sparse is \(6, 4\) and dense is \(5, 3\)"),
    (lambda t: t, torch.randn(4, 3), ValueError, "^spmm: the sparse matrix's values has dtype "
                                                 "torch.float64 but dense has dtype torch.float32"),
    (lambda t: t, torch.randn(4, dtype=torch.float64), ValueError, "^spmm: dense must be 2-D"),
    (lambda t: t.to_dense(), torch.randn(4, 3, dtype=torch.float64), TypeError,
     "^spmm: expected a sparse CSR or COO tensor, got layout torch.strided"),
    (lambda t: [1, 2], torch.randn(4, 3, dtype=torch.float64), TypeError,
     "^spmm: expected a torch sparse CSR or COO tensor or a SciPy sparse matrix, got list"),
    (lambda t: torch.stack([t.to_dense()] * 2).to_sparse_csr(),
     torch.randn(4, 3, dtype=torch.float64), ValueError, "^spmm: the sparse weight must be a 2-D"),
])
def test_errors_name_spmm(emulator, sparse, dense, error, match):
    _, tensor = random_sparse(6, 4, 0.5)
    with tsm.record() as launches, pytest.raises(error, match=match):
        tsm.spmm(sparse(tensor), dense)
    assert launches == []
