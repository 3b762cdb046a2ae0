"""Apple GPUs' public peak figures, each with its source: FP32 FLOP/s and memory bandwidth.

``FP32`` figures are Apple's or derived from a public measurement of the clock (cores x 128
FP32 lanes x 2 FLOP per FMA x clock); for chips where neither exists (M3, M4 and M5
families) the table holds no FP32 figure, and the roofline uses a third-party estimate,
marked as one. Each figure is for the chip's full-core configuration: a binned part has a
lower peak, so bounds computed from these figures stay lower bounds for it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

_APPLE_M1 = "Apple newsroom, 'Apple unleashes M1' (2020-11-10): 2.6 teraflops"
_METAL_BENCHMARKS = ("github.com/philipturner/metal-benchmarks, README GPU table "
                     "(cores x 128 ALUs x 2 FLOP x clock)")
_APPLE_MAC_PRO = "apple.com/mac-pro (2023): M2 Ultra's 76-core GPU, up to 27.2 teraflops"
_NO_FIGURE = ("no public figure: Apple states none for this chip and no public measurement "
              "was found; pass --peak-tflops")


@dataclass(frozen=True)
class Chip:
    """``name`` is the Metal device's name. ``fp32_tflops``: Apple's or a measured-clock
    figure, None without one; ``fp32_estimate``: a third-party (TFLOP/s, source) the
    roofline falls back to. ``bandwidth_gbs``: unified memory bandwidth, GB/s."""
    name: str
    fp32_tflops: Optional[float]
    fp32_source: str
    bandwidth_gbs: Optional[float] = None
    bandwidth_source: str = ""
    fp32_estimate: Optional[Tuple[float, str]] = None

    def roofline_tflops(self) -> Tuple[float, bool]:
        """(FP32 TFLOP/s for a bound, whether it is a third-party estimate)."""
        if self.fp32_tflops is not None:
            return self.fp32_tflops, False
        assert self.fp32_estimate is not None, self.name
        return self.fp32_estimate[0], True


def _estimate(tflops: float, cores: int, ghz: float, where: str) -> Tuple[float, str]:
    return tflops, (f"third-party estimate: {cores} cores x 128 x 2 FLOP x {ghz} GHz "
                    f"({where}); Apple publishes no FP32 figure")


_CHIPS = (
    Chip("Apple M1", 2.6, _APPLE_M1, 68.25,
         "LPDDR4X-4266 on a 128-bit bus (4266 MT/s x 16 B); Apple states no figure"),
    Chip("Apple M1 Pro", 5.3, _METAL_BENCHMARKS),     # 16 cores, 1.296 GHz
    Chip("Apple M1 Max", 10.6, _METAL_BENCHMARKS, 400.0,  # 32 cores
         "Apple newsroom, 'Introducing M1 Pro and M1 Max' (2021-10-18): 400GB/s"),
    Chip("Apple M1 Ultra", 21.2, _METAL_BENCHMARKS),  # 64 cores
    Chip("Apple M2", 3.6, _METAL_BENCHMARKS),         # 10 cores, 1.398 GHz
    Chip("Apple M2 Pro", 6.8, _METAL_BENCHMARKS),     # 19 cores
    Chip("Apple M2 Max", 13.6, _METAL_BENCHMARKS, 400.0,  # 38 cores
         "Apple newsroom, 'Apple unveils M2 Pro and M2 Max' (2023-01-17): 400GB/s"),
    Chip("Apple M2 Ultra", 27.2, _APPLE_MAC_PRO),     # 76 cores
    Chip("Apple M3", None, _NO_FIGURE),
    Chip("Apple M3 Pro", None, _NO_FIGURE),
    Chip("Apple M3 Max", None, _NO_FIGURE, 400.0,
         "Apple newsroom, M3 family announcement (2023-10-30): 400GB/s with the 40-core GPU",
         _estimate(16.4, 40, 1.6, "radargit.com M3 Max 40-core specifications")),
    Chip("Apple M3 Ultra", None, _NO_FIGURE),
    Chip("Apple M4", None, _NO_FIGURE, 120.0,
         "Apple newsroom, 'Apple introduces M4 chip' (2024-05-07): 120GB/s",
         _estimate(4.1, 10, 1.6, "cputime.net Apple M4 specifications")),
    Chip("Apple M4 Pro", None, _NO_FIGURE),
    Chip("Apple M4 Max", None, _NO_FIGURE, 546.0,
         "Apple newsroom, M4 Max MacBook Pro announcement (2024-10-30): 546GB/s",
         _estimate(18.4, 40, 1.8, "the clock commonly listed for the 40-core M4 Max")),
    Chip("Apple M5", None, _NO_FIGURE, 153.0,
         "Apple newsroom, 'Apple unleashes M5' (2025-10-15): 153GB/s",
         _estimate(4.45, 10, 1.74, "hmc-tech.com 10-core M5 specifications")),
)
CHIPS: Dict[str, Chip] = {c.name: c for c in _CHIPS}

# The chips a roofline can be asked for (--chip), each with an FP32 figure and a bandwidth.
ROOFLINE_CHIPS: Dict[str, Chip] = {
    key: CHIPS[name] for key, name in (
        ("m1", "Apple M1"), ("m1-max", "Apple M1 Max"), ("m2-max", "Apple M2 Max"),
        ("m3-max", "Apple M3 Max"), ("m4", "Apple M4"), ("m4-max", "Apple M4 Max"),
        ("m5", "Apple M5"))}

# FP32 peaks by the Metal device's name (matmul's "% of peak"): Apple's or measured-clock
# figures only; None where there is none (--peak-tflops then).
FP32_PEAKS: Dict[str, Tuple[Optional[float], str]] = {
    c.name: (c.fp32_tflops, c.fp32_source) for c in _CHIPS}
