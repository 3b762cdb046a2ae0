"""Distributed KMeans.fit over torch.distributed: two processes on the gloo backend, each
holding half the data, end with the same centroids as one process on all of it.

The workers run the kernels on the emulator (sanitized like the rest of the suite: the
environment is inherited by spawned processes)."""
from __future__ import annotations

import queue as queue_module
import socket
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_sparse_metal as tsm

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

CENTERS = [[0.0, 0.0, 0.0], [6.0, 6.0, 0.0], [-6.0, 6.0, 1.0], [6.0, -6.0, -1.0]]


def make_data() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    c = torch.tensor(CENTERS)
    x = torch.cat([ci + 0.8 * torch.randn(40, 3, generator=g) for ci in c])
    return x[torch.randperm(x.shape[0], generator=g)].contiguous()


def make_weights() -> torch.Tensor:
    """0, 1 or 2 per point: weighted draws, sums and inertia, and points of no weight."""
    return (torch.arange(160) % 3).float()


# (constructor arguments, weighted)
CONFIGS = [(dict(init="k-means++", seed=3, accumulate="cas"), False),
           (dict(init="random", seed=4, accumulate="deterministic"), False),
           (dict(init="k-means++", seed=5, accumulate="deterministic"), True),
           (dict(init="random", seed=6, accumulate="atomic"), True)]


def fit_all(x: torch.Tensor, w: torch.Tensor, distributed: bool) -> list:
    out = []
    for cfg, weighted in CONFIGS:
        km = tsm.KMeans(len(CENTERS), **cfg).fit(x, sample_weight=w if weighted else None,
                                                 distributed=distributed)
        out.append((km.cluster_centers_.clone(), km.labels_.clone(), km.inertia_, km.n_iter_,
                    km.cluster_counts_.clone()))
    return out


def _worker(rank: int, world: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        x = make_data()
        shard = x.tensor_split(world)[rank]  # uneven shards are fine
        weights = make_weights().tensor_split(world)[rank]
        with tsm.use_backend("emulator"):
            results = fit_all(shard, weights, distributed=True)
        # By value: a tensor put on a torch.multiprocessing queue travels as a handle the
        # receiver redeems from this process, which may have exited by then (seen with the
        # suite on two pytest workers: FileNotFoundError for its listener).
        queue.put((rank, [tuple(v.numpy() if torch.is_tensor(v) else v for v in r) for r in results]))
        dist.barrier()  # leave together: see tests/_ddp_train.py
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(world: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = {rank: [tuple(torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in r)
                          for r in by_value]
                   for rank, by_value in (queue.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


def test_two_gloo_ranks_match_one_process():
    world = 2
    # Process start-up over loopback (a port taken between probe and bind, a pipe reset by
    # a rank torn down early) can fail once on a loaded machine; the results are checked
    # in full below, so a second attempt hides nothing about the computation.
    try:
        results = _run_two_ranks(world)
    except (AssertionError, ConnectionError, EOFError, OSError, queue_module.Empty) as first:
        print(f"two-rank start failed once ({first!r}); retrying", file=sys.stderr)
        results = _run_two_ranks(world)

    x = make_data()
    with tsm.use_backend("emulator"):
        single = fit_all(x, make_weights(), distributed=False)
    for cfg_i in range(len(CONFIGS)):
        c0, l0, i0, it0, n_0 = results[0][cfg_i]
        c1, l1, i1, it1, n_1 = results[1][cfg_i]
        # The ranks agree exactly: every choice was made from all-reduced numbers.
        assert torch.equal(c0, c1) and i0 == i1 and it0 == it1 and torch.equal(n_0, n_1)
        cs, ls, is_, its, ns = single[cfg_i]
        torch.testing.assert_close(c0, cs, rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.cat([l0, l1]), ls)  # each rank labels its own shard
        assert i0 == pytest.approx(is_, rel=1e-5)
        assert it0 == its
        assert torch.equal(n_0, ns)


def test_distributed_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(RuntimeError, match="init_process_group"):
        tsm.KMeans(2).fit(torch.randn(5, 2), distributed=True)
