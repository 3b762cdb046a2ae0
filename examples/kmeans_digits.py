"""Cluster scikit-learn's digits with torch_sparse_metal.KMeans and save the centroids.

    python examples/kmeans_digits.py                      # kernels on the CPU emulator
    python examples/kmeans_digits.py --backend auto       # MPS on a Mac, else plain torch
    python examples/kmeans_digits.py --accumulate deterministic

Prints one progress line per Lloyd iteration (inertia, largest centroid shift), then the
inertia next to scikit-learn's from the same number of k-means++ inits, how well the
clusters match the true digit classes (each cluster voting for its majority class), and
writes a PNG of the 10 centroids drawn as 8x8 images, printing its path.

The digits data (1,797 8x8 images) ships inside scikit-learn: nothing is downloaded.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits

try:
    import torch_sparse_metal as tsm
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch_sparse_metal as tsm


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["auto", "emulator", "reference"], default="emulator",
                   help="auto: Metal on MPS when available, else plain torch (default: emulator)")
    p.add_argument("--clusters", type=int, default=10)
    p.add_argument("--n-init", type=int, default=3)
    p.add_argument("--accumulate", choices=["auto", "atomic", "cas", "deterministic"],
                   default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=Path("kmeans_digits_centroids.png"))
    p.add_argument("--quiet", action="store_true", help="no per-iteration lines")
    return p.parse_args(argv)


def purity(labels: np.ndarray, target: np.ndarray, k: int) -> float:
    """Fraction of points whose cluster's majority class is their own class."""
    hits = 0
    for c in range(k):
        members = target[labels == c]
        if members.size:
            hits += np.bincount(members).max()
    return hits / target.size


def save_centroids(centers: np.ndarray, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    k = centers.shape[0]
    cols = min(k, 5)
    rows = -(-k // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.8 * rows))
    for i, ax in enumerate(np.atleast_1d(axes).ravel()):
        ax.axis("off")
        if i < k:
            ax.imshow(centers[i].reshape(8, 8), cmap="gray_r", interpolation="nearest")
            ax.set_title(f"cluster {i}", fontsize=8)
    fig.suptitle("KMeans centroids of the digits (8x8)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    device = "cpu"
    if args.backend == "auto" and tsm.metal_available():
        device = "mps"
    x = x.to(device)

    km = tsm.KMeans(args.clusters, n_init=args.n_init, seed=args.seed,
                    verbose=not args.quiet, accumulate=args.accumulate)
    start = time.perf_counter()
    with tsm.use_backend(args.backend):
        km.fit(x)
    elapsed = time.perf_counter() - start
    labels = km.labels_.cpu().numpy()
    print(f"torch_sparse_metal.KMeans ({args.backend} on {device}): inertia {km.inertia_:.6g}, "
          f"{km.n_iter_} iterations in the best run, {elapsed:.2f} s")
    try:
        from sklearn.cluster import KMeans as SKKMeans
        sk = SKKMeans(args.clusters, n_init=args.n_init, random_state=args.seed).fit(digits.data)
        print(f"scikit-learn KMeans:               inertia {sk.inertia_:.6g} "
              f"(ours / theirs = {km.inertia_ / sk.inertia_:.4f})")
    except ImportError:
        pass
    print(f"cluster purity against the true digits: {purity(labels, digits.target, args.clusters):.3f}")
    save_centroids(km.cluster_centers_.cpu().numpy(), args.plot)
    print(f"centroids saved to {args.plot.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
