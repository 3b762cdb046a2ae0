"""Train a 10%-dense sparse MLP on scikit-learn's digits with an evolving topology.

    python examples/train_sparse_mlp.py                    # kernels on the CPU emulator
    python examples/train_sparse_mlp.py --backend auto     # MPS on a Mac, else plain torch
    python examples/train_sparse_mlp.py --backend reference
    python examples/train_sparse_mlp.py --block 8          # 8x8 blocks (BlockSparseLinear)

Every training step is 2L + 2 kernel dispatches for L layers: L fused forward kernels
(activation inside), one fused softmax-cross-entropy kernel (loss and gradient), L fused
backward kernels and one AdamW kernel for all parameters. Every ``--regrow-every`` steps,
``prune_and_regrow`` (SET: drop the weakest edges, grow random new ones) replaces a
fraction of each layer's edges that decays to 0 over training, moving the optimizer state
with the edges. At the end a PNG of the loss and accuracy curves and of each layer's
edges over time is written, and its path printed.

With ``--block B`` the hidden-to-hidden layers are ``BlockSparseLinear`` of ``B x B``
blocks (``--density`` is then their fraction of blocks; ``prune_and_regrow`` moves whole
blocks), with the activation a torch module after them (one more dispatch each way). The
first and last layers stay CSR: 64 pixels and 10 classes are too narrow for blocks, whose
outputs would each see 8 consecutive pixels (one row of the image) and whose last layer
would be a handful of blocks feeding 8 classes each.

The digits data (1,797 8x8 images) ships inside scikit-learn: nothing is downloaded.
"""
from __future__ import annotations

import argparse
import math
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
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 128],
                   help="hidden widths (2 numbers: a 3-layer MLP)")
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--activation", choices=["relu", "gelu", "tanh"], default="relu")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--regrow-every", type=int, default=50, help="steps between topology updates")
    p.add_argument("--regrow-fraction", type=float, default=0.2,
                   help="fraction of edges replaced at the first update (decays to 0, cosine)")
    p.add_argument("--plot", type=Path, default=Path("sparse_mlp_digits.png"))
    p.add_argument("--block", type=int, choices=[8, 16, 32], default=None,
                   help="BlockSparseLinear layers of BxB blocks (default: SparseLinear, CSR)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def load_data(device: torch.device, seed: int):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixels are 0..16
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y)
    return [t.to(device) for t in (x_train, y_train, x_test, y_test)]


ACTIVATIONS = {"relu": torch.nn.ReLU, "gelu": lambda: torch.nn.GELU(approximate="tanh"),
               "tanh": torch.nn.Tanh}


def build_model(hidden, density: float, activation: str, device: torch.device,
                seed: int, block=None) -> torch.nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    widths = [64, *hidden, 10]
    modules = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        act = activation if i < len(widths) - 2 else None
        if block is not None and 0 < i < len(widths) - 2:  # hidden to hidden
            modules += [tsm.nn.BlockSparseLinear(a, b, block, density=density, generator=g,
                                                 device=device), ACTIVATIONS[act]()]
        else:
            modules.append(tsm.nn.SparseLinear(a, b, density=density, generator=g,
                                               device=device, activation=act))
    return torch.nn.Sequential(*modules)


def sparse_layers(model: torch.nn.Module) -> list:
    return [m for m in model if isinstance(m, (tsm.nn.SparseLinear, tsm.nn.BlockSparseLinear))]


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(dim=1) == y).float().mean().item()


def progress(epoch: int, epochs: int, text: str, quiet: bool) -> None:
    if quiet:
        return
    done = round(30 * epoch / epochs)
    end = "\n" if epoch == epochs else ""
    print(f"\r[{'#' * done}{'.' * (30 - done)}] epoch {epoch}/{epochs} {text}", end=end,
          flush=True)


def plot(history: dict, layers, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_edges) = plt.subplots(1, 3, figsize=(15, 4))
    ax_loss.plot(history["epoch"], history["loss"], label="train loss")
    ax_loss.set_xlabel("epoch"), ax_loss.set_ylabel("cross-entropy"), ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_acc.plot(history["epoch"], history["train_acc"], label="train")
    ax_acc.plot(history["epoch"], history["test_acc"], label="test")
    ax_acc.set_xlabel("epoch"), ax_acc.set_ylabel("accuracy"), ax_acc.set_ylim(0, 1.01)
    ax_acc.legend()
    steps = history["regrow_step"]
    for i, layer in enumerate(layers):
        line, = ax_edges.plot(steps, [layer.nnz] * len(steps),
                              label=f"layer {i} ({layer.in_features}->{layer.out_features}) edges")
        ax_edges.plot(steps, history["replaced"][i], "--", color=line.get_color(),
                      label=f"layer {i} edges replaced (cumulative)")
    ax_edges.set_xlabel("step"), ax_edges.set_ylabel("edges")
    ax_edges.set_title("nnz is fixed; the edges themselves move")
    ax_edges.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.resolve()


def main(argv=None) -> float:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    on_mps = args.backend == "auto" and tsm.metal_available()
    device = torch.device("mps" if on_mps else "cpu")
    x_train, y_train, x_test, y_test = load_data(device, args.seed)
    model = build_model(args.hidden, args.density, args.activation, device, args.seed,
                        args.block)
    layers = sparse_layers(model)
    opt = tsm.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    runs_on = "Metal (MPS)" if on_mps else {"auto": "plain torch (no MPS)",
                                            "emulator": "the Metal emulator (CPU)",
                                            "reference": "plain torch"}[args.backend]
    print(f"{len(x_train)} train / {len(x_test)} test digits; kernels run on {runs_on}")
    print(model)

    steps_per_epoch = math.ceil(len(x_train) / args.batch_size)
    total_steps = args.epochs * steps_per_epoch
    history = {k: [] for k in ("epoch", "loss", "train_acc", "test_acc", "regrow_step")}
    history["replaced"] = [[] for _ in layers]
    replaced = [0] * len(layers)
    regrow_gen = torch.Generator(device=device).manual_seed(args.seed)

    def record_topology(step: int) -> None:
        history["regrow_step"].append(step)
        for i in range(len(layers)):
            history["replaced"][i].append(replaced[i])

    start = time.perf_counter()
    step = 0
    record_topology(0)
    with tsm.use_backend(args.backend):
        for epoch in range(1, args.epochs + 1):
            model.train()
            order = torch.randperm(len(x_train), device=device)
            total_loss, correct = torch.zeros((), device=device), torch.zeros((), device=device)
            for batch in order.split(args.batch_size):
                logits = model(x_train[batch])
                loss = tsm.nn.functional.cross_entropy(logits, y_train[batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                # Accumulated on the device: nothing in a step reads the GPU back (the
                # tests count it: tests/test_host_syncs.py), so steps queue up on MPS.
                total_loss += loss.detach() * len(batch)
                correct += (logits.detach().argmax(dim=1) == y_train[batch]).sum()
                if step % args.regrow_every == 0 and step < total_steps:
                    fraction = args.regrow_fraction * 0.5 * (1 + math.cos(math.pi * step / total_steps))
                    for i, layer in enumerate(layers):
                        # A block layer replaces whole blocks: count their edges.
                        replaced[i] += getattr(layer, "block", 1) ** 2 * tsm.nn.prune_and_regrow(
                            layer, fraction, "magnitude", optimizer=opt, generator=regrow_gen)
                    record_topology(step)
            model.eval()
            # The epoch's one synchronisation: the numbers to print, and what the kernels
            # flagged on the device meanwhile (a bad label, a pattern edited behind torch's
            # back), raised here rather than read back every step.
            tsm.check_errors()
            train_loss = total_loss.item() / len(x_train)
            train_acc = correct.item() / len(x_train)
            test_acc = accuracy(model, x_test, y_test)
            for key, value in (("epoch", epoch), ("loss", train_loss), ("train_acc", train_acc),
                               ("test_acc", test_acc)):
                history[key].append(value)
            progress(epoch, args.epochs, f"loss {train_loss:.4f}  train acc {train_acc:.3f}  "
                     f"test acc {test_acc:.3f}  ({time.perf_counter() - start:.1f} s)",
                     args.quiet)
        test_acc = accuracy(model, x_test, y_test)
    record_topology(step)
    norms = ", ".join(f"{float(l.grad_norm):.3g}" for l in layers)
    print(f"last step's gradient norm per layer (from the AdamW kernel): {norms}")
    print(f"edges replaced per layer: {replaced} of nnz {[l.nnz for l in layers]}")
    print(f"final test accuracy: {test_acc:.4f}")
    print(f"plot: {plot(history, layers, args.plot)}")
    return test_acc


if __name__ == "__main__":
    main()
