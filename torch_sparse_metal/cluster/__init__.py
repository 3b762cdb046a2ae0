"""Clustering estimators built on the package's kernels."""
from .kmeans import KMeans, NotFittedError

__all__ = ["KMeans", "NotFittedError"]
