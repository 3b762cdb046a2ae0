"""Benchmarks: ``python -m torch_sparse_metal.bench <name> [--json]``.

Performance claims live here, not in timed tests. On Linux the benchmarks run the
emulator; numbers for Apple GPUs are printed only when measured on one.
"""
