"""FLOPs, memory footprint and HBM traffic of attention.

Three parts:

* Exact FLOPs of a problem, with causal and window visibility counted pair by pair.
* The seed document's idealized model (memory of standard vs flash attention, the n x n score matrix, HBM
  traffic, shared memory per block size, arithmetic intensity, longest context under a budget). These
  functions reproduce its printed tables digit for digit, so they keep its conventions:
  its "GB" and "MB" are GiB and MiB (powers of 1024), and every head of a 32-head, d = 128 problem in
  a 2-byte dtype.
* The traffic of *our* kernel for a given tiling (Br, Bc): what it loads and stores, and the lower bound
  of touching every distinct byte once.

Where the seed's accounting is loose (kept as is in the seed functions, so its tables still match):

* Softmax statistics are charged at ``dtype_bytes`` each (two per row). Kernels keep m and l in float32
  registers and write at most one float32 log-sum-exp per row (ours does so only for ``return_lse``).
* Its traffic table charges K and V once, while its own ``hbm_io_cost_gb`` charges them once per query
  tile (n_blocks times), which is what a FlashAttention kernel loads. The table's 33x at n = 4096 is the
  ratio of compulsory traffic; see ``kernel_traffic`` for the loads, which L2 may or may not absorb.
* Its SRAM model puts Q, K, V and O tiles, all 2-byte, in shared memory with Br = Bc. FlashAttention-2
  style kernels keep O (float32) and the scores in registers. And its 192 KB is the A100's combined
  L1/shared memory per SM: a block can get at most 163 KiB there (``BLOCK_SMEM_LIMIT``). A block that
  does not fit fails to launch; nothing "spills to L2".
* Its arithmetic intensity counts only the K and V loads of one inner step, so it equals
  2 * block / dtype_bytes whatever d is: "128 ops/byte at block 128". The A100 80 GB's ridge is
  312 TFLOP/s / 2.04 TB/s ~ 153 FLOP/byte for dense fp16 (the seed says 200-300).
* Its context search stops at 262,144 tokens, so that is the list's cap, not the budget's: 20 GiB holds
  FlashAttention's Q, K, V, O for 655,360 tokens. Standard attention there counts the scores only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Tuple, Union

import numpy as np

from .devices import DeviceLimits
from .problem import Window

KiB = 1024
MiB = 1024**2
GiB = 1024**3

WindowSides = Union[None, Tuple[Optional[int], Optional[int]], Window]

# ---------------------------------------------------------------------------------------------------------
# Visibility and FLOPs
# ---------------------------------------------------------------------------------------------------------


def key_bounds(n: int, m: int, causal: bool = False, window: WindowSides = None) -> Tuple[int, int]:
    """(left, right) reach of a query, as finite ints (problem.Window's rule): key j is visible to query i when
    i + (m - n) - left <= j <= i + (m - n) + right."""
    if isinstance(window, Window):
        window = (window.left, window.right)
    return Window.of(window, causal).reach(n, m)


def visible_keys_per_row(n: int, m: int, causal: bool = False, window: WindowSides = None) -> np.ndarray:
    """Number of keys each of the n query rows sees (int64 array of length n)."""
    left, right = key_bounds(n, m, causal, window)
    diag = np.arange(n, dtype=np.int64) + (m - n)
    first = np.maximum(diag - left, 0)
    last = np.minimum(diag + right, m - 1)
    return np.maximum(last - first + 1, 0)


def visible_pairs(n: int, m: int, causal: bool = False, window: WindowSides = None) -> int:
    """Exact number of visible (query, key) pairs of one problem."""
    return int(visible_keys_per_row(n, m, causal, window).sum())


def flops(batch: int, n: int, m: int, d: int, e: Optional[int] = None, causal: bool = False,
          window: WindowSides = None) -> int:
    """Forward matmul FLOPs: 2*d per visible pair for q.k and 2*e for p.v (4*B*H*n*m*d when dense and d == e).

    batch is the number of independent problems (the product of the batch shape, e.g. B*H). Softmax
    exponentials and rescaling are not counted, as is usual for attention FLOP rates.
    """
    e = d if e is None else e
    return 2 * (d + e) * batch * visible_pairs(n, m, causal, window)


# ---------------------------------------------------------------------------------------------------------
# The seed's idealized model (bytes; the seed prints them in MiB and GiB)
# ---------------------------------------------------------------------------------------------------------

SEED_HEADS = 32
SEED_D = 128
SEED_DTYPE_BYTES = 2
SEED_BLOCKS = (16, 32, 64, 128, 256, 512)
SEED_CONTEXT_LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
SEED_A100_SRAM = 192 * KiB  # the A100's combined L1/shared memory per SM, not what a block can get


def score_matrix_bytes(n: int, heads: int, dtype_bytes: int = 2) -> int:
    """The heads x n x n score matrix that standard attention materializes."""
    return heads * n * n * dtype_bytes


def standard_memory_bytes(n: int, heads: int, d: int, dtype_bytes: int = 2) -> int:
    """Standard attention: the score matrix plus Q, K, V and O."""
    return score_matrix_bytes(n, heads, dtype_bytes) + 4 * heads * n * d * dtype_bytes


def flash_memory_bytes(n: int, heads: int, d: int, dtype_bytes: int = 2, stat_bytes: Optional[int] = None) -> int:
    """FlashAttention: Q, K, V, O plus two softmax statistics per row.

    The seed stores each statistic in dtype_bytes (the default); pass stat_bytes=4 for float32.
    """
    stat_bytes = dtype_bytes if stat_bytes is None else stat_bytes
    return 4 * heads * n * d * dtype_bytes + heads * n * 2 * stat_bytes


def standard_traffic_bytes(n: int, heads: int, d: int, dtype_bytes: int = 2) -> int:
    """Standard attention's HBM traffic: four passes over the score matrix, Q, K, V read and O written once."""
    return 4 * score_matrix_bytes(n, heads, dtype_bytes) + 4 * heads * n * d * dtype_bytes


def flash_traffic_bytes(n: int, heads: int, d: int, dtype_bytes: int = 2, kv_passes: int = 1) -> int:
    """FlashAttention's HBM traffic: Q read and O written once, K and V read kv_passes times.

    kv_passes=1 is the seed's traffic table; kv_passes=ceil(n / block) is its hbm_io_cost_gb.
    """
    one = heads * n * d * dtype_bytes
    return 2 * one + 2 * one * kv_passes


@dataclass(frozen=True)
class SramUsage:
    """The seed's shared memory of one block, in bytes: Q, K+V, O tiles and the fp32 m, l per row."""

    q: int
    kv: int
    out: int
    stats: int

    @property
    def total(self) -> int:
        return self.q + self.kv + self.out + self.stats


def sram_bytes(block: int, d: int, dtype_bytes: int = 2) -> SramUsage:
    """The seed's per-block shared memory with Br = Bc = block."""
    tile = block * d * dtype_bytes
    return SramUsage(q=tile, kv=2 * tile, out=tile, stats=block * 2 * 4)


def seed_arithmetic_intensity(block: int, d: int, dtype_bytes: int = 2) -> float:
    """The seed's FLOPs per byte of one inner step: 4*Br*Bc*d FLOPs over the K and V tile loads only."""
    return 4 * block * block * d / (2 * block * d * dtype_bytes)


def best_block(sram_budget: int, d: int, dtype_bytes: int = 2, blocks=SEED_BLOCKS) -> Optional[int]:
    """The seed's rule: the largest block whose sram_bytes fit the budget (None if none fits)."""
    fitting = [b for b in blocks if sram_bytes(b, d, dtype_bytes).total <= sram_budget]
    return max(fitting, default=None)


def max_context(heads: int, d: int, budget_bytes: float, method: str, lengths=SEED_CONTEXT_LENGTHS) -> int:
    """The seed's longest context whose attention activations fit the budget; 0 if none does.

    method "standard" counts the score matrix only, "flash" counts Q, K, V and O (both in 2 bytes).
    """
    if method not in ("standard", "flash"):
        raise ValueError(f"method must be 'standard' or 'flash', not {method!r}")
    best = 0
    for n in lengths:
        need = score_matrix_bytes(n, heads) if method == "standard" else 4 * heads * n * d * 2
        if need <= budget_bytes:
            best = n
    return best


# ---------------------------------------------------------------------------------------------------------
# Real per-block shared memory limits (CUDA C Programming Guide, opt-in maximum per block)
# ---------------------------------------------------------------------------------------------------------

# The table's columns: a GPU of devices.KNOWN for each (the one place its limits are written).
_TABLE_GPUS = {"V100": "Tesla V100", "T4": "Tesla T4", "A100": "A100", "A10/RTX 3090": "A10",
               "L4/RTX 4090": "L4", "H100/H200": "H100"}
BLOCK_SMEM_LIMIT = {column: DeviceLimits.known(name).smem_per_block for column, name in _TABLE_GPUS.items()}
DEFAULT_BLOCK_SMEM = DeviceLimits.known("A100").smem_default  # what a block gets on any of them without opting in


# ---------------------------------------------------------------------------------------------------------
# Our kernel's traffic
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Bytes moved between HBM and the chip, per operand (lse: the float32 log-sum-exp per row)."""

    q: int = 0
    k: int = 0
    v: int = 0
    o: int = 0
    lse: int = 0
    mask: int = 0
    bias: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class _TileWalk:
    """What one batch element's query tiles see: key rows loaded, and mask/bias elements read."""

    key_rows: int  # sum over query tiles of the rows of the key tiles they visit
    tile_elems: int  # sum over query tiles of (query rows) x (key rows visited)
    distinct_key_rows: int  # key rows visited by at least one query tile
    query_rows_per_tile: int  # sum over query tiles of (query rows) x (key tiles visited)


def _tile_walk(n: int, m: int, Br: int, Bc: int, causal: bool, window: WindowSides) -> _TileWalk:
    """Each query tile visits the key tiles from the first to the last one holding a visible key.

    The rows of a query tile see keys [i0 + off - left, i1 - 1 + off + right] between them (each row's
    range is the previous one shifted by one), so every key tile in that span has a visible pair and
    every other is skipped.
    """
    if Br < 1 or Bc < 1:
        raise ValueError(f"tile sizes must be positive, got Br={Br}, Bc={Bc}")
    left, right = key_bounds(n, m, causal, window)
    i0 = np.arange(0, n, Br, dtype=np.int64)
    i1 = np.minimum(i0 + Br, n)
    first_key = np.maximum(i0 + (m - n) - left, 0)
    last_key = np.minimum(i1 - 1 + (m - n) + right, m - 1)
    seen = (last_key >= first_key) & (left + right >= 0)
    j0 = (first_key // Bc) * Bc  # first key row of the first tile visited
    j1 = np.minimum((last_key // Bc + 1) * Bc, m)  # one past the last tile's rows
    rows = np.where(seen, j1 - j0, 0)
    key_tiles = np.where(seen, last_key // Bc - first_key // Bc + 1, 0)
    distinct = int(j1[seen].max() - j0[seen].min()) if seen.any() else 0
    return _TileWalk(int(rows.sum()), int((rows * (i1 - i0)).sum()), distinct, int((key_tiles * (i1 - i0)).sum()))


def kernel_traffic(batch: int, n: int, m: int, d: int, e: Optional[int] = None, *, itemsize: int = 2,
                   Br: int = 128, Bc: int = 64, causal: bool = False, window: WindowSides = None,
                   lse: bool = True, mask_itemsize: int = 0, bias_itemsize: int = 0,
                   d_slice: Optional[int] = None, e_block: Optional[int] = None, splits: int = 1,
                   acc_itemsize: int = 4) -> Traffic:
    """What our forward kernel loads and stores for `batch` problems tiled Br x Bc.

    Q is loaded and O stored once; each query tile loads the K and V tiles it visits (ceil(n/Br) passes
    when nothing is masked by causal/window) and the mask and bias elements of those tiles (itemsize 0: no
    such operand). Broadcast operands are loaded by every batch element all the same; repeated loads may
    hit L2, so real DRAM traffic lies between compulsory_traffic and this.

    Head dimensions past the CUDA-core kernel's tiles (d_slice, e_block: its D and E; None: no limit): a d above
    d_slice reloads Q with every key tile visited, and an e above e_block takes ceil(e / e_block) launches, each
    loading Q, K, mask and bias again (V and O are split between them, lse is written by the first).

    Split keys (splits > 1, decoding): each split writes a partial O and lse in the accumulator type
    (acc_itemsize), which the merge reads back; K and V are still read once per query tile, split among the
    splits.
    """
    e = d if e is None else e
    walk = _tile_walk(n, m, Br, Bc, causal, window)
    blocks = -(-e // e_block) if e_block and e > e_block else 1
    q_rows = walk.query_rows_per_tile if d_slice and d > d_slice else n
    parts = 2 * splits * batch * n * acc_itemsize if splits > 1 else 0  # written, then read by the merge
    return Traffic(
        q=blocks * batch * q_rows * d * itemsize,
        k=blocks * batch * walk.key_rows * d * itemsize,
        v=batch * walk.key_rows * e * itemsize,
        o=batch * n * e * itemsize + parts * e,
        lse=(batch * n * 4 if lse else 0) + parts,
        mask=blocks * batch * walk.tile_elems * mask_itemsize,
        bias=blocks * batch * walk.tile_elems * bias_itemsize,
    )


def compulsory_traffic(batch: int, n: int, m: int, d: int, e: Optional[int] = None, *, itemsize: int = 2,
                       Br: int = 128, Bc: int = 64, causal: bool = False, window: WindowSides = None,
                       lse: bool = True, mask_itemsize: int = 0, bias_itemsize: int = 0,
                       kv_copies: Optional[int] = None, mask_copies: Optional[int] = None,
                       bias_copies: Optional[int] = None) -> Traffic:
    """Every distinct byte our kernel needs, touched once: the lower bound of its DRAM traffic.

    *_copies is how many distinct copies of an operand the batch holds: None means one per batch
    element, 1 means broadcast over the whole batch (stride 0), H for K/V shared by the heads of a
    B x H batch, and so on. Key rows and mask/bias tiles that no query tile visits are not counted.
    """
    e = d if e is None else e
    walk = _tile_walk(n, m, Br, Bc, causal, window)

    def copies(c):
        return batch if c is None else c

    return Traffic(
        q=batch * n * d * itemsize,
        k=copies(kv_copies) * walk.distinct_key_rows * d * itemsize,
        v=copies(kv_copies) * walk.distinct_key_rows * e * itemsize,
        o=batch * n * e * itemsize,
        lse=batch * n * 4 if lse else 0,
        mask=copies(mask_copies) * walk.tile_elems * mask_itemsize,
        bias=copies(bias_copies) * walk.tile_elems * bias_itemsize,
    )


def kv_passes(n: int, m: int, Br: int, Bc: int, causal: bool = False, window: WindowSides = None) -> float:
    """How many times K is loaded in full, on average (ceil(n / Br) when nothing is masked)."""
    return _tile_walk(n, m, Br, Bc, causal, window).key_rows / m if m else 0.0


def kernel_arithmetic_intensity(batch: int, n: int, m: int, d: int, e: Optional[int] = None, *,
                                itemsize: int = 2, Br: int = 128, Bc: int = 64, causal: bool = False,
                                window: WindowSides = None) -> float:
    """FLOPs per byte our kernel loads and stores (all of it, not one inner step)."""
    moved = kernel_traffic(batch, n, m, d, e, itemsize=itemsize, Br=Br, Bc=Bc, causal=causal,
                           window=window).total
    return flops(batch, n, m, d, e, causal, window) / moved if moved else 0.0


def problem_flops(problem) -> int:
    """flops() of a Problem (batch_size, n, m, d, e, window; its window already holds causal)."""
    return flops(problem.batch_size, problem.n, problem.m, problem.d, problem.e, window=problem.window)
