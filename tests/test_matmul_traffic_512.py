"""The issue's own measure, at its size: at 512^3 the simdgroup kernel moves at most 1/8 of
the naive kernel's device traffic (emulator counters; ~13 s on 2 cores, most of it the
instrumented naive kernel's 268M loads)."""
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.emulator import instrumented, record


def _traffic(rung: str, a: torch.Tensor, b: torch.Tensor) -> int:
    with tsm.use_backend("emulator"), instrumented(), record() as launches:
        c = tsm.mm(a, b, kernel=rung)
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-3)
    (launch,) = launches
    # reads + writes: a store of the value already there counts as a read (documented)
    return launch.counters["device_bytes_read"] + launch.counters["device_bytes_written"]


def test_simdgroup_traffic_at_512_cubed_is_at_most_an_eighth_of_naive():
    g = torch.Generator().manual_seed(512)
    a, b = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
    naive, simdgroup = _traffic("naive", a, b), _traffic("simdgroup", a, b)
    output = 512 * 512 * 4
    assert naive == 2 * 512 ** 3 * 4 + output          # both operands per multiply-add
    assert simdgroup == 512 ** 3 * 4 * 2 // 64 + output  # 64 x 64 tiles of C
    assert simdgroup <= naive / 8
