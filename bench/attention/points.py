"""The problems the benchmark times (Point) and the named sets of them (PRESETS), each preset with its forced
tilings, warm-up, repeats and time budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from cuflash import cost  # cost needs numpy only, so it imports where cuflash's backends cannot


@dataclass(frozen=True)
class Point:
    """One attention problem: (batch, heads, n, d) queries against (batch, heads, m, d) keys and values."""

    dtype: str
    batch: int
    heads: int
    n: int
    m: int
    d: int
    causal: bool

    @property
    def label(self) -> str:
        return (f"{self.dtype} {self.batch}x{self.heads} n={self.n} m={self.m} d={self.d}"
                + (" causal" if self.causal else ""))

    @property
    def pairs(self) -> int:
        return self.batch * self.heads * self.n * self.m

    def flops(self) -> int:
        return cost.flops(self.batch * self.heads, self.n, self.m, self.d, causal=self.causal)


def grid(dtypes, ds, ns, causals=(False, True), m_per_n=1.0, tokens=16384, hidden=2048) -> List[Point]:
    """Points with tokens = batch * n and hidden = heads * d held fixed, as FlashAttention-2's benchmark does."""
    return [Point(t, max(1, tokens // n), max(1, hidden // d), n, max(1, int(n * m_per_n)), d, c)
            for t in dtypes for d in ds for n in ns for c in causals]


@dataclass(frozen=True)
class Preset:
    points: Tuple[Point, ...]
    blocks: Tuple[Tuple[int, int], ...]  # forced cuflash tilings timed beside the heuristic's choice
    gpu: bool  # needs a CUDA device
    warmup: int
    repeats: int
    matmul: int  # side of the square matmul timed as the peak
    budget_s: float = 2.0  # timing stops after this many seconds per backend (at least 3 calls)


def decode(dtype, d, ms, batch=1, heads=16) -> List[Point]:
    """Decoding points: one query per head over an m-key cache, too few blocks to fill a GPU unless keys split."""
    return [Point(dtype, batch, heads, 1, m, d, False) for m in ms]


HALF = ("float16", "bfloat16")
FA2_POINTS = grid(HALF, (64, 128), (1024, 2048, 4096, 8192, 16384))
PRESETS = {
    # The tensor-core issue's targets: forward, n = m from 1k to 16k, B*n = 16384, heads = 2048 / d.
    "fa2": Preset(tuple(FA2_POINTS), ((128, 64), (128, 128), (64, 64)), True, 3, 20, 8192),
    # Everything: the fa2 points, other head dims, float32 and float64 (each precision), and n != m both ways.
    "sweep": Preset(tuple(FA2_POINTS
                          + grid(HALF, (32, 256), (1024, 4096, 16384))
                          + grid(("float32",), (64, 128), (1024, 4096, 16384))
                          + grid(("float64",), (64, 128), (1024, 4096), causals=(False,))
                          + grid(("float16",), (64, 128), (1024, 4096), m_per_n=4)
                          + grid(("float16",), (128,), (4096,), causals=(False,), m_per_n=0.25)
                          + decode("float16", 128, (4096, 16384, 65536))),
                    ((128, 64), (64, 64)), True, 3, 10, 8192),
    # The device check's: a couple of minutes with kernel compilation included.
    "short": Preset(tuple(grid(HALF, (128,), (2048, 8192), causals=(False,))
                          + grid(("float16",), (128,), (8192,), causals=(True,))
                          + grid(("float16",), (64,), (4096,), causals=(False,))
                          + grid(("float16",), (128,), (1024,), causals=(True,), m_per_n=4)
                          + decode("float16", 128, (32768,))
                          + grid(("float32",), (128,), (4096,), causals=(False,))
                          + grid(("float64",), (64,), (2048,), causals=(False,))),
                    ((128, 64),), True, 2, 10, 8192, budget_s=1.0),
    # A CPU without a GPU: the NumPy backend against naive NumPy.
    "cpu": Preset(tuple(grid(("float32",), (64,), (256, 512, 1024), tokens=1024, hidden=256)
                        + grid(("float64",), (64,), (1024,), causals=(False,), tokens=1024, hidden=256)
                        + grid(("float32",), (64,), (256,), m_per_n=4, tokens=1024, hidden=256)),
                  ((128, 256),), False, 1, 5, 1024, budget_s=1.0),
    # CI: a few seconds.
    "tiny": Preset(tuple(grid(("float32",), (16,), (64, 256), tokens=512, hidden=32)
                         + grid(("float32",), (16,), (64,), m_per_n=2, tokens=512, hidden=32)),
                   ((32, 32),), False, 1, 3, 256, budget_s=0.5),
}
