"""Ops with 1024-thread groups (the tiled matmul rung, cross-entropy) size them from the
pipeline's maxTotalThreadsPerThreadgroup (``_launch.max_threads_per_group``): 1024 on the
emulator, whatever Metal reports for the pipeline on a Mac. A smaller limit is faked on
the emulator, whose launches then refuse larger groups as Metal would."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal import _launch
from torch_sparse_metal import _metal_backend
from torch_sparse_metal.emulator import LaunchError, record
from torch_sparse_metal.emulator._library import Kernel
from torch_sparse_metal.ops import matmul as mmops


@pytest.fixture
def pipeline_limit(monkeypatch):
    """Make every emulated pipeline report (and enforce) ``limit`` threads per group."""
    def set_limit(limit: int) -> None:
        monkeypatch.setattr(Kernel, "max_total_threads_per_threadgroup", limit)
    return set_limit


def test_the_emulator_reports_metals_limit():
    assert _launch.max_threads_per_group("matmul_tiled.metal", "matmul_tiled_nn_float",
                                         "emulator") == 1024


def test_the_metal_limit_is_the_pipelines(monkeypatch):
    class Info:
        max_total_threads_per_threadgroup = 704
    monkeypatch.setattr(_metal_backend, "kernel_info", lambda shader, kernel: Info())
    assert _launch.max_threads_per_group("s.metal", "k", "metal") == 704
    with pytest.raises(ValueError, match="backend 'reference' runs no kernels"):
        _launch.max_threads_per_group("s.metal", "k", "reference")


def test_a_faked_limit_is_enforced_by_the_emulator(pipeline_limit):
    """So a test below fails if an op ignores the limit."""
    pipeline_limit(256)
    lib = tsm.emulator.load_shader_file("matmul_tiled.metal")
    a = torch.zeros(4)
    with pytest.raises(LaunchError, match=r"has 1024 threads; a Metal threadgroup holds 1 to 256"):
        lib.matmul_tiled_nn_float(*([a] * 5), *[np.uint32(1)] * 8, np.float32(1),
                                  np.float32(0), np.uint32(0), np.uint32(0),
                                  threads=(32, 32), group_size=(32, 32))


@pytest.mark.parametrize("limit, rows", [(1024, 32), (512, 16), (256, 8), (96, 3)])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True),
                                              (True, True)])
def test_tiled_rung_drops_rows_to_fit_the_pipeline(pipeline_limit, limit, rows, trans_a, trans_b):
    pipeline_limit(limit)
    m, n, k = 45, 37, 70  # partial tiles everywhere
    g = torch.Generator().manual_seed(limit + 2 * trans_a + trans_b)
    a = torch.randn(k, m, generator=g).t() if trans_a else torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g).t() if trans_b else torch.randn(k, n, generator=g)
    with tsm.use_backend("emulator"), record() as launches:
        c = tsm.mm(a, b, kernel="tiled")
    (launch,) = launches
    variant = ("t" if trans_a else "n") + ("t" if trans_b else "n")
    assert launch.kernel == f"matmul_tiled_{variant}_float"
    assert launch.group_size == (32, rows, 1)
    assert launch.threads == (math.ceil(n / 32) * 32, math.ceil(m / rows) * rows, 1)
    torch.testing.assert_close(c, a @ b, rtol=1e-5, atol=1e-4)


def test_rungs_with_fixed_groups_say_when_the_pipeline_is_too_small(pipeline_limit):
    pipeline_limit(128)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with tsm.use_backend("emulator"):
        with pytest.raises(ValueError, match="matmul rung 'register' needs 256 threads per "
                                             "threadgroup; this pipeline allows 128"):
            tsm.mm(a, b, kernel="register")
        torch.testing.assert_close(tsm.mm(a, b, kernel="simdgroup"), a @ b)  # 128 threads


def test_rung_fit_keeps_the_full_geometry_when_it_fits():
    tiled = mmops.RUNGS["tiled"]
    assert tiled.fit(1024) is tiled
    assert tiled.fit(1023).group_size == (32, 31) and tiled.fit(1023).tile == (31, 32)
    with pytest.raises(ValueError, match="needs 1024 threads per threadgroup; this pipeline "
                                         "allows 31"):
        tiled.fit(31)


@pytest.mark.parametrize("limit, batch, group", [(1024, 1000, 1000 + 24), (256, 1000, 256),
                                                 (100, 1000, 96), (1024, 5, 32), (100, 70, 96)])
def test_cross_entropy_sizes_its_one_group_from_the_pipeline(pipeline_limit, limit, batch,
                                                             group):
    pipeline_limit(limit)
    g = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, 7, generator=g, requires_grad=True)
    labels = torch.randint(0, 7, (batch,), generator=g)
    with tsm.use_backend("emulator"), record() as launches:
        loss = tsm.nn.functional.cross_entropy(logits, labels)
    assert [(l.threads, l.group_size) for l in launches] == [((group, 1, 1), (group, 1, 1))]
    loss.backward()
    reference = logits.detach().clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(reference, labels)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logits.grad, reference.grad)
