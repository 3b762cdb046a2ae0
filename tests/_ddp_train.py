"""Worker for test_ddp.py: train a sparse MLP under DistributedDataParallel (gloo, 2 ranks).

    python tests/_ddp_train.py OUT.pt PORT

Each rank trains on its half of every batch through the emulator kernels with the fused
loss and AdamW; rank 0 saves the final parameters, the last gradient norms and each
rank's parameters' checksum to OUT.pt.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def batches(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 10, generator=g, dtype=torch.float64),
             torch.randint(0, 4, (16,), generator=g)) for _ in range(steps)]


def build():
    import torch_sparse_metal as tsm
    g = torch.Generator().manual_seed(0)
    return torch.nn.Sequential(
        tsm.nn.SparseLinear(10, 16, density=0.3, activation="tanh", generator=g),
        tsm.nn.SparseLinear(16, 4, density=0.5, generator=g)).to(torch.float64)


def worker(rank, out, port):
    import torch_sparse_metal as tsm
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(build())
    opt = tsm.optim.AdamW(model.parameters(), lr=1e-2)
    with tsm.use_backend("emulator"):
        for x, y in batches(3):
            half = slice(rank * 8, rank * 8 + 8)
            opt.zero_grad()
            tsm.nn.functional.cross_entropy(model(x[half]), y[half]).backward()
            opt.step()
    params = [p.detach().clone() for p in model.module.parameters()]
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(WORLD)]
    dist.all_gather(gathered, torch.stack([sum(p.sum() for p in params),
                                           sum(p.square().sum() for p in params)]))
    if rank == 0:
        torch.save(dict(params=params, checks=gathered, grad_norms=opt.grad_norms(),
                        layer_norm=model.module[0].grad_norm), out)
    # Both ranks tear the process group down together: a rank that leaves while the other
    # still has gloo work in flight can abort in gloo's threads ("terminate called").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2])), nprocs=WORLD)
