"""sparse_linear never gives a silently wrong gradient and never reads outside a buffer,
whatever the caller does to the tensors between forward and backward.

* Every tensor backward reads (x, values, the saved activation, indptr, indices and the
  by-source CSR) is saved for backward: an in-place change raises torch's usual error.
* A write torch's version counter does not see (``.data``, ``.numpy()``) is not checked on
  the hot path, which reads nothing back: the kernels make what depends on an index out of
  range NaN and flag it, and ``tsm.check_errors()`` raises for the flags and for every live
  pattern whose arrays no longer match their fingerprint. In strict mode
  (``tsm.check_invariants()``) the fingerprint is checked before each use: a
  ``SparseLinear`` validates and transposes its pattern again (the result follows the
  edit, or a ValueError names what is wrong), a backward after such a write raises a
  ValueError, never garbage.
* The kernels check every index they follow, so even a pattern edited past every check
  (a crafted fingerprint collision) makes outputs NaN, never an access outside a buffer:
  the suite runs sanitized, where such an access is a KernelFault.
"""
from __future__ import annotations

import sys

import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.nn import SparseLinear
from torch_sparse_metal.ops import CSRPattern, sparse_linear_pattern
from torch_sparse_metal.reference import sparse_linear_reference

sl = sys.modules["torch_sparse_metal.ops.sparse_linear"]

INPLACE = "modified by an inplace operation"


@pytest.fixture(autouse=True)
def emulator():
    with tsm.use_backend("emulator"):
        yield


@pytest.fixture
def strict():
    with tsm.check_invariants():
        yield


STALE = "its index arrays were written since it was validated, bypassing torch's version counter"
NAN_FLAGGED = "sparse_linear met an index-array entry outside its range"


def problem(seed=0, dtype=torch.float64, activation=None):
    """A 5 -> 4 layer with an empty row and a repeated column, batch 3, all leaves."""
    g = torch.Generator().manual_seed(seed)
    indptr = torch.tensor([0, 2, 2, 5, 7], dtype=torch.int32)
    indices = torch.tensor([0, 3, 1, 2, 4, 0, 0], dtype=torch.int32)
    x = torch.randn(3, 5, generator=g, dtype=dtype, requires_grad=True)
    values = torch.randn(7, generator=g, dtype=dtype, requires_grad=True)
    bias = torch.randn(4, generator=g, dtype=dtype, requires_grad=True)
    return indptr, indices, x, values, bias


def reference_grads(indptr, indices, x, values, bias, activation=None):
    leaves = [t.detach().clone().requires_grad_() for t in (x, values, bias)]
    y = sparse_linear_reference(leaves[0], indptr, indices, leaves[1], leaves[2],
                                activation=activation)
    y.sum().backward()
    return y.detach(), [t.grad for t in leaves]


# ---- in-place changes torch can see ----------------------------------------------------
@pytest.mark.parametrize("target", ["indptr", "indices", "x", "values"])
def test_functional_in_place_change_before_backward_raises(target):
    indptr, indices, x, values, bias = problem()
    y = tsm.sparse_linear(x, indptr, indices, values, bias)
    with torch.no_grad():
        tensors = dict(indptr=indptr, indices=indices, x=x, values=values)
        tensors[target].copy_(tensors[target].flip(0))
    with pytest.raises(RuntimeError, match=INPLACE):
        y.sum().backward()


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_in_place_change_of_the_output_saved_for_the_activation_raises(activation):
    indptr, indices, x, values, bias = problem()
    y = tsm.sparse_linear(x, indptr, indices, values, bias, activation=activation)
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match=INPLACE):
        y.sum().backward()


@pytest.mark.parametrize("buffer", ["indptr", "indices", "src_indptr", "src_rows", "src_perm"])
def test_module_in_place_change_of_an_index_buffer_before_backward_raises(buffer):
    layer = SparseLinear(6, 5, density=0.5, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    y = layer(torch.randn(3, 6, dtype=torch.float64))
    t = getattr(layer, buffer)
    t.copy_(t)  # the same values: what matters is that torch saw a write
    with pytest.raises(RuntimeError, match=INPLACE):
        y.sum().backward()


def test_int64_indices_are_copied_so_later_changes_do_not_matter():
    indptr, indices, x, values, bias = problem()
    indices64 = indices.long()
    y = tsm.sparse_linear(x, indptr, indices64, values, bias)
    _, expected = reference_grads(indptr, indices, x, values, bias)
    indices64.copy_(indices64.flip(0))  # the kernels hold an int32 copy
    y.sum().backward()
    for got, want in zip((x.grad, values.grad, bias.grad), expected):
        torch.testing.assert_close(got, want)


# ---- writes torch cannot see: strict mode -------------------------------------------------
@pytest.mark.parametrize("how", ["data", "numpy"])
@pytest.mark.parametrize("target, value", [("indices", 99), ("indices", 2), ("indptr", 1)])
def test_functional_write_bypassing_the_version_counter_before_backward(strict, how, target,
                                                                         value):
    indptr, indices, x, values, bias = problem()
    y = tsm.sparse_linear(x, indptr, indices, values, bias)
    tensor = dict(indptr=indptr, indices=indices)[target]
    (tensor.data if how == "data" else tensor.numpy())[1] = value
    with pytest.raises(ValueError, match="^sparse_linear backward: the pattern's index arrays "
                                         "were written since it was validated, bypassing "
                                         "torch's version counter"):
        y.sum().backward()
    assert x.grad is None and values.grad is None


def test_module_out_of_range_write_through_data_is_a_clear_error(strict):
    layer = SparseLinear(6, 5, density=0.5, generator=torch.Generator().manual_seed(0))
    layer(torch.randn(2, 6))
    layer.indices.data[0] = 99
    with pytest.raises(ValueError, match=r"^SparseLinear: indices must lie in \[0, in_features\) "
                                         r"= \[0, 6\), found 99$"):
        layer(torch.randn(2, 6))
    layer.indices.data[0] = -1
    with pytest.raises(ValueError, match="found -1"):
        layer(torch.randn(2, 6))
    layer.indptr.numpy()[2] = 100
    with pytest.raises(ValueError, match="indptr must not decrease"):
        layer(torch.randn(2, 6))


def edit_in_range(layer, how):
    view = layer.indices.data if how == "data" else layer.indices.numpy()
    view[0] = (int(view[0]) + 1) % 6
    view[-1] = (int(view[-1]) + 2) % 6


def assert_layer_matches_reference(layer, x):
    x.grad = None
    layer.zero_grad()
    y = layer(x)
    expected, (gx, gw, gb) = reference_grads(layer.indptr, layer.indices, x, layer.weight,
                                             layer.bias)
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(layer.weight.grad, gw)
    torch.testing.assert_close(layer.bias.grad, gb)


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_module_valid_write_bypassing_the_version_counter_is_followed(strict, how):
    layer = SparseLinear(6, 5, density=0.5, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    layer(x)  # the pattern is validated and transposed
    edit_in_range(layer, how)
    assert_layer_matches_reference(layer, x)
    assert torch.equal(layer.src_perm, layer.pattern().by_source().perm)


@pytest.mark.parametrize("buffer", ["src_indptr", "src_rows", "src_perm"])
def test_module_rebuilds_a_by_source_buffer_written_behind_its_back(strict, buffer):
    layer = SparseLinear(6, 5, density=0.5, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    good = [t.clone() for t in (layer.src_indptr, layer.src_rows, layer.src_perm)]
    getattr(layer, buffer).numpy()[:] = 10**6  # far outside every buffer
    y = layer(x)
    y.sum().backward()
    _, (gx, gw, gb) = reference_grads(layer.indptr, layer.indices, x, layer.weight, layer.bias)
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(layer.weight.grad, gw)
    for now, before in zip((layer.src_indptr, layer.src_rows, layer.src_perm), good):
        assert torch.equal(now, before)


@pytest.mark.parametrize("buffer", ["indices", "src_perm"])
def test_module_write_through_data_between_forward_and_backward_raises(strict, buffer):
    layer = SparseLinear(6, 5, density=0.5, generator=torch.Generator().manual_seed(0))
    y = layer(torch.randn(3, 6))
    getattr(layer, buffer).data[0] = 10**6
    with pytest.raises(ValueError, match="^sparse_linear backward: the pattern's index arrays "
                                         "were written"):
        y.sum().backward()


def test_a_held_pattern_written_behind_its_back_is_refused(strict):
    indptr, indices, x, values, bias = problem()
    pattern = CSRPattern(indptr, indices, 5)
    sparse_linear_pattern(x, pattern, values, bias)
    indices.numpy()[0] = 4
    with pytest.raises(ValueError, match="^sparse_linear: the pattern's index arrays were "
                                         "written.*; build a new CSRPattern from them$"):
        sparse_linear_pattern(x, pattern, values, bias)
    assert pattern.changed()
    fresh = CSRPattern(indptr, indices, 5)
    assert not fresh.changed()
    torch.testing.assert_close(sparse_linear_pattern(x, fresh, values, bias),
                               sparse_linear_reference(x, indptr, indices, values, bias))


# ---- writes torch cannot see: the default, with no read-back -----------------------------
@pytest.mark.parametrize("how", ["data", "numpy"])
@pytest.mark.parametrize("target, value", [("indices", 99), ("indices", 2), ("indptr", 1)])
def test_functional_backward_after_a_hidden_write_is_the_forwards_gradient(how, target, value):
    """The backward reads the by-source CSR the forward built, never the edited arrays: its
    gradients are those of the output the forward computed."""
    indptr, indices, x, values, bias = problem()
    _, expected = reference_grads(indptr, indices, x, values, bias)
    y = tsm.sparse_linear(x, indptr, indices, values, bias)
    tensor = dict(indptr=indptr, indices=indices)[target]
    (tensor.data if how == "data" else tensor.numpy())[1] = value
    y.sum().backward()
    for got, want in zip((x.grad, values.grad, bias.grad), expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("target, value", [("indices", 99), ("indices", -1), ("indptr", 100)])
def test_module_out_of_range_hidden_write_is_nan_and_flagged(target, value):
    layer = SparseLinear(6, 5, density=0.5, generator=torch.Generator().manual_seed(0))
    layer(torch.randn(2, 6))
    tsm.check_errors()
    getattr(layer, target).numpy()[2] = value
    with tsm.syncs.watch() as syncs:
        y = layer(torch.randn(2, 6))
    assert not syncs.events, syncs.report()
    assert torch.isnan(y).any()
    with pytest.raises(tsm.InvalidInputError, match=NAN_FLAGGED + ".*" + STALE):
        tsm.check_errors()
    with pytest.raises(ValueError, match="^SparseLinear: (indices|indptr)"):
        layer.pattern()   # validates again


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_module_valid_hidden_write_is_found_by_check_errors(how):
    """An edit that stays in range: the forward follows it, the backward's transpose is
    stale until the next check_errors() says so; pattern() then brings the layer up to
    date."""
    layer = SparseLinear(6, 5, density=0.5, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    layer(x)
    tsm.check_errors()
    edit_in_range(layer, how)
    with pytest.raises(tsm.InvalidInputError, match=r"CSRPattern\(out_features=5, "
                                                    r"in_features=6.*" + STALE):
        tsm.check_errors()
    layer.pattern()
    tsm.check_errors()
    assert_layer_matches_reference(layer, x)


@pytest.mark.parametrize("buffer", ["src_indptr", "src_rows", "src_perm"])
def test_module_by_source_buffer_written_behind_its_back_is_nan_and_flagged(buffer):
    layer = SparseLinear(6, 5, density=0.5, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    getattr(layer, buffer).numpy()[:] = 10**6
    layer(x).sum().backward()
    assert torch.isnan(x.grad).any()
    with pytest.raises(tsm.InvalidInputError, match=NAN_FLAGGED):
        tsm.check_errors()
    layer.pattern()
    assert_layer_matches_reference(layer, x)


def test_fingerprint_sees_every_single_change_and_swap():
    a = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    b = torch.tensor([4, 1, 0, 3, 3], dtype=torch.int32)
    base = int(sl._fingerprint((a, b)))
    for j in range(b.numel()):
        for value in (-(2**31), -1, 0, 1, 2, 3, 4, 5, 2**31 - 1):
            if value != int(b[j]):
                changed = b.clone()
                changed[j] = value
                assert int(sl._fingerprint((a, changed))) != base, (j, value)
        for k in range(j + 1, b.numel()):
            if b[j] != b[k]:
                swapped = b.clone()
                swapped[[j, k]] = b[[k, j]]
                assert int(sl._fingerprint((a, swapped))) != base, (j, k)


# ---- the kernels' own bounds checks ------------------------------------------------------
def _collision(pattern: CSRPattern):
    """Edit pattern.indices so that its fingerprint stays the same but two indices leave
    [0, in_features): the weights of entries j and j + 1 are w and w + 2, so adding w + 2 to
    one and subtracting w from the other changes nothing."""
    j = pattern.indptr.numel()  # indices[0] is entry j of (indptr, indices)
    w = 2 * j + 1
    view = pattern.indices.numpy()
    view[0] += w + 2
    view[1] -= w


def test_kernels_survive_a_fingerprint_collision():
    """Past the host's checks (a collision built on purpose), the forward kernel reads no
    index outside [0, in_features): the rows of the bad edges are NaN, the others right,
    and the sanitized dispatch finds no out-of-bounds access."""
    indptr, indices, x, values, bias = problem()
    pattern = CSRPattern(indptr.clone(), indices.clone(), 5)
    expected = sparse_linear_reference(x, indptr, indices, values, bias).detach()
    _collision(pattern)
    assert not pattern.changed()
    y = sl.apply_pattern(x.detach(), pattern, values.detach(), bias.detach())
    bad_rows = [0]  # edges 0 and 1 belong to row 0
    assert torch.isnan(y[:, bad_rows]).all()
    good = [r for r in range(4) if r not in bad_rows]
    torch.testing.assert_close(y[:, good], expected[:, good])


@pytest.mark.parametrize("corrupt", ["src_indptr_decreasing", "src_indptr_past_nnz",
                                     "src_rows", "src_perm", "negative"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_kernels_check_the_by_source_indices(corrupt, deterministic):
    """The backward kernels given a by-source CSR with indices out of range: NaN where they
    were followed, and no access outside a buffer (the dispatch runs sanitized)."""
    indptr, indices, x, values, bias = problem()
    pattern = CSRPattern(indptr, indices, 5)
    src = pattern.by_source()
    grad_out = torch.randn(3, 4, dtype=torch.float64)
    if corrupt == "src_indptr_decreasing":
        src.indptr[2] = 0
        src.indptr[1] = 5
    elif corrupt == "src_indptr_past_nnz":
        src.indptr[-1] = 100
    elif corrupt == "negative":
        src.rows[0] = -3
    else:
        getattr(src, corrupt.split("_")[1])[0] = 10**6
    grad_input, grad_values, grad_bias = sl._backward(
        grad_out, x.detach(), values.detach(), pattern, "emulator", need_input=True,
        need_values=True, need_bias=True, deterministic=deterministic)
    assert torch.isnan(grad_input).any()
    torch.testing.assert_close(grad_bias, grad_out.sum(0))  # reads no index
