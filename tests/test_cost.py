"""The cost model: the seed's printed digits, exact FLOPs against brute force, and our kernel's tile walk."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cuflash import cost
from reference import visibility  # the visibility rule written out over every (i, j)

H, D = 32, 128

# ---------------------------------------------------------------------------------------------------------
# The seed's tables, row by row as printed (its GB and MB are GiB and MiB)
# ---------------------------------------------------------------------------------------------------------

MEMORY_ROWS = [  # n, standard (MB), flash (MB), reduction, savings (MB), score matrix (GB)
    (512, "32.0", "16.1", "2.0", "15.9", "0.02"),
    (1024, "96.0", "32.1", "3.0", "63.9", "0.06"),
    (2048, "320.0", "64.2", "5.0", "255.8", "0.25"),
    (4096, "1152.0", "128.5", "9.0", "1023.5", "1.00"),
    (8192, "4352.0", "257.0", "16.9", "4095.0", "4.00"),
    (16384, "16896.0", "514.0", "32.9", "16382.0", "16.00"),
    (32768, "66560.0", "1028.0", "64.7", "65532.0", "64.00"),
]


@pytest.mark.parametrize("n, std, flash, ratio, savings, scores", MEMORY_ROWS)
def test_seed_memory_table(n, std, flash, ratio, savings, scores):
    s = cost.standard_memory_bytes(n, H, D) / cost.MiB
    f = cost.flash_memory_bytes(n, H, D) / cost.MiB
    assert (f"{s:.1f}", f"{f:.1f}", f"{s / f:.1f}", f"{s - f:.1f}") == (std, flash, ratio, savings)
    assert f"{cost.score_matrix_bytes(n, H) / cost.GiB:.2f}" == scores


SRAM_ROWS = [  # block, Q, KV, Out, Stats, Total (KB), fits 192 KB, arithmetic intensity
    (16, "4.0", "8.0", "4.0", "0.1", "16.1", True, "16.0"),
    (32, "8.0", "16.0", "8.0", "0.2", "32.2", True, "32.0"),
    (64, "16.0", "32.0", "16.0", "0.5", "64.5", True, "64.0"),
    (128, "32.0", "64.0", "32.0", "1.0", "129.0", True, "128.0"),
    (256, "64.0", "128.0", "64.0", "2.0", "258.0", False, "256.0"),
    (512, "128.0", "256.0", "128.0", "4.0", "516.0", False, "512.0"),
]


@pytest.mark.parametrize("block, q, kv, out, stats, total, fits, ai", SRAM_ROWS)
def test_seed_sram_table(block, q, kv, out, stats, total, fits, ai):
    use = cost.sram_bytes(block, D)
    got = [f"{x / cost.KiB:.1f}" for x in (use.q, use.kv, use.out, use.stats, use.total)]
    assert got == [q, kv, out, stats, total]
    assert (use.total <= cost.SEED_A100_SRAM) == fits
    assert f"{cost.seed_arithmetic_intensity(block, D):.1f}" == ai


@pytest.mark.parametrize("sram_kb, block", [(96, 64), (192, 128), (384, 256)])
def test_seed_best_block(sram_kb, block):
    assert cost.best_block(sram_kb * cost.KiB, D) == block
    assert cost.seed_arithmetic_intensity(block, D) == float(block)


def test_best_block_none_fits():
    assert cost.best_block(8 * cost.KiB, D) is None


TRAFFIC_ROWS = [  # n, standard (GB), flash (GB), reduction
    (512, "0.08", "0.016", "5.0"),
    (1024, "0.28", "0.031", "9.0"),
    (2048, "1.06", "0.062", "17.0"),
    (4096, "4.12", "0.125", "33.0"),
    (8192, "16.25", "0.250", "65.0"),
    (16384, "64.50", "0.500", "129.0"),
]


@pytest.mark.parametrize("n, std, flash, ratio", TRAFFIC_ROWS)
def test_seed_traffic_table(n, std, flash, ratio):
    s = cost.standard_traffic_bytes(n, H, D) / cost.GiB
    f = cost.flash_traffic_bytes(n, H, D) / cost.GiB
    assert (f"{s:.2f}", f"{f:.3f}", f"{s / f:.1f}") == (std, flash, ratio)


def test_seed_context_table():
    assert cost.max_context(H, D, 20 * cost.GiB, "standard") == 16384
    assert cost.max_context(H, D, 20 * cost.GiB, "flash") == 262144
    # 262,144 is the end of the seed's list; the budget itself holds 655,360 tokens of Q, K, V, O.
    assert cost.max_context(H, D, 20 * cost.GiB, "flash", lengths=(655360, 655361)) == 655360
    with pytest.raises(ValueError, match="method"):
        cost.max_context(H, D, cost.GiB, "Standard attn")


def test_seed_stats_and_passes_conventions():
    # The seed charges two 2-byte statistics per row; float32 ones add 0.5 MiB more at n = 4096.
    assert cost.flash_memory_bytes(4096, H, D, stat_bytes=4) - cost.flash_memory_bytes(4096, H, D) == cost.MiB // 2
    # Its hbm_io_cost_gb (K, V n_blocks times) is our dense kernel's loads without the lse.
    for n in (512, 1000, 4096):
        ours = cost.kernel_traffic(H, n, n, D, Br=128, Bc=64, lse=False).total
        assert ours == cost.flash_traffic_bytes(n, H, D, kv_passes=math.ceil(n / 128))


def test_block_128_fits_a100_not_t4_or_a10():
    need = cost.sram_bytes(128, D).total
    assert need <= cost.BLOCK_SMEM_LIMIT["A100"] < cost.SEED_A100_SRAM
    assert need <= cost.BLOCK_SMEM_LIMIT["H100/H200"]
    for gpu in ("V100", "T4", "A10/RTX 3090", "L4/RTX 4090"):
        assert need > cost.BLOCK_SMEM_LIMIT[gpu]
    assert cost.BLOCK_SMEM_LIMIT["A100"] == 166912 and cost.BLOCK_SMEM_LIMIT["H100/H200"] == 232448


# ---------------------------------------------------------------------------------------------------------
# Monotonicity and ratios
# ---------------------------------------------------------------------------------------------------------

lengths = st.integers(1, 1 << 20)
heads = st.integers(1, 128)
dims = st.integers(1, 512)


@given(lengths, lengths, heads, dims)
def test_model_grows_with_n_and_so_do_its_ratios(n1, n2, h, d):
    a, b = sorted((n1, n2))
    for size in (cost.standard_memory_bytes, cost.flash_memory_bytes, cost.standard_traffic_bytes,
                 cost.flash_traffic_bytes):
        assert size(a, h, d) <= size(b, h, d)
    assert (cost.standard_memory_bytes(a, h, d) / cost.flash_memory_bytes(a, h, d)
            <= cost.standard_memory_bytes(b, h, d) / cost.flash_memory_bytes(b, h, d))
    assert (cost.standard_traffic_bytes(a, h, d) / cost.flash_traffic_bytes(a, h, d)
            <= cost.standard_traffic_bytes(b, h, d) / cost.flash_traffic_bytes(b, h, d))
    assert cost.score_matrix_bytes(a, h) <= cost.standard_memory_bytes(a, h, d)


@given(st.integers(1, 1024), st.integers(1, 1024), dims)
def test_sram_and_intensity_grow_with_block(b1, b2, d):
    a, b = sorted((b1, b2))
    assert cost.sram_bytes(a, d).total <= cost.sram_bytes(b, d).total
    assert cost.seed_arithmetic_intensity(a, d) <= cost.seed_arithmetic_intensity(b, d)


# ---------------------------------------------------------------------------------------------------------
# Exact FLOPs
# ---------------------------------------------------------------------------------------------------------


side = st.one_of(st.none(), st.integers(-3, 40))
windows = st.one_of(st.none(), st.tuples(side, side))
small = st.integers(0, 40)


@given(small, small, st.integers(1, 9), st.integers(1, 9), st.integers(1, 5), st.booleans(), windows)
def test_flops_equal_brute_force(n, m, d, e, batch, causal, window):
    pairs = int(visibility(n, m, causal, window).sum())
    assert cost.visible_pairs(n, m, causal, window) == pairs
    assert cost.flops(batch, n, m, d, e, causal, window) == batch * pairs * 2 * (d + e)


@given(st.integers(0, 5000))
def test_causal_square_counts_the_diagonal(n):
    assert cost.visible_pairs(n, n, causal=True) == n * (n + 1) // 2


@given(st.integers(1, 4096), st.integers(1, 4096), st.integers(1, 256), st.integers(1, 64))
def test_dense_flops_are_4bnmd(n, m, d, batch):
    assert cost.flops(batch, n, m, d) == 4 * batch * n * m * d
    assert cost.visible_pairs(n, m, window=(None, None)) == n * m


def test_causal_with_n_above_and_below_m():
    # Bottom-right alignment: with n > m the first n - m rows see nothing.
    assert list(cost.visible_keys_per_row(4, 2, causal=True)) == [0, 0, 1, 2]
    assert list(cost.visible_keys_per_row(2, 4, causal=True)) == [3, 4]
    assert list(cost.visible_keys_per_row(3, 3, window=(1, 0))) == [1, 2, 2]


def test_problem_flops_reads_a_problem():
    problem = SimpleNamespace(batch_size=6, n=5, m=7, d=3, e=2, window=(None, 0))
    assert cost.problem_flops(problem) == cost.flops(6, 5, 7, 3, 2, causal=True)


# ---------------------------------------------------------------------------------------------------------
# Our kernel's traffic: the tile walk against brute force
# ---------------------------------------------------------------------------------------------------------


def brute_walk(n, m, br, bc, causal, window):
    """(key rows loaded, mask elements read, distinct key rows, query rows loaded when Q is reloaded with every
    key tile) over the tiles holding a visible pair."""
    vis = visibility(n, m, causal, window)
    key_rows = elems = query_rows = 0
    used = np.zeros(m, dtype=bool)
    for i0 in range(0, n, br):
        for j0 in range(0, m, bc):
            tile = vis[i0:i0 + br, j0:j0 + bc]
            if tile.any():
                key_rows += tile.shape[1]
                query_rows += tile.shape[0]
                elems += tile.size
                used[j0:j0 + bc] = True
    return key_rows, elems, int(used.sum()), query_rows


tiles = st.sampled_from([1, 2, 3, 4, 5, 8, 16, 64])


@given(small, small, tiles, tiles, st.booleans(), windows, st.integers(1, 3))
def test_kernel_traffic_equals_brute_tile_walk(n, m, br, bc, causal, window, batch):
    d, e, size = 4, 3, 2
    key_rows, elems, distinct, query_rows = brute_walk(n, m, br, bc, causal, window)
    t = cost.kernel_traffic(batch, n, m, d, e, itemsize=size, Br=br, Bc=bc, causal=causal, window=window,
                            mask_itemsize=1, bias_itemsize=4)
    assert t == cost.Traffic(q=batch * n * d * size, k=batch * key_rows * d * size, v=batch * key_rows * e * size,
                             o=batch * n * e * size, lse=batch * n * 4, mask=batch * elems, bias=batch * elems * 4)
    # d in slices of 2 (Q reloaded per key tile), e in column blocks of 2 (two launches: Q, K, mask, bias twice)
    sliced = cost.kernel_traffic(batch, n, m, d, e, itemsize=size, Br=br, Bc=bc, causal=causal, window=window,
                                 mask_itemsize=1, bias_itemsize=4, d_slice=2, e_block=2)
    assert sliced == cost.Traffic(q=2 * batch * query_rows * d * size, k=2 * t.k, v=t.v, o=t.o, lse=t.lse,
                                  mask=2 * t.mask, bias=2 * t.bias)
    # split keys: partial O and lse (float32) written and read back once per split
    split = cost.kernel_traffic(batch, n, m, d, e, itemsize=size, Br=br, Bc=bc, causal=causal, window=window,
                                mask_itemsize=1, bias_itemsize=4, splits=3)
    assert split == cost.Traffic(q=t.q, k=t.k, v=t.v, o=t.o + 2 * 3 * batch * n * e * 4,
                                 lse=t.lse + 2 * 3 * batch * n * 4, mask=t.mask, bias=t.bias)
    least = cost.compulsory_traffic(batch, n, m, d, e, itemsize=size, Br=br, Bc=bc, causal=causal, window=window,
                                    mask_itemsize=1, bias_itemsize=4, kv_copies=1, mask_copies=1)
    assert least.k == distinct * d * size and least.mask == elems and least.bias == batch * elems * 4
    assert least.total <= t.total


@given(st.integers(1, 3000), st.integers(1, 3000), tiles, tiles)
def test_dense_kernel_loads_kv_once_per_query_tile(n, m, br, bc):
    t = cost.kernel_traffic(2, n, m, 8, Br=br, Bc=bc)
    assert t.k == t.v == 2 * math.ceil(n / br) * m * 8 * 2
    assert cost.kv_passes(n, m, br, bc) == math.ceil(n / br)
    least = cost.compulsory_traffic(2, n, m, 8, Br=br, Bc=bc)
    assert least.k == 2 * m * 8 * 2
    if n <= br:  # one query tile: nothing to load twice
        assert least == t


def test_causal_halves_kv_passes_at_tile_granularity():
    # 32 query tiles of 128 rows, key tiles of 64: tile t visits 2(t+1) key tiles, 16.5 passes on average.
    assert cost.kv_passes(4096, 4096, 128, 64, causal=True) == 16.5
    assert cost.kv_passes(4096, 4096, 128, 64) == 32


def test_kernel_intensity_approaches_the_seeds_per_step_figure():
    ai = cost.kernel_arithmetic_intensity(H, 1 << 16, 1 << 16, D, Br=128, Bc=64)
    assert 127 < ai < cost.seed_arithmetic_intensity(128, D)


def test_bad_tiles_are_refused():
    with pytest.raises(ValueError, match="tile sizes"):
        cost.kernel_traffic(1, 8, 8, 4, Br=0)
