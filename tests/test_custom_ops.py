"""Every op of the ``torch_sparse_metal`` namespace passes ``torch.library.opcheck``.

opcheck runs each op's schema check (the mutations an op declares are the ones it makes),
its fake implementation against the kernels (shapes, dtypes, strides), the autograd
registration and ``aot_dispatch_dynamic`` (the op traced with symbolic shapes, forward and
backward compared with eager). The kernels run on the emulator (CPU tensors), sanitized as
everywhere in the suite.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal import _custom_ops
from torch_sparse_metal.ops import CSRPattern
from torch_sparse_metal.ops import kmeans as K

OPS = torch.ops.torch_sparse_metal
F64 = torch.float64


def pattern(with_source: bool):
    """A 5 -> 4 layer with an empty row and a repeated column."""
    p = CSRPattern(torch.tensor([0, 2, 2, 5, 7], dtype=torch.int32),
                   torch.tensor([0, 3, 1, 2, 4, 0, 0], dtype=torch.int32), 5)
    empty = torch.empty(0, dtype=torch.int32)
    src = tuple(p.by_source()) if with_source else (empty,) * 3
    return p.indptr, p.indices, src, p.fingerprints(with_source)


def leaf(*shape, grad=True, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


def sparse_linear_cases():
    for activation in (None, "relu", "gelu", "tanh"):
        for deterministic in (False, True):
            for with_source in (False, True):
                indptr, indices, src, fp = pattern(with_source)
                # verify and strict (the backward's check) with the by-source CSR
                yield (leaf(3, 5), indptr, indices, leaf(7, seed=1), leaf(4, seed=2), *src, fp,
                       activation, deterministic, activation == "gelu", with_source,
                       with_source, False)
                if not deterministic:  # the batch-lanes kernels: output (out_features, batch)
                    yield (leaf(3, 5), indptr, indices, leaf(7, seed=1), leaf(4, seed=2), *src,
                           fp, activation, False, activation == "gelu", with_source,
                           with_source, True)
    indptr, indices, src, fp = pattern(True)  # no bias, only some inputs need a gradient
    yield (leaf(3, 5, grad=False), indptr, indices, leaf(7, seed=1), None, *src, fp, None,
           True, False, False, False, False)


def sparse_linear_backward_cases():
    for need in ((1, 1, 1), (1, 0, 0), (0, 1, 1)):
        for deterministic in (False, True):
            indptr, indices, src, fp = pattern(deterministic)
            act = leaf(3, 4, grad=False, seed=3).relu()
            yield (leaf(3, 4, grad=False), leaf(3, 5, grad=False), leaf(7, grad=False, seed=1),
                   act, indptr, indices, *src, fp, 5, "relu", deterministic, *map(bool, need),
                   False, deterministic)
            if not deterministic:  # the batch-lanes kernel: (features, batch) activations
                yield (leaf(4, 3, grad=False), leaf(3, 5, grad=False),
                       leaf(7, grad=False, seed=1), act.t().contiguous(), indptr, indices, *src,
                       fp, 5, "relu", False, *map(bool, need), True, False)
    # Its own autograd formula (double backward): every floating input requires grad.
    indptr, indices, src, fp = pattern(True)
    for activation, deterministic, features_major in (("gelu", False, False),
                                                      ("tanh", True, False),
                                                      ("relu", False, True)):
        shape = (4, 3) if features_major else (3, 4)
        yield (leaf(*shape, seed=4), leaf(3, 5), leaf(7, seed=1), leaf(*shape, seed=3), indptr,
               indices, *src, fp, 5, activation, deterministic, True, True, True,
               features_major, False)


def matmul_cases():
    a, b = leaf(6, 5), leaf(4, 5, seed=1).t()  # b read in place through its strides
    for kernel in (None, "naive", "tiled", "register", "simdgroup", "shuffle"):
        yield "mm", (a, b, kernel)
    yield "mm", (leaf(6, 5, dtype=torch.float32), leaf(5, 4, seed=1, dtype=torch.float32), None)
    for bias, alpha, beta, activation in ((leaf(4, seed=2), 2.0, 0.5, "gelu"),
                                          (leaf(6, 1, seed=2), 1.0, 1.0, "relu"),
                                          (leaf(4, seed=2), 1.0, 0.0, "tanh"),
                                          (None, -1.5, 0.0, None)):
        yield "addmm", (bias, a, b, alpha, beta, activation, "register", activation == "gelu")


def cross_entropy_cases():
    labels = torch.tensor([2, 0, -100, 1, 2])
    yield leaf(5, 3), labels, -100, True, False
    yield leaf(5, 3, dtype=torch.float32), labels.int(), -100, True, True
    yield leaf(5, 3, grad=False), torch.tensor([2, 0, 0, 1, 2]), 0, False, False


def adamw_cases():
    # Two parameters of 5 and 40 elements, padded to chunks of 32: segments 32 and 64.
    total = 96
    g = torch.Generator().manual_seed(0)
    param, grad, exp_avg = (torch.randn(total, generator=g) for _ in range(3))
    exp_avg_sq = torch.rand(total, generator=g)
    chunks = torch.tensor([0, 1, 1], dtype=torch.int32)
    for amsgrad in (0.0, 1.0):
        hyper = [1.0, 0.999, 0.1, 0.999, 0.001, 0.01, 0.03, 1e-8, 1.0, amsgrad,
                 1.0, 0.999, 0.1, 0.999, 0.001, 0.01, 0.03, 1e-8, -1.0, amsgrad]
        max_sq = exp_avg_sq.clone() if amsgrad else torch.zeros(1)
        yield (param.clone(), grad, exp_avg.clone(), exp_avg_sq.clone(), max_sq, chunks, hyper,
               [0, 32, 96], torch.zeros(2, 2), 1)


def kmeans_cases():
    x = leaf(40, 3, grad=False)
    c = leaf(4, 3, grad=False, seed=1)
    labels, _ = K.assign(x, c, backend="reference")
    counts = torch.bincount(labels.long(), minlength=4).int()
    sums = torch.zeros(4, 3, dtype=F64).index_add_(0, labels.long(), x)
    yield "kmeans_sq_norms", (x,)
    yield "kmeans_distances", (x, c, None, None)
    yield "kmeans_distances", (x, c, K.sq_norms(x, backend="reference"),
                               K.sq_norms(c, backend="reference"))
    yield "kmeans_assign", (x, c, None, None)
    yield "kmeans_assign_from_distances", (K.distances(x, c, backend="reference"),)
    for mode in ("atomic", "deterministic"):
        yield "kmeans_accumulate", (x, labels, 4, mode)
    yield "kmeans_accumulate", (x.float(), labels, 4, "cas")
    yield "kmeans_finalize", (sums, counts, c)
    yield "kmeans_drift_and_norms", (c, c + 0.5)
    yield "kmeans_assign_one", (x[0], c)
    yield "kmeans_pp_update", (x, c[0], torch.full((40,), np.inf, dtype=F64))
    yield "kmeans_update_affected", (c, counts, sums, counts)


def block_sparse_linear_cases():
    """A 24 -> 16 layer of 8 x 8 blocks: block row 0 holds columns 2 and 0, row 1 none; both
    kernel families, with and without bias, and the backward alone."""
    from torch_sparse_metal.ops import BSRPattern
    p = BSRPattern(torch.tensor([0, 2, 2], dtype=torch.int32),
                   torch.tensor([2, 0], dtype=torch.int32), 24, 16, 8)
    src = tuple(p.by_source())
    for simdgroup in (True, False):
        yield "block_sparse_linear", (leaf(9, 24), p.crow, p.col, leaf(2, 8, 8, seed=1),
                                      leaf(16, seed=2), *src, simdgroup)
        yield "block_sparse_linear", (leaf(3, 24, grad=False), p.crow, p.col,
                                      leaf(2, 8, 8, seed=1), None, *src, simdgroup)
        for need in ((1, 1, 1), (0, 1, 0), (1, 0, 1)):
            yield "block_sparse_linear_backward", (
                leaf(9, 16, grad=False), leaf(9, 24, grad=False), leaf(2, 8, 8, grad=False),
                p.crow, p.col, *src, 24, *map(bool, need), simdgroup)


CASES = ([("sparse_linear", args) for args in sparse_linear_cases()]
         + list(block_sparse_linear_cases())
         + [("sparse_linear_backward", args) for args in sparse_linear_backward_cases()]
         + list(matmul_cases())
         + [("cross_entropy", args) for args in cross_entropy_cases()]
         + [("adamw_step", args) for args in adamw_cases()]
         + list(kmeans_cases()))


@pytest.mark.parametrize("name, args", CASES, ids=[name for name, _ in CASES])
def test_opcheck(name, args):
    torch.library.opcheck(getattr(OPS, name).default, args)


def test_every_op_is_checked():
    assert sorted(set(_custom_ops.DEFINED)) == sorted({name for name, _ in CASES})
    assert len(_custom_ops.DEFINED) == len(set(_custom_ops.DEFINED))


def test_the_dispatcher_picks_the_emulator_for_cpu_tensors():
    """The kernel backends are chosen by device: CPU tensors run the emulator, whatever
    use_backend says (the public functions decide whether to call an op at all)."""
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    with tsm.use_backend("reference"), tsm.record() as launches:
        out = OPS.mm(a, b, None)
    assert [(l.kernel, l.backend) for l in launches] == [("matmul_naive_nn_float", "emulator")]
    torch.testing.assert_close(out, a @ b)


def test_errors_inside_an_op_keep_their_type_and_message():
    logits, labels = torch.randn(3, 4), torch.tensor([0, 4, 1])
    with pytest.raises(ValueError, match=r"^cross_entropy: labels must lie in \[0, classes\)"):
        OPS.cross_entropy(logits, labels, -100, False, True)   # strict: checked in the op


def test_the_emulator_backend_refuses_tensors_off_the_cpu():
    """No op has a kernel for other devices: the backend check says so before any op."""
    a = torch.randn(3, 4, device="meta")
    with tsm.use_backend("emulator"), pytest.raises(
            ValueError, match="^mm: backend 'emulator' runs on CPU tensors; move the inputs "
                              "to 'cpu'"):
        tsm.mm(a, a.t())
