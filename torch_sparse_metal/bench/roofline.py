"""A lower bound on a kernel's GPU time from the emulator's counters and a chip's peaks.

``bound = max(FLOPs / peak FP32 FLOP/s, transferred bytes / memory bandwidth)``, with
FLOPs = 2 x the counted FMAs and transferred bytes = the counted device transactions x the
segment size (every transaction goes to memory: no cache model). It is a bound computed
from counters, never a measurement: a real kernel also waits on latency, launches,
instruction issue and the atomics' serialisation, none of which it counts.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

from ..emulator import DEFAULT_SEGMENT_BYTES, coalescing_efficiency, lane_efficiency
from .chips import ROOFLINE_CHIPS, Chip

LABEL = ("bound: max(2 x FMAs / peak FP32, transactions x {segment} B / bandwidth), computed "
         "from emulator counters with public peak figures{estimate}; a lower bound, not a "
         "measurement")


def chip(key: str) -> Chip:
    """The chip for a ``--chip`` value (ValueError naming the choices otherwise)."""
    try:
        return ROOFLINE_CHIPS[key]
    except KeyError:
        raise ValueError(f"unknown chip {key!r}: choose from "
                         f"{', '.join(ROOFLINE_CHIPS)}") from None


def device_bytes(counters: Mapping[str, int]) -> int:
    """Bytes a launch's threads read from and wrote to device memory (what they asked for,
    not the transactions that served it)."""
    return counters["device_bytes_read"] + counters["device_bytes_written"]


def bound(counters: Mapping[str, int], chip: Chip,
          segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Dict[str, object]:
    """The bound for one launch's (or a sum of launches') counters on ``chip``:
    ``flops``, ``transferred_bytes``, ``compute_us``, ``memory_us``, ``bound_us`` and
    ``limited_by`` ("compute" or "memory")."""
    tflops, estimated = chip.roofline_tflops()
    flops = 2 * counters["fmas"]
    moved = counters["device_transactions"] * segment_bytes
    compute_us = flops / (tflops * 1e12) * 1e6
    memory_us = moved / (chip.bandwidth_gbs * 1e9) * 1e6
    return {"chip": chip.name, "peak_tflops": tflops, "peak_tflops_estimated": estimated,
            "bandwidth_gbs": chip.bandwidth_gbs, "flops": flops, "transferred_bytes": moved,
            "compute_us": compute_us, "memory_us": memory_us,
            "bound_us": max(compute_us, memory_us),
            "limited_by": "compute" if compute_us > memory_us else "memory"}


def coalescing_columns(counters: Mapping[str, int]) -> Dict[str, object]:
    """What a row reports of the transaction counters."""
    return {"device_transactions": counters["device_transactions"],
            "device_min_transactions": counters["device_min_transactions"],
            "coalescing_efficiency": coalescing_efficiency(counters),
            "lane_efficiency": lane_efficiency(counters),
            "atomic_instructions": counters["atomic_instructions"],
            "atomic_conflicts": counters["atomic_conflicts"]}


def header(chips: Sequence[Chip]) -> str:
    return (f"{'transactions':>13}{'min':>11}{'coalesced':>10}{'lanes':>7}"
            + "".join(f"{'bound us ' + short_name(c):>18}" for c in chips))


def cells(counters: Mapping[str, int], chips: Sequence[Chip]) -> str:
    """The transaction counters and each chip's bound, as table cells under :func:`header`."""
    text = (f"{counters['device_transactions']:>13}{counters['device_min_transactions']:>11}"
            f"{coalescing_efficiency(counters):>10.1%}{lane_efficiency(counters):>7.1%}")
    for c in chips:
        b = bound(counters, c)
        text += f"{b['bound_us']:>12.2f} ({b['limited_by'][:3]})"
    return text


def footnote(chips: Sequence[Chip]) -> List[str]:
    """The lines that say what the bound is and where each chip's figures come from."""
    estimated = any(c.roofline_tflops()[1] for c in chips)
    lines = [LABEL.format(segment=DEFAULT_SEGMENT_BYTES,
                          estimate=" (FP32 of M3/M4/M5: third-party estimates)" if estimated else "")]
    for c in chips:
        tflops, est = c.roofline_tflops()
        source = c.fp32_estimate[1] if est else c.fp32_source
        lines.append(f"  {c.name}: {tflops} TFLOP/s FP32 ({source}); {c.bandwidth_gbs:g} GB/s "
                     f"({c.bandwidth_source})")
    return lines


def short_name(c: Chip) -> str:
    return c.name.replace("Apple ", "")
