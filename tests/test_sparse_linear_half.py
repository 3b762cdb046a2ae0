"""The sparse layer in float16 and bfloat16: values, activations and outputs in the 2-byte
type, every sum in float32, each result rounded once.

Each result is compared with a float64 computation on the very inputs the kernel read (the
2-byte values, exactly representable in float64), within a bound derived from the types and
the reduction, not tuned: with u the unit roundoff of a type (eps / 2) and
gamma_n = n u32 / (1 - n u32) the worst case of n float32 additions in any order,

    |got - want| <= u_T |want| (1 + ...) + gamma_n * sum |terms|  (+ the activation's part)

for a sum of n terms rounded once to T. A kernel that summed in T instead would be off by
about n u_T sum |terms|; test_the_bound_tells_float32_sums_from_2_byte_sums shows the bound
rejects that on a long row, so these tests can fail.
"""
from __future__ import annotations


import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.emulator import instrumented, record

HALF_TYPES = (torch.float16, torch.bfloat16)
U32 = torch.finfo(torch.float32).eps / 2


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def rounded(dtype: torch.dtype, want: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """The bound on a result within ``off`` of ``want`` before its one rounding to ``dtype``:
    fl(s) = s (1 + d) + e with |d| <= u and |e| <= half the smallest subnormal."""
    finfo = torch.finfo(dtype)
    return unit_roundoff(dtype) * (want.abs() + off) + finfo.smallest_normal * finfo.eps / 2 + off


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def _max_abs_second_derivative_of_gelu() -> float:
    z = torch.linspace(-10, 10, 200_001, dtype=torch.float64, requires_grad=True)
    (d1,) = torch.autograd.grad(torch.nn.functional.gelu(z, approximate="tanh").sum(), z,
                                create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), z)
    return float(d2.abs().max()) * 1.01  # the grid's spacing, generously


GELU_D2 = _max_abs_second_derivative_of_gelu()
# |act(a) - act(b)| <= LIPSCHITZ * |a - b|; gelu' peaks near 1.13 (tanh form).
LIPSCHITZ = {None: 1.0, "relu": 1.0, "tanh": 1.0, "gelu": 1.13}
# float32 operations evaluating the activation or its derivative, each within u32, which
# make the relative error of that evaluation: tanh's derivative 1 - y^2 is 3, gelu's about 12;
# the activation itself counts one more for the library tanh.
ACT_OPS = {None: 0, "relu": 0, "tanh": 4, "gelu": 16}


def _act64(z: torch.Tensor, activation):
    return tsm.reference.activations.apply_activation(z, activation) if activation else z


def _layer(in_features, out_features, density, dtype, activation, seed):
    g = torch.Generator().manual_seed(seed)
    layer = tsm.nn.SparseLinear(in_features, out_features, density=density, generator=g,
                                activation=activation)
    with torch.no_grad():  # outputs of a few units, where 2-byte types have their resolution
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) / 3)
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=g) / 3)
    return layer.to(dtype), g


def _dense64(layer) -> torch.Tensor:
    return layer.to_dense().detach().double()


def _forward_bound(x64, w64, b64, z, y, activation, dtype):
    """The bounds on |y - act(z)| and on |z_T - z|, z the exact pre-activation and z_T the
    kernel's, rounded to T."""
    terms = x64.abs() @ w64.abs().t() + b64.abs()
    n = int((w64 != 0).sum(1).max()) + 1  # the row's edges and the bias
    z_err = gamma(n) * terms
    z_bound = rounded(dtype, z, z_err)
    if activation is None:
        return z_bound, z_bound
    # The activation takes z rounded to T (as torch's linear then activation would).
    act_err = LIPSCHITZ[activation] * z_bound + ACT_OPS[activation] * U32 * (1 + y.abs())
    return rounded(dtype, y, act_err), z_bound


def _derivative(activation, saved64, grad64):
    """d loss / d z from what the kernel saved (y for relu and tanh, z for gelu)."""
    if activation is None:
        return grad64
    return tsm.reference.activations.activation_backward_reference(grad64, saved64, activation)


def _run(layer, x, grad, deterministic):
    x = x.clone().requires_grad_()
    layer.zero_grad()
    layer.deterministic = deterministic
    with tsm.use_backend("emulator"):
        y = layer(x)
        y.backward(grad)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


# (batch, deterministic): the lane-per-row kernels, the batch-lanes kernels, the
# deterministic backward.
MAPPINGS = [(1, False), (37, False), (37, True)]


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("activation", [None, "relu", "tanh", "gelu"])
@pytest.mark.parametrize("batch,deterministic", MAPPINGS)
def test_forward_and_backward_within_the_derived_bound(dtype, activation, batch, deterministic):
    layer, g = _layer(96, 80, 0.3, dtype, activation, seed=batch + 7 * deterministic)
    x = torch.randn(batch, 96, generator=g).to(dtype)
    grad = torch.randn(batch, 80, generator=g).to(dtype)
    y, gx, gw, gb = _run(layer, x, grad, deterministic)
    assert {t.dtype for t in (y, gx, gw, gb)} == {dtype}

    w64, b64, x64, g64 = _dense64(layer), layer.bias.detach().double(), x.double(), grad.double()
    z = x64 @ w64.t() + b64
    y_ref = _act64(z, activation)
    y_bound, z_bound = _forward_bound(x64, w64, b64, z, y_ref, activation, dtype)
    _assert_within("output", y, y_ref, y_bound)

    # The derivative from what the kernel saved: y (relu, tanh), which we have; gelu saves
    # z rounded to T, within z_bound of the exact z, so its derivative moves by up to
    # GELU_D2 * z_bound.
    if activation == "gelu":
        dz = _derivative("gelu", z, g64)
        dz_err = g64.abs() * (GELU_D2 * z_bound + ACT_OPS["gelu"] * U32 * (1 + z.abs()))
    else:
        dz = _derivative(activation, y.double(), g64)
        dz_err = ACT_OPS[activation] * U32 * g64.abs() * (1 + y.double().abs() ** 2)
    dz_abs = dz.abs() + dz_err

    rows = int((w64 != 0).sum(0).max())  # the longest source column: grad_input's sum
    want_gx = dz @ w64
    off = gamma(rows) * (dz_abs @ w64.abs()) + dz_err @ w64.abs()
    _assert_within("grad_input", gx, want_gx, rounded(dtype, want_gx, off))

    pattern = layer.pattern()
    r, c = pattern.row_ids(), pattern.indices.long()
    want_gw = (dz[:, r] * x64[:, c]).sum(0)
    spread = (dz_abs[:, r] * x64[:, c].abs()).sum(0)
    off = gamma(batch) * spread + (dz_err[:, r] * x64[:, c].abs()).sum(0)
    _assert_within("grad_values", gw, want_gw, rounded(dtype, want_gw, off))

    want_gb = dz.sum(0)
    off = gamma(batch) * dz_abs.sum(0) + dz_err.sum(0)
    _assert_within("grad_bias", gb, want_gb, rounded(dtype, want_gb, off))


def _assert_within(what, got, want, bound):
    err = (got.double() - want).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"{what}: |got - want| = {err.flatten()[worst]:.3g} past the bound "
        f"{bound.flatten()[worst]:.3g} at flat index {worst} (want {want.flatten()[worst]:.6g})")


def _fma_chain_in(dtype, terms: torch.Tensor) -> torch.Tensor:
    """Exact float64 terms (n, ...) added in order, each addition rounded to dtype: an fma
    chain with a dtype accumulator."""
    acc = torch.zeros(terms.shape[1:], dtype=torch.float64)
    for t in terms:
        acc = (acc + t).to(dtype).double()
    return acc


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_the_bound_tells_float32_sums_from_2_byte_sums(dtype):
    """A row of 2048 edges: the kernel's output is within the bound, and the same products
    summed in the 2-byte type (what a kernel without a float32 accumulator would give) are
    not, so the bound of the test above can fail."""
    layer, g = _layer(2048, 8, 1.0, dtype, None, seed=3)
    with torch.no_grad():
        layer.bias.zero_()
    x = (torch.rand(2, 2048, generator=g) + 0.5).to(dtype)  # one sign: no cancellation
    with torch.no_grad():
        layer.weight.copy_(torch.rand(layer.weight.shape, generator=g).to(dtype))
    y, *_ = _run(layer, x, torch.zeros(2, 8, dtype=dtype), False)
    w64, x64 = _dense64(layer), x.double()
    z = x64 @ w64.t()
    bound, _ = _forward_bound(x64, w64, torch.zeros(8, dtype=torch.float64), z, z, None, dtype)
    _assert_within("output", y, z, bound)
    products = (x64[:, None, :] * w64[None, :, :]).permute(2, 0, 1)  # (2048, batch, out)
    in_t = _fma_chain_in(dtype, products)
    assert not bool(((in_t - z).abs() <= bound).all())


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_autocast_runs_the_op_in_the_autocast_dtype(dtype):
    """The op itself is registered for autocast (AutocastCPU here, AutocastMPS on a Mac):
    called with float32 tensors under torch.autocast it runs the 2-byte kernels, exactly
    as if its floating arguments had been cast first."""
    layer, g = _layer(48, 40, 0.3, torch.float32, "relu", seed=11)
    x = torch.randn(5, 48, generator=g)
    with tsm.use_backend("emulator"):
        with torch.autocast("cpu", dtype=dtype):
            auto = layer(x)
            assert torch.is_autocast_enabled("cpu")
        by_hand = tsm.sparse_linear(x.to(dtype), layer.indptr, layer.indices,
                                    layer.weight.detach().to(dtype),
                                    layer.bias.detach().to(dtype), activation="relu")
    assert auto.dtype == dtype and torch.equal(auto, by_hand)
    for key in ("AutocastCPU", "AutocastMPS"):
        if hasattr(torch._C.DispatchKey, key):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(
                "torch_sparse_metal::sparse_linear", key)


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_autocast_keeps_float32_parameters_and_gradients(dtype):
    """Under autocast a float32 SparseLinear computes in the 2-byte type and its parameters
    get float32 gradients: those of the same layer cast to the type by hand, converted."""
    layer, g = _layer(48, 40, 0.3, torch.float32, "tanh", seed=12)
    layer.deterministic = True
    x = torch.randn(6, 48, generator=g)
    grad = torch.randn(6, 40, generator=g).to(dtype)
    with tsm.use_backend("emulator"):
        with torch.autocast("cpu", dtype=dtype):
            y = layer(x)
        y.backward(grad)
        by_hand, _ = _layer(48, 40, 0.3, dtype, "tanh", seed=12)
        by_hand.deterministic = True
        y_hand = by_hand(x.to(dtype))
        y_hand.backward(grad)
    assert y.dtype == dtype and torch.equal(y, y_hand)
    assert layer.weight.grad.dtype == layer.bias.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, by_hand.weight.grad.float())
    assert torch.equal(layer.bias.grad, by_hand.bias.grad.float())


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_autocast_on_the_reference_gives_the_kernels_dtype_and_bound(dtype):
    """The plain-torch path (other devices) under autocast: the kernels' dtype, and sums in
    float32 as theirs, within the same bound."""
    layer, g = _layer(48, 40, 0.3, torch.float32, "gelu", seed=13)
    x = torch.randn(4, 48, generator=g)
    with torch.autocast("cpu", dtype=dtype):
        with tsm.use_backend("reference"):
            ref = layer(x)
        with tsm.use_backend("emulator"):
            kern = layer(x)
    assert ref.dtype == kern.dtype == dtype
    w64 = _dense64(layer).to(dtype).double()
    b64, x64 = layer.bias.detach().to(dtype).double(), x.to(dtype).double()
    z = x64 @ w64.t() + b64
    y = _act64(z, "gelu")
    bound, _ = _forward_bound(x64, w64, b64, z, y, "gelu", dtype)
    _assert_within("reference", ref, y, bound)
    _assert_within("kernels", kern, y, bound)


def test_mixed_dtypes_outside_autocast_are_refused():
    layer, g = _layer(8, 6, 0.5, torch.float32, None, seed=14)
    with pytest.raises(ValueError, match=r"values has dtype torch.float32 but input has dtype torch.float16; they "
                       r"must match \(torch.autocast would cast"):
        with tsm.use_backend("emulator"):
            layer(torch.randn(2, 8).half())
    with torch.autocast("cpu", dtype=torch.float16):  # float64 is not autocast's to cast
        with pytest.raises(ValueError, match=r"values has dtype torch.float64 but input has dtype "
                           r"torch.float16; they must match under torch.autocast"):
            tsm.sparse_linear(torch.randn(2, 8), layer.indptr, layer.indices,
                              layer.weight.detach().double())


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_spmm_in_2_byte_types(dtype):
    g = torch.Generator().manual_seed(5)
    dense_a = torch.randn(30, 20, generator=g) * (torch.rand(30, 20, generator=g) < 0.3)
    a = dense_a.to(dtype).to_sparse_csr()
    b = torch.randn(20, 9, generator=g).to(dtype).requires_grad_()
    with tsm.use_backend("emulator"):
        out = tsm.spmm(a, b)
        out.backward(torch.ones_like(out))
    assert out.dtype == b.grad.dtype == dtype
    a64, b64 = dense_a.to(dtype).double(), b.detach().double()
    want = a64 @ b64
    off = gamma(21) * (a64.abs() @ b64.abs())
    _assert_within("spmm", out, want, rounded(dtype, want, off))
    want_gb = a64.t() @ torch.ones(30, 9, dtype=torch.float64)
    off = gamma(31) * (a64.abs().t() @ torch.ones(30, 9, dtype=torch.float64))
    _assert_within("spmm grad", b.grad, want_gb, rounded(dtype, want_gb, off))


def test_float16_forward_moves_at_most_55_percent_of_float32_bytes():
    """The issue's size: 4096 x 4096 at 1%, batch 64. Indices stay 4 bytes, so the
    2-byte values and activations save less than half."""
    counted = {}
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(0)
        layer = tsm.nn.SparseLinear(4096, 4096, density=0.01, generator=g).to(dtype)
        x = torch.randn(64, 4096, generator=g).to(dtype)
        with torch.no_grad(), tsm.use_backend("emulator"), instrumented(), \
                record() as launches:
            layer(x)
        (forward,) = [l for l in launches if "forward" in l.kernel]
        counted[dtype] = forward.counters["device_bytes_read"] + \
            forward.counters["device_bytes_written"]
    assert counted[torch.float16] <= 0.55 * counted[torch.float32], counted


def test_autocast_inside_a_compiled_graph():
    """torch.compile(fullgraph=True) traces the op's autocast rule: the same result and
    float32 parameter gradients as eager."""
    layer, g = _layer(24, 16, 0.4, torch.float32, "relu", seed=15)
    model = torch.nn.Sequential(layer, _layer(16, 5, 0.4, torch.float32, None, seed=16)[0])
    x = torch.randn(8, 24, generator=g)
    with tsm.use_backend("emulator"):
        model(x)  # validates the patterns outside the graph
        compiled = torch.compile(model, fullgraph=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager, traced = model(x), compiled(x)
        traced.float().sum().backward()
    assert traced.dtype == torch.bfloat16 and torch.equal(eager, traced)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
