"""The fused training step under DistributedDataParallel: gloo, two processes, emulator."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import torch

import torch_sparse_metal as tsm

sys.path.insert(0, str(Path(__file__).parent))
import _ddp_train  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_match_one_process_on_the_whole_batch(tmp_path):
    """Two ranks on half batches, gradients all-reduced (averaged) by DDP like any
    parameter's, equal one process on the whole batch (mean loss = mean of the halves')."""
    out = tmp_path / "ddp.pt"
    command = [sys.executable, str(Path(_ddp_train.__file__)), str(out)]
    try:
        subprocess.run(command + [str(free_port())], check=True, timeout=300)
    except subprocess.CalledProcessError as first:
        # Process-group start-up or teardown over loopback can fail once on a loaded
        # machine; the results are checked in full below, so retrying hides nothing.
        print(f"two-rank run failed once ({first!r}); retrying", file=sys.stderr)
        subprocess.run(command + [str(free_port())], check=True, timeout=300)
    result = torch.load(out)
    a, b = result["checks"]
    torch.testing.assert_close(a, b, rtol=0, atol=0)   # the ranks stayed identical

    model = _ddp_train.build()
    opt = tsm.optim.AdamW(model.parameters(), lr=1e-2)
    with tsm.use_backend("emulator"):
        for x, y in _ddp_train.batches(3):
            opt.zero_grad()
            tsm.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for p, q in zip(result["params"], model.parameters()):
        torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-12)
    # The norms are those of the all-reduced gradients the step read.
    torch.testing.assert_close(result["grad_norms"], opt.grad_norms(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(result["layer_norm"], model[0].grad_norm, rtol=1e-10, atol=1e-12)
