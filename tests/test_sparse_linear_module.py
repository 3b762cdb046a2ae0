"""torch_sparse_metal.nn.SparseLinear: construction, pattern, init, state dict, training."""
from __future__ import annotations

import math

import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.nn import SparseLinear, random_csr_pattern
from torch_sparse_metal.reference import csr_row_ids


@pytest.fixture
def emulator():
    with tsm.use_backend("emulator"):
        yield


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


def small_pattern():
    # Row 1 is empty, row 2 repeats column 1.
    return (torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32),
            torch.tensor([0, 3, 1, 2, 1, 0], dtype=torch.int32))


def test_shapes_and_buffers():
    m = SparseLinear(10, 7, density=0.3, generator=seeded())
    nnz = round(0.3 * 70)
    assert m.weight.shape == (nnz,) and m.bias.shape == (7,)
    assert m.indptr.shape == (8,) and m.indices.shape == (nnz,)
    assert m.src_indptr.shape == (11,) and m.src_rows.shape == m.src_perm.shape == (nnz,)
    assert all(t.dtype == torch.int32 for t in (m.indptr, m.indices, m.src_indptr,
                                                   m.src_rows, m.src_perm))
    assert m(torch.randn(2, 3, 10)).shape == (2, 3, 7)
    assert m(torch.randn(10)).shape == (7,)
    assert SparseLinear(10, 7, density=0.3, bias=False).bias is None


@pytest.mark.parametrize("in_f,out_f,density", [
    (10, 7, 0.3), (10, 7, 0.0), (10, 7, 1.0), (10, 7, 0.8), (1, 1, 1.0), (0, 3, 0.5),
    (3000, 2000, 0.01),   # large enough for the rejection sampler
    (3000, 2000, 0.95),   # ... sampling the empty cells instead
])
def test_random_pattern_density(in_f, out_f, density):
    indptr, indices = random_csr_pattern(in_f, out_f, density, generator=seeded())
    nnz = round(density * in_f * out_f)
    assert indptr.shape == (out_f + 1,) and indices.shape == (nnz,)
    assert indptr[0] == 0 and indptr[-1] == nnz and bool((indptr.diff() >= 0).all())
    cells = csr_row_ids(indptr) * in_f + indices.long()
    assert cells.unique().numel() == nnz  # distinct and, being sorted, columns ascend per row
    assert bool((cells.diff() > 0).all()) if nnz > 1 else True
    if nnz:
        assert 0 <= int(indices.min()) and int(indices.max()) < in_f


def test_random_pattern_is_seedable_and_spread():
    a = random_csr_pattern(50, 40, 0.25, generator=seeded(3))
    b = random_csr_pattern(50, 40, 0.25, generator=seeded(3))
    c = random_csr_pattern(50, 40, 0.25, generator=seeded(4))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[1], c[1])
    counts = a[0].diff().double()
    assert abs(counts.mean().item() - 12.5) < 1e-9 and counts.std().item() > 0.5
    m1 = SparseLinear(50, 40, density=0.25, generator=seeded(3))
    m2 = SparseLinear(50, 40, density=0.25, generator=seeded(3))
    assert torch.equal(m1.weight, m2.weight) and torch.equal(m1.indices, m2.indices)


def test_explicit_pattern_and_density_property():
    indptr, indices = small_pattern()
    m = SparseLinear(4, 4, indptr=indptr.long(), indices=indices.long())
    assert m.indptr.dtype == torch.int32
    assert torch.equal(m.indptr, indptr) and torch.equal(m.indices, indices)
    assert m.nnz == 6 and m.density == 6 / 16


@pytest.mark.parametrize("backend", ["emulator", "reference"])
def test_to_dense_matches_forward(backend):
    m = SparseLinear(6, 5, indptr=torch.tensor([0, 2, 2, 5, 6, 8]),
                     indices=torch.tensor([0, 3, 1, 5, 1, 0, 4, 4]), dtype=torch.float64)
    dense = m.to_dense()
    assert dense.shape == (5, 6)
    assert dense[1].abs().sum() == 0  # empty row
    assert dense[4, 4] == m.weight[6] + m.weight[7]  # repeated entries add up
    x = torch.randn(3, 6, dtype=torch.float64)
    with tsm.use_backend(backend):
        torch.testing.assert_close(m(x), x @ dense.T + m.bias)


def test_init_bound_uses_each_rows_fan_in():
    indptr = torch.tensor([0, 1, 1, 101, 109])  # fan-in 1, 0, 100, 8
    indices = torch.cat([torch.tensor([3]), torch.arange(100), torch.arange(8)])
    m = SparseLinear(100, 4, indptr=indptr, indices=indices, generator=seeded())
    bound = 1 / torch.tensor([1.0, math.inf, 10.0, math.sqrt(8)])
    per_edge = bound[csr_row_ids(indptr)]
    assert bool((m.weight.abs() <= per_edge).all())
    row2 = m.weight[1:101]
    assert row2.abs().max() > 0.08 and row2.min() < 0 < row2.max()  # uses most of +-0.1
    assert bool((m.bias.abs() <= bound).all()) and m.bias[1] == 0  # no fan-in: zero bias


def test_state_dict_round_trip(tmp_path):
    m = SparseLinear(12, 9, density=0.3, generator=seeded(1))
    assert set(m.state_dict()) == {"weight", "bias", "indptr", "indices"}
    path = tmp_path / "layer.pt"
    torch.save(m.state_dict(), path)
    # A module with a different pattern (and nnz) takes on the saved one.
    m2 = SparseLinear(12, 9, density=0.6, generator=seeded(2))
    m2.load_state_dict(torch.load(path))
    for name in ("weight", "bias", "indptr", "indices", "src_indptr", "src_rows", "src_perm"):
        assert torch.equal(getattr(m2, name), getattr(m, name)), name
    x = torch.randn(4, 12)
    with tsm.use_backend("emulator"):
        torch.testing.assert_close(m2(x), m(x))
    assert repr(m2) == repr(m)


def test_load_bad_pattern_fails_at_load():
    m = SparseLinear(4, 4, density=0.5)
    state = m.state_dict()
    state["indices"] = state["indices"].clone().fill_(9)
    with pytest.raises(ValueError, match=r"SparseLinear: indices must lie in \[0, in_features\)"):
        m.load_state_dict(state)


def test_pattern_edits_are_picked_up(emulator):
    indptr, indices = small_pattern()
    m = SparseLinear(4, 4, indptr=indptr, indices=indices, dtype=torch.float64)
    with torch.no_grad():
        m.indices.copy_(torch.tensor([1, 2, 3, 0, 0, 2], dtype=torch.int32))
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = m(x)
    assert torch.equal(m.src_indptr, torch.tensor([0, 2, 3, 5, 6], dtype=torch.int32))
    torch.testing.assert_close(y, x @ m.to_dense().T + m.bias)
    y.sum().backward()
    torch.testing.assert_close(x.grad, m.to_dense().sum(0).expand(5, -1).detach())


def test_extra_repr():
    indptr, indices = small_pattern()
    m = SparseLinear(4, 4, indptr=indptr, indices=indices, bias=False)
    assert repr(m) == ("SparseLinear(in_features=4, out_features=4, nnz=6, density=0.375, "
                       "bias=False)")


def test_dispatches_per_layer(emulator):
    net = torch.nn.Sequential(SparseLinear(8, 16, density=0.5), torch.nn.ReLU(),
                              SparseLinear(16, 3, density=0.5))
    x = torch.randn(5, 8)
    with tsm.record() as launches:
        net(x).sum().backward()
    kernels = [l.kernel for l in launches]
    assert kernels.count("sparse_linear_forward_batch_lanes_float") == 2
    # The first layer's input needs no gradient, but its weight does: one dispatch each.
    assert kernels.count("sparse_linear_backward_batch_lanes_float") == 2
    assert len(kernels) == 4


def test_training_step_reduces_the_loss(emulator):
    torch.manual_seed(0)
    net = torch.nn.Sequential(SparseLinear(16, 32, density=0.3, generator=seeded()),
                              torch.nn.Tanh(),
                              SparseLinear(32, 4, density=0.3, generator=seeded(1)))
    x = torch.randn(64, 16)
    target = x @ (0.5 * torch.randn(16, 4))  # learnable: a linear teacher
    opt = torch.optim.Adam(net.parameters(), lr=0.03)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_double_module_gradcheck(emulator):
    m = SparseLinear(5, 4, indptr=torch.tensor([0, 2, 2, 5, 6]),
                     indices=torch.tensor([0, 3, 1, 2, 4, 0]), dtype=torch.float64)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: m(x), (x,), nondet_tol=1e-12)


@pytest.mark.parametrize("kwargs,match", [
    (dict(), "give exactly one of density or indptr \\+ indices"),
    (dict(density=0.5, indptr=torch.tensor([0, 0, 0])), "give exactly one"),
    (dict(indptr=torch.tensor([0, 0, 0])), "indptr and indices go together; got only indptr"),
    (dict(density=1.5), "density must lie in \\[0, 1\\], got 1.5"),
    (dict(indptr=torch.tensor([0, 1]), indices=torch.tensor([0])),
     "indptr has 2 elements but out_features \\+ 1 is 3"),
    (dict(indptr=torch.tensor([0, 1, 1]), indices=torch.tensor([3])),
     "indices must lie in \\[0, in_features\\) = \\[0, 3\\), found 3"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match="^SparseLinear: " + match):
        SparseLinear(3, 2, **kwargs)


def test_wrong_input_width(emulator):
    m = SparseLinear(3, 2, density=0.5)
    with pytest.raises(ValueError, match="sparse_linear: input has 4 features"):
        m(torch.randn(2, 4))
