"""A whole training step of an L-layer sparse MLP, and evolving topology (prune_and_regrow)."""
from __future__ import annotations

import copy

import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.nn import SparseLinear, prune_and_regrow
from torch_sparse_metal.reference import csr_row_ids


@pytest.fixture
def emulator():
    with tsm.use_backend("emulator"):
        yield


def sparse_mlp(widths, activation="relu", seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    layers = [SparseLinear(a, b, density=0.3, generator=g,
                           activation=activation if i < len(widths) - 2 else None)
              for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]
    return torch.nn.Sequential(*layers).to(dtype)


@pytest.mark.parametrize("widths", [[10, 16, 4], [10, 24, 16, 4], [10, 8, 8, 8, 4]],
                         ids=["L2", "L3", "L4"])
def test_training_step_takes_at_most_2L_plus_2_dispatches(emulator, widths):
    """Forward, loss, backward and optimizer step of an L-layer sparse MLP: 2L + 2 launches.

    What ``tsm.record()`` counts: the package's kernel launches (here on the
    emulator; on a Mac, the dispatches encoded into torch's MPS stream): L fused forward
    kernels (activation inside), one fused softmax-cross-entropy kernel (loss and d loss /
    d logits together), L fused backward kernels (grad_input, grad_values, grad_bias and
    the activation's derivative together; the first layer skips grad_input) and one AdamW
    kernel for every parameter.

    What it does not count: plain torch ops the step still runs, none of them ours to
    launch: allocations; the zero-fills of grad_values / grad_bias (the backward kernel
    accumulates into them with atomics); the multiply of the saved loss gradient by the
    upstream gradient (1.0); the labels' int64 -> int32 conversion; AdamW's one
    ``torch.cat`` gathering the gradients into its flat buffer. On MPS those are torch
    kernels or blits on the same stream, so they are real GPU work this test does not
    bound; none reads the device back (tests/test_host_syncs.py).
    """
    L = len(widths) - 1
    model = sparse_mlp(widths)
    opt = tsm.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(32, widths[0])
    y = torch.randint(0, widths[-1], (32,))
    for step in range(2):   # the first step also creates the optimizer state
        opt.zero_grad()
        with tsm.record() as launches:
            loss = tsm.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        kernels = [l.kernel for l in launches]
        assert len(kernels) <= 2 * L + 2
        assert kernels == (["sparse_linear_forward_batch_lanes_float"] * L + ["cross_entropy_forward_float"]
                           + ["sparse_linear_backward_batch_lanes_float"] * L + ["adamw_step_float"])


def test_training_step_matches_torch(emulator):
    """The fused step against torch's own loss and optimizer on the same layers."""
    model = sparse_mlp([10, 16, 4], activation="gelu", dtype=torch.float64)
    ref = copy.deepcopy(model)
    opt = tsm.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(16, 10, generator=g, dtype=torch.float64)
        y = torch.randint(0, 4, (16,), generator=g)
        for m, o, loss_fn in ((model, opt, tsm.nn.functional.cross_entropy),
                              (ref, ref_opt, torch.nn.functional.cross_entropy)):
            o.zero_grad()
            with tsm.use_backend("emulator" if m is model else "reference"):
                loss_fn(m(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------
# prune_and_regrow


def cells_of(layer):
    return (csr_row_ids(layer.indptr) * layer.in_features + layer.indices.long()).tolist()


def trained_layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = SparseLinear(12, 9, density=0.25, generator=g, dtype=torch.float64)
    opt = tsm.optim.AdamW(layer.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        layer(torch.randn(5, 12, generator=g, dtype=torch.float64)).square().sum().backward()
        opt.step()
    return layer, opt


@pytest.mark.parametrize("mode", ["magnitude", "random", "gradient"])
def test_prune_and_regrow_keeps_nnz_and_moves_state(emulator, mode):
    layer, opt = trained_layer()
    nnz = layer.nnz
    before_cells = cells_of(layer)
    before = {c: (w, m, v) for c, w, m, v in zip(
        before_cells, layer.weight.tolist(), opt.state[layer.weight]["exp_avg"].tolist(),
        opt.state[layer.weight]["exp_avg_sq"].tolist())}
    dense_grad = torch.randn(9, 12, generator=torch.Generator().manual_seed(3),
                             dtype=torch.float64)
    k = prune_and_regrow(layer, 0.25, mode, optimizer=opt, dense_grad=dense_grad,
                         generator=torch.Generator().manual_seed(4))
    assert k == round(0.25 * nnz)
    after_cells = cells_of(layer)
    assert layer.nnz == nnz and len(set(after_cells)) == nnz
    assert after_cells == sorted(after_cells)                     # row-major CSR
    grown = set(after_cells) - set(before_cells)
    dropped = set(before_cells) - set(after_cells)
    assert len(grown) == len(dropped) == k
    if mode != "random":   # the weakest edges went
        weakest = sorted(before_cells, key=lambda c: abs(before[c][0]))[:k]
        assert dropped == set(weakest)
    if mode == "gradient":  # the strongest empty cells came
        score = dense_grad.abs().reshape(-1).clone()
        score[before_cells] = -1
        assert grown == set(torch.topk(score, k).indices.tolist())
    state = opt.state[layer.weight]
    for c, w, m, v in zip(after_cells, layer.weight.tolist(), state["exp_avg"].tolist(),
                          state["exp_avg_sq"].tolist()):
        assert (w, m, v) == ((0.0, 0.0, 0.0) if c in grown else before[c])
    # The by-source CSR follows, and the layer trains on through the same optimizer.
    x = torch.randn(4, 12, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ layer.to_dense().T + layer.bias)
    src = layer.pattern().by_source()
    assert torch.equal(layer.src_perm, src.perm)
    opt.zero_grad()
    layer(x).sum().backward()
    opt.step()


def test_prune_and_regrow_with_torch_optimizer_and_grad(emulator):
    layer = SparseLinear(6, 5, density=0.5, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(layer.parameters())
    layer(torch.randn(3, 6)).sum().backward()
    opt.step()
    cells = cells_of(layer)
    grad = dict(zip(cells, layer.weight.grad.tolist()))
    prune_and_regrow(layer, 0.2, optimizer=opt)
    for c, gv, m in zip(cells_of(layer), layer.weight.grad.tolist(),
                        opt.state[layer.weight]["exp_avg"].tolist()):
        assert gv == grad.get(c, 0.0)
        assert (m == 0.0) == (c not in grad)


def test_prune_and_regrow_edge_cases(emulator):
    full = SparseLinear(3, 2, density=1.0)
    assert prune_and_regrow(full, 0.5) == 0      # no empty cell to grow into
    layer = SparseLinear(6, 5, density=0.5)
    assert prune_and_regrow(layer, 0.0) == 0
    with pytest.raises(ValueError, match="prune_and_regrow: mode must be one of"):
        prune_and_regrow(layer, 0.1, "largest")
    with pytest.raises(ValueError, match="prune_and_regrow: fraction must lie in"):
        prune_and_regrow(layer, 1.5)
    with pytest.raises(ValueError, match="mode 'gradient' needs dense_grad"):
        prune_and_regrow(layer, 0.1, "gradient")
    with pytest.raises(ValueError, match=r"dense_grad has shape \(6, 5\)"):
        prune_and_regrow(layer, 0.1, "gradient", dense_grad=torch.randn(6, 5))
