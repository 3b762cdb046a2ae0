"""Train a sparse MLP (64 -> 128 -> 10) on scikit-learn's digits through the Metal kernels.

    python examples/train_sparse_mlp.py                    # kernels on the CPU emulator
    python examples/train_sparse_mlp.py --backend auto     # MPS on a Mac, else plain torch
    python examples/train_sparse_mlp.py --backend reference

The digits data (1,797 8x8 images) ships inside scikit-learn: nothing is downloaded.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

try:
    import torch_sparse_metal as tsm
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch_sparse_metal as tsm


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["auto", "emulator", "reference"], default="emulator",
                   help="auto: Metal on MPS when available, else plain torch (default: emulator)")
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--density", type=float, default=0.25)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_data(device: torch.device, seed: int):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixels are 0..16
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y)
    return [t.to(device) for t in (x_train, y_train, x_test, y_test)]


def build_model(hidden: int, density: float, device: torch.device, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Sequential(
        tsm.nn.SparseLinear(64, hidden, density=density, generator=g, device=device),
        torch.nn.ReLU(),
        tsm.nn.SparseLinear(hidden, 10, density=density, generator=g, device=device),
    )


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(dim=1) == y).float().mean().item()


def main(argv=None) -> float:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    on_mps = args.backend == "auto" and torch.backends.mps.is_available()
    device = torch.device("mps" if on_mps else "cpu")
    x_train, y_train, x_test, y_test = load_data(device, args.seed)
    model = build_model(args.hidden, args.density, device, args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    runs_on = "Metal (MPS)" if on_mps else {"auto": "plain torch (no MPS)",
                                            "emulator": "the Metal emulator (CPU)",
                                            "reference": "plain torch"}[args.backend]
    print(f"{len(x_train)} train / {len(x_test)} test digits; kernels run on {runs_on}")
    print(model)

    start = time.perf_counter()
    with tsm.use_backend(args.backend):
        for epoch in range(1, args.epochs + 1):
            model.train()
            order = torch.randperm(len(x_train), device=device)
            total_loss, correct = 0.0, 0
            for batch in order.split(args.batch_size):
                logits = model(x_train[batch])
                loss = torch.nn.functional.cross_entropy(logits, y_train[batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
                total_loss += loss.item() * len(batch)
                correct += (logits.argmax(dim=1) == y_train[batch]).sum().item()
            model.eval()
            print(f"epoch {epoch:3d}  loss {total_loss / len(x_train):.4f}  "
                  f"train acc {correct / len(x_train):.3f}  "
                  f"test acc {accuracy(model, x_test, y_test):.3f}  "
                  f"({time.perf_counter() - start:.1f} s)")
        test_acc = accuracy(model, x_test, y_test)
    print(f"final test accuracy: {test_acc:.4f}")
    return test_acc


if __name__ == "__main__":
    main()
