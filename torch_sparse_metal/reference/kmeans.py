"""Plain-torch k-means steps: the ``"reference"`` backend and the oracle of the kernel tests.

One function per kernel role of ``shaders/kmeans.metal``, same arguments and results (see
:mod:`torch_sparse_metal.ops.kmeans`): labels and counts are int32, distances are squared
Euclidean in the ``||x||^2 - 2 x.c + ||c||^2`` form, clamped at 0. Runs on any device and
any floating dtype. Nothing here modifies its arguments.
"""
from __future__ import annotations

from typing import Tuple

import torch


def sq_norms_reference(rows: torch.Tensor) -> torch.Tensor:
    """``(n, d) -> (n,)``: squared Euclidean norm of each row."""
    return (rows * rows).sum(dim=1)


def distances_reference(x: torch.Tensor, centroids: torch.Tensor, x_sq: torch.Tensor = None,
                        c_sq: torch.Tensor = None) -> torch.Tensor:
    """``(n, k)`` squared distances ``||x_i||^2 - 2 x_i.c_j + ||c_j||^2``, clamped at 0."""
    x_sq = sq_norms_reference(x) if x_sq is None else x_sq
    c_sq = sq_norms_reference(centroids) if c_sq is None else c_sq
    return (x_sq[:, None] - 2 * (x @ centroids.T) + c_sq[None, :]).clamp_min_(0)


def assign_reference(dist: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(n, k) -> (labels int32 (n,), min_dist (n,))``; the lowest index on ties."""
    min_dist, labels = dist.min(dim=1)
    return labels.to(torch.int32), min_dist


def accumulate_reference(x: torch.Tensor, labels: torch.Tensor,
                         k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-cluster sums ``(k, d)`` and counts ``(k,)`` int32 of the points ``x`` by label."""
    idx = labels.long()
    sums = x.new_zeros(k, x.shape[1]).index_add_(0, idx, x)
    counts = torch.bincount(idx, minlength=k).to(torch.int32)
    return sums, counts


def finalize_reference(sums: torch.Tensor, counts: torch.Tensor,
                       old_centroids: torch.Tensor) -> torch.Tensor:
    """``sums / counts`` per cluster; a cluster with count 0 keeps its old centroid."""
    c = counts.to(sums.dtype)[:, None]
    return torch.where(c > 0, sums / c.clamp_min(1), old_centroids)


def drift_reference(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``[max_c ||new_c - old_c||^2, sum_c ||new_c - old_c||^2]``."""
    shift = ((new - old) ** 2).sum(dim=1)
    if shift.numel() == 0:
        return shift.new_zeros(2)
    return torch.stack([shift.max(), shift.sum()])


def assign_one_reference(point: torch.Tensor,
                         centroids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid of one point ``(d,)``: ``(label int32 (1,), distance (1,))``,
    from the direct ``||x - c||^2``."""
    dist = ((centroids - point[None, :]) ** 2).sum(dim=1)
    best, label = dist.min(dim=0)
    return label.reshape(1).to(torch.int32), best.reshape(1)


def pp_update_reference(x: torch.Tensor, chosen: torch.Tensor,
                        min_in: torch.Tensor) -> torch.Tensor:
    """k-means++ step: ``min(min_in, ||x - chosen||^2)`` per point."""
    return torch.minimum(min_in, ((x - chosen[None, :]) ** 2).sum(dim=1))


def update_affected_reference(centroids: torch.Tensor, counts: torch.Tensor,
                              batch_sums: torch.Tensor,
                              batch_counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Running means: ``c += (batch_sum - batch_count * c) / (count + batch_count)`` for the
    clusters the batch touched; ``(new_centroids, new_counts int32)``."""
    added = batch_counts.to(centroids.dtype)[:, None]
    total_counts = counts.long() + batch_counts.long()
    total = total_counts.to(centroids.dtype)[:, None]
    moved = centroids + (batch_sums - added * centroids) / total.clamp_min(1)
    return torch.where(added > 0, moved, centroids), total_counts.to(torch.int32)
