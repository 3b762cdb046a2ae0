"""``BlockSparseLinear`` and ``block_sparse_linear``: a weight of B x B blocks (BSR), one
forward and one fused backward dispatch, on simdgroup_matrix fragments or the SIMD-shuffle
fallback, checked through the kernels against torch's own BSR tensors and the reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import torch_sparse_metal as tsm
from torch_sparse_metal.ops.block_sparse_linear import (BSRPattern, apply_block_pattern,
                                                        block_sparse_linear_reference)
from test_sparse_linear_half import gamma, rounded

F64 = torch.float64
FAMILIES = {"simdgroup": "0", "shuffle": "1"}  # TSM_FORCE_NO_SIMDGROUP_MATRIX

pytestmark = pytest.mark.filterwarnings("ignore:Sparse BSR tensor support:UserWarning")


@pytest.fixture(params=list(FAMILIES))
def family(request, monkeypatch):
    monkeypatch.setenv("TSM_FORCE_NO_SIMDGROUP_MATRIX", FAMILIES[request.param])
    return request.param


def bsr_problem(block_rows, block_cols, block, density, batch, dtype=F64, seed=0):
    """A random block mask (with an empty block row when there are two or more rows), its
    BSR arrays, values, bias and input."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(block_rows, block_cols, generator=g) < density
    if block_rows > 1:
        mask[block_rows // 2] = False
    crow = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)]).int()
    col = mask.nonzero()[:, 1].int()
    values = torch.randn(col.numel(), block, block, generator=g, dtype=dtype)
    bias = torch.randn(block_rows * block, generator=g, dtype=dtype)
    x = torch.randn(batch, block_cols * block, generator=g, dtype=dtype)
    return crow, col, values, bias, x


def torch_bsr(crow, col, values, shape):
    return torch.sparse_bsr_tensor(crow.long(), col.long(), values, shape,
                                   check_invariants=True)


@pytest.mark.parametrize("block", [8, 16, 32])
def test_gradcheck_through_the_kernels(family, block):
    """Every Jacobian entry for 8 x 8 blocks; for 16 and 32 (16 and 64 times the values to
    perturb) gradcheck's fast mode, which compares random projections of the Jacobian."""
    crow, col, values, bias, x = bsr_problem(3, 2, block, 0.7, batch=9)  # 9: a partial tile
    leaves = [t.requires_grad_() for t in (x, values, bias)]
    with tsm.use_backend("emulator"), tsm.record() as launches:
        assert torch.autograd.gradcheck(
            lambda x, v, b: tsm.block_sparse_linear(x, crow, col, v, b), leaves,
            fast_mode=block > 8)
    kernels = {l.kernel for l in launches}
    assert kernels == {f"block_sparse_linear_{d}_{family}_b{block}_double"
                       for d in ("forward", "backward")}


def test_second_derivatives_are_refused():
    crow, col, values, bias, x = bsr_problem(2, 2, 8, 1.0, batch=4)
    x.requires_grad_()
    with tsm.use_backend("emulator"):
        y = tsm.block_sparse_linear(x, crow, col, values.requires_grad_(), bias)
        (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="block_sparse_linear_backward has no derivative"):
            g.sum().backward()


@settings(max_examples=12, deadline=None)
@given(block=st.sampled_from([8, 16, 32]), rows=st.integers(1, 3), cols=st.integers(1, 3),
       density=st.floats(0.0, 1.0), batch=st.integers(0, 19), bias=st.booleans(),
       shuffle=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_torchs_bsr_tensor(block, rows, cols, density, batch, bias, shuffle, seed):
    """Forward and every gradient against torch's BSR tensor made dense, in float64, on
    random block patterns (empty rows and empty patterns included)."""
    crow, col, values, b, x = bsr_problem(rows, cols, block, density, batch, seed=seed)
    b = b if bias else None
    dense = torch_bsr(crow, col, values, (rows * block, cols * block)).to_dense()
    grad = torch.randn(batch, rows * block, dtype=F64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TSM_FORCE_NO_SIMDGROUP_MATRIX", "1" if shuffle else "0")
        xs, vs = x.clone().requires_grad_(), values.clone().requires_grad_()
        bs = None if b is None else b.clone().requires_grad_()
        with tsm.use_backend("emulator"):
            y = tsm.block_sparse_linear(xs, crow, col, vs, bs)
            y.backward(grad)
    want = x @ dense.t() + (b if b is not None else 0)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xs.grad, grad @ dense, rtol=1e-12, atol=1e-12)
    full = grad.t() @ x  # d loss / d W, dense; each block's gradient is its slice
    r = torch.repeat_interleave(torch.arange(rows), (crow[1:] - crow[:-1]).long())
    want_blocks = full.reshape(rows, block, cols, block).permute(0, 2, 1, 3)[r, col.long()]
    torch.testing.assert_close(vs.grad, want_blocks, rtol=1e-12, atol=1e-12)
    if b is not None:
        torch.testing.assert_close(bs.grad, grad.sum(0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_lower_precisions_against_float64(family, dtype):
    """Forward and every gradient: sums in float32, each result rounded once, so within
    u_T (|want| + e) + e with e = gamma_n sum |terms| for a sum of n terms (the forward's
    row: its blocks' columns and the bias; grad_input's: the column's blocks' rows;
    grad_values' and grad_bias': the batch)."""
    crow, col, values, bias, x = bsr_problem(4, 3, 16, 0.6, batch=21, dtype=torch.float32)
    grad = torch.randn(21, 64, generator=torch.Generator().manual_seed(9)).to(dtype)
    values, bias, x = (t.to(dtype).requires_grad_() for t in (values, bias, x))
    with tsm.use_backend("emulator"):
        y = tsm.block_sparse_linear(x, crow, col, values, bias)
        y.backward(grad)
    assert {t.dtype for t in (y, x.grad, values.grad, bias.grad)} == {dtype}
    v64, x64, g64 = values.detach().double(), x.detach().double(), grad.double()
    dense = torch_bsr(crow, col, v64, (64, 48)).to_dense()
    checks = [
        ("output", y, x64 @ dense.t() + bias.detach().double(),
         gamma(3 * 16 + 1) * (x64.abs() @ dense.abs().t() + bias.detach().double().abs())),
        ("grad_input", x.grad, g64 @ dense, gamma(4 * 16) * (g64.abs() @ dense.abs())),
        ("grad_bias", bias.grad, g64.sum(0), gamma(21) * g64.abs().sum(0)),
    ]
    full, full_abs = g64.t() @ x64, g64.abs().t() @ x64.abs()
    r = torch.repeat_interleave(torch.arange(4), (crow[1:] - crow[:-1]).long())
    blocks = lambda m: m.reshape(4, 16, 3, 16).permute(0, 2, 1, 3)[r, col.long()]  # noqa: E731
    checks.append(("grad_values", values.grad, blocks(full), gamma(21) * blocks(full_abs)))
    for what, got, want, off in checks:
        err = (got.detach().double() - want).abs()
        assert bool((err <= rounded(dtype, want, off)).all()), (what, float(err.max()))


def test_one_dispatch_each_way_and_the_family_follows_the_gpu(monkeypatch):
    layer = tsm.nn.BlockSparseLinear(32, 48, 8, density=0.5,
                                     generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 32, requires_grad=True)
    for forced, family in (("0", "simdgroup"), ("1", "shuffle")):
        monkeypatch.setenv("TSM_FORCE_NO_SIMDGROUP_MATRIX", forced)
        with tsm.use_backend("emulator"), tsm.record() as launches:
            layer(x).sum().backward()
        assert [l.kernel for l in launches] == [
            f"block_sparse_linear_forward_{family}_b8_float",
            f"block_sparse_linear_backward_{family}_b8_float"]


def test_the_module_in_every_format():
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(64, 32)
    layer = tsm.nn.BlockSparseLinear.from_dense(linear, 16, density=0.5)
    # The 4 blocks of largest norm of the 8, as NumPy finds them.
    w = linear.weight.detach().numpy().reshape(2, 16, 4, 16).transpose(0, 2, 1, 3)
    norms = np.sqrt((w ** 2).sum((2, 3))).ravel()
    keep = np.sort(np.argsort(-norms)[:4])
    assert layer.nnzb == 4 and layer.density == 0.5
    got = (layer.block_rows() * 4 + layer.col.long()).tolist()
    assert got == keep.tolist()
    dense = layer.to_dense().detach()
    kept = torch.zeros(2, 4, dtype=torch.bool)
    kept.view(-1)[torch.from_numpy(keep)] = True
    mask = kept.repeat_interleave(16, 0).repeat_interleave(16, 1)
    torch.testing.assert_close(dense, linear.weight.detach() * mask)

    bsr = layer.to_sparse_bsr()
    assert bsr.layout == torch.sparse_bsr and torch.equal(bsr.to_dense(), dense)
    twin = tsm.nn.BlockSparseLinear.from_sparse_bsr(bsr.detach(), layer.bias.detach())
    x = torch.randn(7, 64, generator=g)
    with tsm.use_backend("emulator"):
        y = layer(x)
        torch.testing.assert_close(twin(x), y)
        torch.testing.assert_close(tsm.block_sparse_linear(x, bsr.detach(), layer.bias), y)
    torch.testing.assert_close(y, linear(x) * 0 + x @ dense.t() + layer.bias,
                               rtol=1e-5, atol=1e-5)
    # torch's own conversion gives the same blocks.
    theirs = (linear.weight.detach() * mask).to_sparse_bsr(16)
    assert theirs.values().shape[0] == 4
    assert torch.equal(theirs.col_indices().int(), layer.col)


def test_a_new_pattern_through_load_state_dict_is_validated_and_used():
    a = tsm.nn.BlockSparseLinear(32, 32, 8, density=0.25, generator=torch.Generator().manual_seed(2))
    b = tsm.nn.BlockSparseLinear(32, 32, 8, density=0.25, generator=torch.Generator().manual_seed(3))
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 32)
    with tsm.use_backend("emulator"):
        torch.testing.assert_close(b(x), a(x))
    with torch.no_grad():
        b.col.fill_(7)  # past 32 / 8 = 4 block columns: seen through the version counter
    with pytest.raises(ValueError, match=r"BlockSparseLinear: col must lie in "
                                         r"\[0, in_features / block\) = \[0, 4\), found 7"):
        b(x)


def test_an_index_written_behind_torchs_back_is_nan_and_reported():
    layer = tsm.nn.BlockSparseLinear(32, 16, 8, density=0.5,
                                     generator=torch.Generator().manual_seed(4))
    x = torch.randn(3, 32)
    with tsm.use_backend("emulator"):
        layer(x)
        layer.col.data.numpy()[0] = 1000  # no version bump: the kernels find it
        y = layer(x)
        row = int(layer.block_rows()[0])
        assert bool(y[:, row * 8:(row + 1) * 8].isnan().all())
        with pytest.raises(tsm.InvalidInputError, match="index"):
            tsm.check_errors()


@pytest.mark.parametrize("call, match", [
    (lambda: tsm.nn.BlockSparseLinear(32, 32, 12, density=0.5), r"block must be one of \(8, 16, 32\)"),
    (lambda: tsm.nn.BlockSparseLinear(30, 32, 8, density=0.5),
     "in_features = 30 is not a multiple of the block size 8"),
    (lambda: tsm.nn.BlockSparseLinear(32, 32, 8), "give exactly one of density or crow"),
    (lambda: tsm.block_sparse_linear(torch.randn(2, 16), torch.tensor([0, 1]),
                                     torch.tensor([0]), torch.randn(2, 8, 8)),
     r"values has shape \(2, 8, 8\) but the pattern needs \(nnzb, B, B\) = \(1, 8, 8\)"),
    (lambda: tsm.block_sparse_linear(torch.randn(2, 16), torch.tensor([1, 1]),
                                     torch.tensor([0]), torch.randn(1, 8, 8)),
     "crow must start at 0"),
    (lambda: tsm.block_sparse_linear(torch.randn(2, 16), torch.tensor([0, 1]),
                                     torch.tensor([0]), torch.randn(1, 8, 4)),
     r"values must be \(nnzb, B, B\)"),
])
def test_bad_input_is_named(call, match):
    with tsm.use_backend("emulator"), pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_autocast_keeps_float32_parameters(dtype):
    layer = tsm.nn.BlockSparseLinear(32, 16, 8, density=0.5,
                                     generator=torch.Generator().manual_seed(5))
    x = torch.randn(6, 32)
    with tsm.use_backend("emulator"):
        with torch.autocast("cpu", dtype=dtype):
            y = layer(x)
        y.float().sum().backward()
        by_hand = apply_block_pattern(x.to(dtype), layer.pattern(),
                                      layer.weight.detach().to(dtype),
                                      layer.bias.detach().to(dtype))
    assert y.dtype == dtype and torch.equal(y, by_hand)
    assert layer.weight.grad.dtype == layer.bias.grad.dtype == torch.float32


def test_compiled_fullgraph_equals_eager():
    g = torch.Generator().manual_seed(6)
    model = torch.nn.Sequential(tsm.nn.BlockSparseLinear(32, 64, 8, density=0.5, generator=g),
                                torch.nn.ReLU(),
                                tsm.nn.BlockSparseLinear(64, 16, 16, density=0.5, generator=g))
    x = torch.randn(10, 32, generator=g, requires_grad=True)
    with tsm.use_backend("emulator"):
        eager = model(x)
        (gx_eager,) = torch.autograd.grad(eager.sum(), x)
        compiled = torch.compile(model, fullgraph=True)
        traced = compiled(x)
        (gx_traced,) = torch.autograd.grad(traced.sum(), x)
    torch.testing.assert_close(traced, eager)
    torch.testing.assert_close(gx_traced, gx_eager)


def test_the_reference_is_the_reference_backend():
    crow, col, values, bias, x = bsr_problem(2, 3, 8, 0.5, batch=4)
    pattern = BSRPattern(crow, col, 24, 16, 8)
    with tsm.use_backend("reference"), tsm.record() as launches:
        y = apply_block_pattern(x, pattern, values, bias)
    assert launches == []
    torch.testing.assert_close(y, block_sparse_linear_reference(x, pattern.crow, pattern.col,
                                                                values, bias))


def _blocks_by_cell(layer):
    """{(block row, block column): block values} of a layer."""
    rows = layer.block_rows().tolist()
    return {(r, c): layer.weight[k].detach().clone()
            for k, (r, c) in enumerate(zip(rows, layer.col.tolist()))}


@pytest.mark.parametrize("mode", ["magnitude", "random", "gradient"])
def test_prune_and_regrow_at_block_granularity(mode):
    """nnzb stays; magnitude drops the blocks of smallest norm, gradient grows the empty
    cells of largest gradient norm over the block; kept blocks keep their values and their
    optimizer state, grown ones start at zero; nothing is read back."""
    g = torch.Generator().manual_seed(7)
    layer = tsm.nn.BlockSparseLinear(64, 32, 8, density=0.25, generator=g)
    opt = tsm.optim.AdamW(layer.parameters(), lr=1e-2)
    x = torch.randn(16, 64, generator=g)
    with tsm.use_backend("emulator"):
        layer(x).square().sum().backward()
        opt.step()
    before = _blocks_by_cell(layer)
    moments = {cell: opt.state[layer.weight]["exp_avg"][k].clone()
               for k, cell in enumerate(before)}
    norms = {cell: float(v.norm()) for cell, v in before.items()}
    dense_grad = torch.randn(32, 64, generator=g)
    with tsm.syncs.watch() as syncs:
        k = tsm.nn.prune_and_regrow(layer, 0.25, mode, optimizer=opt, generator=g,
                                    dense_grad=dense_grad if mode == "gradient" else None)
    assert syncs.events == [] and k == 2 and layer.nnzb == 8
    after = _blocks_by_cell(layer)
    kept, grown = set(after) & set(before), set(after) - set(before)
    assert len(kept) == 6 and len(grown) == 2
    for cell in kept:
        assert torch.equal(after[cell], before[cell])
        k_after = list(after).index(cell)
        assert torch.equal(opt.state[layer.weight]["exp_avg"][k_after], moments[cell])
    for cell in grown:
        assert not after[cell].any()
        assert not opt.state[layer.weight]["exp_avg"][list(after).index(cell)].any()
    if mode != "random":
        dropped = set(before) - set(after)
        assert max(norms[c] for c in dropped) <= min(norms[c] for c in kept)
    if mode == "gradient":
        block_grad = dense_grad.reshape(4, 8, 8, 8).square().sum((1, 3))
        empty = [(r, c) for r in range(4) for c in range(8) if (r, c) not in before]
        best = sorted(empty, key=lambda rc: -float(block_grad[rc]))[:2]
        assert grown == set(best)
    # The layer runs on the new pattern: the kernels and torch's BSR agree.
    with tsm.use_backend("emulator"):
        y = layer(x)
    torch.testing.assert_close(y, x @ layer.to_sparse_bsr().to_dense().t() + layer.bias)


def test_every_kernel_name_exists_in_the_library():
    from torch_sparse_metal.ops import block_sparse_linear as ops
    names = set(tsm.emulator.load_shader_file("block_sparse_linear.metal").kernel_names)
    assert set(ops.kernel_names("emulator")) | set(ops.kernel_names("metal")) <= names
    assert len(ops.kernel_names("metal")) == 2 * 2 * 3 * 3  # directions, families, B, dtypes


def test_a_kernel_can_be_named(monkeypatch):
    crow, col, values, bias, x = bsr_problem(2, 2, 8, 1.0, batch=3)
    with tsm.use_backend("emulator"), tsm.record() as launches:
        tsm.block_sparse_linear(x, crow, col, values, bias, kernel="shuffle")
    assert [l.kernel for l in launches] == ["block_sparse_linear_forward_shuffle_b8_double"]
    monkeypatch.setenv("TSM_FORCE_NO_SIMDGROUP_MATRIX", "1")
    with tsm.use_backend("emulator"), pytest.raises(ValueError, match="needs simdgroup_matrix"):
        tsm.block_sparse_linear(x, crow, col, values, bias, kernel="simdgroup")
    with pytest.raises(ValueError, match="kernel must be None, 'simdgroup' or 'shuffle'"):
        tsm.block_sparse_linear(x, crow, col, values, bias, kernel="tiled")


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 9), density=st.floats(0, 1),
       seed=st.integers(0, 2**16))
def test_random_block_patterns_spread_over_the_rows(rows, cols, density, seed):
    from torch_sparse_metal.nn.block_sparse_linear import balanced_block_pattern
    crow, col = balanced_block_pattern(rows, cols, density,
                                       generator=torch.Generator().manual_seed(seed))
    per_row = (crow[1:] - crow[:-1]).tolist()
    assert sum(per_row) == round(density * rows * cols) == col.numel()
    assert max(per_row) - min(per_row) <= 1
    for r in range(rows):
        cells = col[crow[r]:crow[r + 1]].tolist()
        assert cells == sorted(set(cells)) and all(0 <= c < cols for c in cells)
    BSRPattern(crow, col, cols * 8, rows * 8, 8)  # valid
