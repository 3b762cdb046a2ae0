"""NaN, +Inf, -Inf and -0.0 through every op, as torch has them.

Each op's kernels (on the emulator, sanitized as the whole suite runs) are compared with the
reference backend, and the reference with torch's own op where there is one. "Matches"
means, throughout:

* values: ``torch.testing.assert_close`` with ``equal_nan``, so a NaN where the other has a
  NaN, an infinity of the same sign where the other has one, finite values to the dtype's
  rounding (the tolerances of tests/test_sparse_linear.py);
* the sign of a zero, where a result is one elementwise function of its inputs (an
  activation, its backward, an optimizer update, a softmax gradient): relu(-0.0) is -0.0,
  relu's backward at -0.0 is +0.0, as torch's. Not where a zero is a sum: whether a sum of
  -0.0 terms is -0.0 depends on where the sum starts, and torch disagrees with itself
  there (float32 addmm of -0.0 products onto a -0.0 bias is -0.0 at 4 x 8 x 4 and +0.0 at
  64 x 64 x 64 on the CPU; F.linear gives +0.0 at both);
* a sum holding +Inf and -Inf is NaN in any order, so the kernels' summation orders need
  not be torch's; the inputs stay far from overflow, where a finite sum would be Inf in
  some orders only.

The tests plant the values at random places in one input (the site) and, where the inputs
are not just -0.0, check that something non-finite came out and something finite: an
all-NaN result would match anything.
"""
from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_sparse_metal as tsm
from torch_sparse_metal._activations import ACTIVATION_CODES
from torch_sparse_metal._paths import SHADERS_DIR
from torch_sparse_metal.emulator import compile_shader
from torch_sparse_metal.nn import functional as tsmF
from torch_sparse_metal.ops import kmeans as K
from torch_sparse_metal.ops.matmul import KERNELS
from torch_sparse_metal.ops.sparse_linear import CSRPattern, apply_pattern
from torch_sparse_metal.reference.activations import activation_backward_reference
from test_sparse_linear import TOL, grads_of, make_pattern, make_tensors
from test_sparse_linear_safety import _collision, problem

# torch's CSR tensors are in beta, and their checks off by default: each says so once.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse:UserWarning")

NAN, INF = float("nan"), float("inf")
SPECIALS = (NAN, INF, -INF, -0.0)
DTYPES = [torch.float32, torch.float64]
ACTIVATIONS = [None, "relu", "gelu", "tanh"]
# torch's own functions, the oracle of the reference's activations.
TORCH_ACTIVATION = {None: lambda z: z, "relu": torch.relu, "tanh": torch.tanh,
                    "gelu": functools.partial(F.gelu, approximate="tanh")}


def planted(t, seed, specials=SPECIALS):
    """A copy of ``t`` with ``specials`` (as many as fit) at distinct random places."""
    t = t.clone()
    flat = t.view(-1)
    specials = specials[:flat.numel()]
    where = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))
    flat[where[:len(specials)]] = torch.tensor(specials, dtype=t.dtype)
    return t


def assert_matches(got, want, dtype, *, zero_signs=False):
    """``got`` matches ``want`` as the module's docstring says (``zero_signs``: a zero of
    ``want`` is a zero of the same sign in ``got``)."""
    if got is None or want is None:
        assert got is None and want is None
        return
    if dtype in TOL:
        tol = TOL[dtype]
    else:
        # float16 and bfloat16: the reference rounds each d loss / d z to the type before its
        # sums (torch's tanh and gelu backward on such tensors do), the kernels keep it in
        # float32: each of a sum's terms (at most SL_IN here) may differ by u = eps / 2
        # relative, on top of each side's own rounding.
        finite = want[torch.isfinite(want)].double().abs()
        scale = float(finite.max()) if finite.numel() else 0.0
        tol = dict(rtol=torch.finfo(dtype).eps, atol=SL_IN * torch.finfo(dtype).eps * scale)
    torch.testing.assert_close(got.double(), want.double(), equal_nan=True, **tol)
    if zero_signs:
        zeros = want == 0
        assert torch.equal(torch.signbit(got[zeros]), torch.signbit(want[zeros])), \
            (got[zeros], want[zeros])


def assert_all_match(got, want, dtype, **kw):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        try:
            assert_matches(a, b, dtype, **kw)
        except AssertionError as e:
            raise AssertionError(f"result {i}: {e}") from None


def assert_reached(results):
    """The planted values made something non-finite, and not everything."""
    results = [r for r in results if r is not None and r.is_floating_point()]
    assert any(not bool(torch.isfinite(r).all()) for r in results), "nothing non-finite"
    assert any(bool(torch.isfinite(r).any()) for r in results), "nothing finite"


def on_backends(run):
    """``run()`` on the emulator, then on the reference backend."""
    out = []
    for backend in ("emulator", "reference"):
        with tsm.use_backend(backend):
            out.append(run())
    return out


def forward_and_grads(fn, inputs, grad):
    """``[fn(*inputs), then d(fn . grad) / d input for each input]`` (None stays None)."""
    ins = [t.clone().requires_grad_() if t is not None else None for t in inputs]
    y = fn(*ins)
    return [y.detach()] + grads_of(y, ins, grad)


# ---------------------------------------------------------------------------------------
# The activations every kernel fuses (shaders/activations.h), on every special value

PROBE = r"""
#include "activations.h"
#include "tsm_common.h"
// Thread i: y = act(z) and d loss / d z for d loss / d y = g, from what the kernels save
// (y for relu and tanh, z for gelu).
template <typename T>
kernel void probe(device const T* z [[buffer(0)]], device const T* g [[buffer(1)]],
                  device T* y [[buffer(2)]], device T* dz [[buffer(3)]],
                  constant uint& activation [[buffer(4)]], uint i [[thread_position_in_grid]]) {
  y[i] = tsm_activate(z[i], activation);
  const T saved = activation == TSM_ACT_GELU_TANH ? z[i] : y[i];
  dz[i] = tsm_activation_backward(g[i], saved, activation);
}
TSM_INSTANTIATE_KERNEL("probe_float", probe, float)
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("probe_double", probe, double))
"""
# 1e30 ** 3 overflows float32 inside GELU's tanh argument; -1e30 makes GELU a -0.0.
PROBE_Z = (NAN, INF, -INF, -0.0, 0.0, 1.5, -1.5, 20.0, -20.0, 1e30, -1e30)
PROBE_G = (1.0, 2.5, -0.0, 0.0, INF, -INF, NAN)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_and_its_backward_as_torch(activation, dtype):
    """Each value against each incoming gradient: torch.relu keeps NaN and -0.0, and its
    backward (threshold_backward) passes the gradient where the output is not <= 0 (NaN
    included) and gives 0 elsewhere, an infinite gradient too, where a product would be NaN."""
    z = torch.tensor(PROBE_Z, dtype=dtype).repeat_interleave(len(PROBE_G))
    g = torch.tensor(PROBE_G, dtype=dtype).repeat(len(PROBE_Z))
    lib = compile_shader(PROBE, include_dirs=[str(SHADERS_DIR)], sanitize=True)
    y, dz = torch.empty_like(z), torch.empty_like(z)
    code = ACTIVATION_CODES[activation]
    lib["probe_" + ("float" if dtype == torch.float32 else "double")](
        z, g, y, dz, np.uint32(code), threads=z.numel(), group_size=32)
    leaf = z.clone().requires_grad_()
    want_y = TORCH_ACTIVATION[activation](leaf)
    (want_dz,) = torch.autograd.grad(want_y, leaf, g)
    assert_matches(y, want_y.detach(), dtype, zero_signs=True)
    assert_matches(dz, want_dz, dtype, zero_signs=True)
    saved = z if activation == "gelu" else want_y.detach()
    assert_matches(activation_backward_reference(g, saved, activation), want_dz, dtype,
                   zero_signs=True)


# ---------------------------------------------------------------------------------------
# sparse_linear, nn.SparseLinear, spmm

SL_ROWS = [[0, 1], [2, 3, 4], [], [5, 0, 0], [1, 2, 3, 4, 5]]  # an empty row, a repeat
SL_IN = 6
# batch, deterministic: the kernels apply_pattern picks (lanes_along_batch).
SL_PATHS = {"lane-per-element": (1, False), "batch-lanes": (5, False),
            "deterministic": (5, True)}
SL_SITES = ("input", "values", "bias", "grad")


def sparse_linear_problem(site, dtype, batch, seed=0):
    indptr, indices = make_pattern(SL_ROWS)
    x, values, bias, grad = make_tensors((batch,), SL_IN, indptr, indices, True, dtype, seed)
    t = dict(input=x, values=values, bias=bias, grad=grad)
    # Twice as many in the gradient: relu's backward turns those where the output is 0 into 0.
    t[site] = planted(t[site], seed, SPECIALS * (2 if site == "grad" else 1))
    return indptr, indices, t


@pytest.mark.parametrize("path", SL_PATHS)
@pytest.mark.parametrize("site", SL_SITES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16, torch.bfloat16])
def test_sparse_linear(path, site, activation, dtype):
    batch, deterministic = SL_PATHS[path]
    indptr, indices, t = sparse_linear_problem(site, dtype, batch)
    fn = functools.partial(tsm.sparse_linear, activation=activation, deterministic=deterministic)
    got, want = on_backends(lambda: forward_and_grads(
        lambda x, v, b: fn(x, indptr, indices, v, b), (t["input"], t["values"], t["bias"]),
        t["grad"]))
    assert_all_match(got, want, dtype)
    assert_reached(want)


@pytest.mark.parametrize("site", ("input", "values", "bias"))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_linear_reference_is_torch_sparse_mm(site, activation, dtype):
    """A product absent from the pattern is not a 0 * NaN: the reference skips it as
    torch.sparse.mm does (a dense x @ W.T would make the whole row NaN)."""
    indptr, indices, t = sparse_linear_problem(site, dtype, 3)
    weight = torch.sparse_csr_tensor(indptr.long(), indices.long(), t["values"],
                                     (len(SL_ROWS), SL_IN))
    with tsm.use_backend("reference"):
        got = forward_and_grads(lambda x, b: tsm.sparse_linear(
            x, indptr, indices, t["values"], b, activation=activation),
            (t["input"], t["bias"]), t["grad"])
    want = forward_and_grads(lambda x, b: TORCH_ACTIVATION[activation](
        torch.sparse.mm(weight, x.T).T + b), (t["input"], t["bias"]), t["grad"])
    assert_all_match(got, want, dtype)
    assert_reached(want)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_linear_module(activation, dtype):
    g = torch.Generator().manual_seed(3)
    layer = tsm.nn.SparseLinear(SL_IN, 5, density=0.5, activation=activation, dtype=dtype,
                                generator=g)
    with torch.no_grad():
        layer.weight.copy_(planted(layer.weight, 1, (NAN, -0.0)))
        layer.bias.copy_(planted(layer.bias, 2, (INF,)))
    x = planted(torch.randn(4, SL_IN, generator=g, dtype=dtype), 3, (-INF, -0.0))

    def run():
        module = copy.deepcopy(layer)
        y = module(x)
        y.backward(torch.ones_like(y))
        return [y.detach(), module.weight.grad, module.bias.grad]
    got, want = on_backends(run)
    assert_all_match(got, want, dtype)
    assert_reached(want)


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh"])
def test_corrupted_pattern_nan_survives_the_activation(activation):
    """The NaN the forward kernel writes for a pattern edited past every host check
    (tests/test_sparse_linear_safety.py) reaches the output through the activation."""
    indptr, indices, x, values, bias = problem()
    pattern = CSRPattern(indptr.clone(), indices.clone(), 5)
    _collision(pattern)
    with tsm.use_backend("emulator"):
        y = apply_pattern(x.detach(), pattern, values.detach(), bias.detach(),
                          activation=activation)
    assert torch.isnan(y[:, 0]).all()  # row 0 holds the edited edges
    assert torch.isfinite(y[:, 1:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_linear_without_edges_relu_backward(dtype):
    """nnz = 0 takes a plain-torch path for grad_bias (ops/sparse_linear.py, _backward)."""
    indptr = torch.zeros(5, dtype=torch.int32)
    indices = torch.zeros(0, dtype=torch.int32)
    bias = torch.tensor([-1.0, 2.0, -3.0, 0.5], dtype=dtype)
    x = torch.randn(3, 4, dtype=dtype)
    grad = planted(torch.ones(3, 4, dtype=dtype), 0, (INF, -INF, NAN, INF))
    got, want = on_backends(lambda: forward_and_grads(
        lambda b: tsm.sparse_linear(x, indptr, indices, x.new_empty(0), b, activation="relu"),
        (bias,), grad))
    assert_all_match(got, want, dtype)


SPMM_ROWS = [[0, 1], [2, 3, 4], [], [5, 0], [1, 2, 3, 4, 5]]


@pytest.mark.parametrize("columns", [2, 5])  # the sparse layer's batch: both kernel paths
@pytest.mark.parametrize("site", ["sparse", "dense", "grad"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_spmm(columns, site, dtype):
    g = torch.Generator().manual_seed(columns)
    indptr, indices = make_pattern(SPMM_ROWS, torch.int64)
    t = dict(sparse=torch.randn(len(indices), generator=g, dtype=dtype),
             dense=torch.randn(SL_IN, columns, generator=g, dtype=dtype),
             grad=torch.randn(len(SPMM_ROWS), columns, generator=g, dtype=dtype))
    t[site] = planted(t[site], columns)

    def product(mm):
        a = torch.sparse_csr_tensor(indptr, indices, t["sparse"].clone(),
                                    (len(SPMM_ROWS), SL_IN), requires_grad=True)
        b = t["dense"].clone().requires_grad_()
        y = mm(a, b)
        y.backward(t["grad"])
        return [y.detach(), b.grad, a.grad.values()]
    got, want = on_backends(lambda: product(tsm.spmm))
    assert_all_match(got, want, dtype)
    assert_all_match(want, product(torch.sparse.mm), dtype)
    assert_reached(want)


# ---------------------------------------------------------------------------------------
# mm, addmm, nn.Linear: every rung, every epilogue

MM_SHAPE = (5, 40, 6)  # k past one step along K of every rung


def mm_operands(site, dtype, seed=0):
    m, k, n = MM_SHAPE
    g = torch.Generator().manual_seed(seed)
    t = dict(a=torch.randn(m, k, generator=g, dtype=dtype),
             b=torch.randn(k, n, generator=g, dtype=dtype),
             bias=torch.randn(n, generator=g, dtype=dtype),
             grad=torch.randn(m, n, generator=g, dtype=dtype))
    t[site] = planted(t[site], seed)
    return t


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("site", ["a", "b", "grad"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mm(kernel, site, dtype):
    t = mm_operands(site, dtype)
    got, want = on_backends(lambda: forward_and_grads(
        lambda a, b: tsm.mm(a, b, kernel=kernel), (t["a"], t["b"]), t["grad"]))
    assert_all_match(got, want, dtype)
    assert_all_match(want, forward_and_grads(torch.mm, (t["a"], t["b"]), t["grad"]), dtype)
    assert_reached(want)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("site", ["a", "b", "bias", "grad"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_addmm(kernel, site, activation, dtype):
    t = mm_operands(site, dtype)
    got, want = on_backends(lambda: forward_and_grads(
        lambda bias, a, b: tsm.addmm(bias, a, b, activation=activation, kernel=kernel),
        (t["bias"], t["a"], t["b"]), t["grad"]))
    assert_all_match(got, want, dtype)
    torch_op = forward_and_grads(lambda bias, a, b: TORCH_ACTIVATION[activation](a @ b + bias),
                                 (t["bias"], t["a"], t["b"]), t["grad"])
    assert_all_match(want, torch_op, dtype)
    assert_reached(want)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("site", ["a", "b", "bias", "grad"])  # a: input, b: weight.T
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_module(kernel, site, dtype):
    t = mm_operands(site, dtype)
    m, k, n = MM_SHAPE
    layer = tsm.nn.Linear(k, n, kernel=kernel, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(t["b"].T)
        layer.bias.copy_(t["bias"])

    def run(module):
        module = copy.deepcopy(module)
        x = t["a"].clone().requires_grad_()
        y = module(x)
        y.backward(t["grad"])
        return [y.detach(), x.grad, module.weight.grad, module.bias.grad]
    got, want = on_backends(lambda: run(layer))
    assert_all_match(got, want, dtype)
    torch_layer = torch.nn.Linear(k, n, dtype=dtype)
    torch_layer.load_state_dict(layer.state_dict())
    assert_all_match(want, run(torch_layer), dtype)
    assert_reached(want)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_addmm_scale_zero(kernel, dtype):
    """beta = 0 ignores the bias, NaNs and all, as torch.addmm documents; alpha = 0 does not
    ignore a @ b: the kernels scale the product (0 * inf is NaN), as torch's half and
    bfloat16 addmm do, where its float32 and float64 BLAS skip the product. Gradients as
    torch's formulas give them: the bias's is beta * grad, a's alpha * grad @ b.T."""
    t = mm_operands("a", dtype)
    bias = planted(t["bias"], 1, (NAN, INF))
    grad = planted(t["grad"], 2, (NAN,))
    for alpha, beta in ((1.0, 0.0), (0.0, 1.0), (0.0, 0.0)):
        def fn(bias, a, b):
            return tsm.addmm(bias, a, b, alpha=alpha, beta=beta, kernel=kernel)
        got, want = on_backends(lambda: forward_and_grads(fn, (bias, t["a"], t["b"]), grad))
        assert_all_match(got, want, dtype)
        scaled = forward_and_grads(lambda bias, a, b: (
            alpha * (a @ b) + (beta * bias if beta else 0)), (bias, t["a"], t["b"]), grad)
        if not beta:
            scaled[1] = grad.sum(0) * 0.0  # torch.addmm's bias gradient: (grad * beta) summed
        assert_all_match(want, scaled, dtype)
        assert_reached(want)


# ---------------------------------------------------------------------------------------
# cross_entropy

CE_LABEL = 2  # of the planted row; 5 classes
CE_ROWS = {
    "nan": {0: NAN}, "nan-at-label": {CE_LABEL: NAN},
    "inf": {0: INF}, "inf-at-label": {CE_LABEL: INF},
    "-inf": {0: -INF, 4: -INF}, "-inf-at-label": {CE_LABEL: -INF},
    "all--inf": {c: -INF for c in range(5)}, "-0.0": {c: -0.0 for c in range(5)},
    "ignored-nan": {1: NAN, 3: INF},
}
CE_FINITE_ROWS = ("-inf", "-0.0")  # an exp that is 0, and the signs of zeros


def cross_entropy_problem(row, dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, generator=g, dtype=dtype)
    labels = torch.tensor([0, CE_LABEL, 4, 1])
    for c, v in CE_ROWS[row].items():
        logits[1, c] = v
    if row == "ignored-nan":
        labels[1] = -100
    return logits, labels


@pytest.mark.parametrize("row", CE_ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy(row, dtype):
    logits, labels = cross_entropy_problem(row, dtype)

    def run(fn):
        x = logits.clone().requires_grad_()
        loss = fn(x, labels)
        loss.backward()
        return [loss.detach(), x.grad]
    got, want = on_backends(lambda: run(tsmF.cross_entropy))
    assert_all_match(got, want, dtype, zero_signs=True)
    assert_all_match(want, run(F.cross_entropy), dtype, zero_signs=True)
    if row in CE_FINITE_ROWS:
        assert all(bool(torch.isfinite(r).all()) for r in want)
    else:
        assert_reached(want)


@pytest.mark.parametrize("upstream", [2.5, -0.0, INF, NAN])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_upstream_gradient(upstream, dtype):
    """The fused kernel saves d loss / d logits; its backward chains torch's two steps
    (nll_loss's, log_softmax's) rather than scaling it by the loss's gradient, which for an
    infinite or NaN upstream gradient would give -inf at the label (torch: NaN, -inf + inf)
    and NaN in ignored rows (torch: 0, not 0 * inf)."""
    logits, labels = cross_entropy_problem("-inf", dtype)
    labels[3] = -100

    def run(fn):
        x = logits.clone().requires_grad_()
        fn(x, labels).backward(torch.tensor(upstream, dtype=dtype))
        return [x.grad]
    got, want = on_backends(lambda: run(tsmF.cross_entropy))
    assert_all_match(got, want, dtype)
    assert_all_match(want, run(F.cross_entropy), dtype)


# ---------------------------------------------------------------------------------------
# AdamW

ADAMW_OPTIONS = {"default": {}, "amsgrad": dict(amsgrad=True), "maximize": dict(maximize=True),
                 "no-decay": dict(weight_decay=0.0)}


@pytest.mark.parametrize("site", ["grad", "param"])
@pytest.mark.parametrize("options", ADAMW_OPTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_adamw(site, options, dtype):
    """Two steps, the specials in the first step's gradients or in the parameters; the
    second step's gradients are finite, so a NaN or inf kept in a state shows there
    (amsgrad's running maximum: torch.maximum keeps a NaN, where Metal's max drops it)."""
    kwargs = dict(lr=1e-2, **ADAMW_OPTIONS[options])
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 11, generator=g, dtype=dtype), torch.randn(7, generator=g,
                                                                        dtype=dtype)]
    grads = [[torch.randn(p.shape, generator=g, dtype=dtype) for p in params] for _ in range(2)]
    if site == "param":
        params = [planted(p, i) for i, p in enumerate(params)]
    else:
        grads[0] = [planted(q, i) for i, q in enumerate(grads[0])]

    def run(optimizer):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        opt = optimizer(ps, **kwargs)
        for step in grads:
            for p, q in zip(ps, step):
                p.grad = q.clone()
            opt.step()
        return [p.detach().clone() for p in ps] + [
            opt.state[p][key].clone() for p in ps
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if key in opt.state[p]]
    got, want = on_backends(lambda: run(tsm.optim.AdamW))
    assert_all_match(got, want, dtype, zero_signs=True)
    torch_adamw = functools.partial(torch.optim.AdamW, foreach=False)
    assert_all_match(want, run(torch_adamw), dtype, zero_signs=True)
    assert_reached(want)


# ---------------------------------------------------------------------------------------
# k-means: the functions of tsm.ops.kmeans, and tsm.KMeans
#
# Distances are the expanded ||x||^2 - 2 x.c + ||c||^2 (the reference's form, no torch op
# computes it), clamped at 0 as torch.clamp_min does: a NaN stays NaN, so inf - inf there is
# NaN where the direct ||x - c||^2 would be inf. The nearest centroid follows torch.min and
# torch.argmin: NaN is below every number, and the first NaN of a row wins (they propagate
# NaN), the lowest index among equal distances otherwise; torch.minimum and torch.max
# propagate NaN too (k-means++ distances, drift).


def kmeans_problem(site, special, dtype):
    g = torch.Generator().manual_seed(0)
    t = dict(x=torch.randn(40, 5, generator=g, dtype=dtype),  # 40 points: two SIMD-groups
             centroids=torch.randn(6, 5, generator=g, dtype=dtype))
    t[site] = planted(t[site], 1, (special,) * 3)
    return t["x"], t["centroids"]


@pytest.mark.parametrize("site", ["x", "centroids"])
@pytest.mark.parametrize("special", SPECIALS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kmeans_distances_and_assignment(site, special, dtype):
    x, c = kmeans_problem(site, special, dtype)

    def run():
        dist = K.distances(x, c)
        min_in = K.sq_norms(x)  # any finite distances
        return [K.sq_norms(x), K.sq_norms(c), dist, *K.assign(x, c),
                *K.assign_from_distances(dist), K.pp_update(x, c[3], min_in),
                K.pp_update(x, c[0], planted(min_in, 2, (NAN,))),
                *K.assign_one(x[0], c), *K.assign_one(x[7], c), *K.assign_one(x[33], c)]
    got, want = on_backends(run)
    for i, (a, b) in enumerate(zip(got, want)):
        if not a.is_floating_point():
            assert torch.equal(a, b), f"result {i}: {a} != {b}"
    assert_all_match(got, want, dtype)
    dist, labels, min_dist = want[2:5]
    assert torch.equal(labels.long(), torch.argmin(dist, dim=1))
    assert_matches(min_dist, torch.min(dist, dim=1).values, dtype)
    if special != 0:
        assert_reached(want)


@pytest.mark.parametrize("nan_rows", [(5, 290), (290,)], ids=["nan-first-low", "nan-only-high"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kmeans_nearest_of_many_centroids(nan_rows, dtype):
    """300 centroids, six distinct ones repeated (ties: the lowest index), one with an inf
    and one with a -0.0 coordinate: a thread of kmeans_assign_one compares two (j and
    j + 256) before the tree, and kmeans_assign reads a row 64 floats at a time. The first
    NaN wins wherever it lies."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, generator=g, dtype=dtype)
    repeats = torch.randn(6, 5, generator=g, dtype=dtype).repeat(50, 1)
    c = repeats.clone()
    c[3, 1] = INF
    c[nan_rows, 2] = NAN
    c[7, 0] = -0.0

    def run():
        return [*K.assign(x, c), *K.assign_one(x[0], c), *K.assign_one(x[9], c)]
    got, want = on_backends(run)
    # inf - inf: the expanded distance to centroid 3 is NaN where x[:, 1] > 0 (the direct
    # one of kmeans_assign_one is inf).
    assert want[0].tolist() == [3 if v > 0 else nan_rows[0] for v in x[:, 1].tolist()]
    assert want[2].item() == want[4].item() == nan_rows[0]
    for a, b in zip(got, want):
        assert_matches(a, b, dtype)
    with tsm.use_backend("emulator"):  # ties among the repeats: the first
        assert K.assign(x, repeats)[0].max() < 6 and K.assign_one(x[9], repeats)[0] < 6


@pytest.mark.parametrize("mode", ["atomic", "cas", "deterministic"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kmeans_accumulate_and_update(mode, dtype):
    if mode == "cas" and dtype == torch.float64:
        pytest.skip("the compare-and-swap accumulation is float32 only")
    g = torch.Generator().manual_seed(0)
    k = 6
    x = planted(torch.randn(300, 5, generator=g, dtype=dtype), 1)
    # Cluster k - 1 stays empty: finalize keeps its old centroid, specials and all.
    labels = torch.randint(0, k - 1, (300,), generator=g, dtype=torch.int32)
    old = planted(torch.randn(k, 5, generator=g, dtype=dtype), 2)
    counts = torch.randint(0, 9, (k,), generator=g, dtype=torch.int32)

    def run():
        sums, batch_counts = K.accumulate(x, labels, k, mode=mode)
        new = K.finalize(sums, batch_counts, old)
        return [sums, batch_counts, new, *K.drift_and_norms(old, new),
                *K.update_affected(old, counts, sums, batch_counts)]
    got, want = on_backends(run)
    assert torch.equal(got[1], want[1]) and torch.equal(got[-1], want[-1])
    assert_all_match(got, want, dtype)
    assert_reached(want)


@pytest.mark.parametrize("special", [NAN, INF, -INF])
def test_kmeans_estimator(special):
    """tsm.KMeans refuses non-finite points, as scikit-learn does, on every backend; centroids
    loaded with one predict, transform and score alike on both."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, generator=g)
    bad = planted(x, 1, (special,))
    centers = planted(torch.randn(4, 3, generator=g), 2, (special,))

    def run():
        for method in ("fit", "partial_fit"):
            with pytest.raises(ValueError, match="NaN or infinity"):
                getattr(tsm.KMeans(4, seed=0), method)(bad)
        km = tsm.KMeans(4)
        km.load_state_dict({"cluster_centers_": centers})
        with pytest.raises(ValueError, match="NaN or infinity"):
            km.predict(bad)
        return [km.predict(x), km.transform(x), torch.tensor(km.score(x)),
                torch.tensor(km.assign(x[5]))]
    got, want = on_backends(run)
    assert torch.equal(got[0], want[0]) and torch.equal(got[3], want[3])
    assert_all_match(got[1:3], want[1:3], torch.float32)
    assert_reached(want)
