"""The mutation check: does the suite catch what it claims to?

Each mutant is one small semantic bug (a visibility off-by-one, a dropped rescale, an unmasked tail, lse in the
wrong base, an unshifted merge, a multiply-by-zero where a selection belongs, a wrong fragment index in a PTX
twin, ...), written as the code it breaks: found anywhere in the package's source (or after the definition it
lives in), whitespace aside, so that moving code between files or re-wrapping it keeps the mutant applying. The
script applies one at a time to a temporary copy of the project, runs the tests that should catch it (stopping at
the first failure), and prints a table: mutant, caught or not, by which test, seconds. Every mutant in the list
must be caught; a mutant that survives is a hole in the suite.

    python tests/mutation.py              # every mutant, two at a time
    python tests/mutation.py --list       # the list, nothing run
    python tests/mutation.py merge-unshifted numpy-no-rescale --jobs 1

Runs by hand, not in CI: a mutated kernel is a new emulator build (g++, tens of seconds). The emulator's disk
cache is keyed by the source, so unmutated kernels come from the cache and mutated ones never pollute it.
tests/test_mutation_list.py (in CI) checks that every mutant still applies to the code as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

ROOT = Path(__file__).resolve().parents[1]


# Where mutants look: the package's source (Python, the kernels' CUDA, the emulator's runtime headers).
SOURCES = ("cuflash/**/*.py", "cuflash/**/*.cuh", "cuflash/**/*.h")


@dataclass(frozen=True)
class Edit:
    """One change: the first occurrence of `old` after `within` (a text that occurs once in the project: the
    definition the bug lives in; "" for the whole project, where `old` must then occur once) becomes `new`. Both
    are matched with any run of whitespace standing for any other, so that re-wrapping a line or moving a
    definition to another file keeps the mutant applying."""

    old: str
    new: str
    within: str = ""


@dataclass(frozen=True)
class Mutant:
    name: str
    edits: Tuple[Edit, ...]
    tests: Tuple[str, ...]  # pytest node ids, the likeliest catcher first
    why: str


def m(name, edits, tests, why):
    return Mutant(name, tuple(e if isinstance(e, Edit) else Edit(*e) for e in edits), tuple(tests), why)


NUMPY = "tests/test_attention_numpy.py::test_matches_reference"
CASES = "tests/test_attention_cases.py"
INPUTS = "tests/test_attention_inputs.py"
FMA = "tests/test_kernel_simt.py::test_matches_reference"
FMA_NAN = "tests/test_kernel_simt.py::test_nan_and_inf_in_hidden_keys_never_leak"
FMA_SPLIT = "tests/test_kernel_simt.py::test_split_keys"
MMA = "tests/test_kernel_mma.py::test_matches_reference"
MMA_SPLIT = "tests/test_kernel_mma.py::test_split_keys"
MMA_WIDE = "tests/test_kernel_mma_wide.py"
PTX = "tests/simt/test_simt_ptx.py"
BACKWARD = "tests/test_backward.py"
BWD_SIMT_FILE = "tests/test_backward_simt.py"
BWD_SIMT = f"{BWD_SIMT_FILE}::test_matches_reference"
BWD_WIDE = f"{BWD_SIMT_FILE}::test_float32_and_float64_tensor_core_kernels_match_reference"
BWD_WIDE_STEADY = f"{BWD_SIMT_FILE}::test_float32_and_float64_steady_loops_match_reference"
BWD_NON_FINITE = f"{BWD_SIMT_FILE}::test_hidden_non_finite_keys_never_leak"
VARLEN = "tests/test_varlen.py"
PAGED = "tests/test_paged.py"
DROPOUT = "tests/test_dropout.py"
DROPOUT_DENSE = f"{DROPOUT}::test_the_kernels_drop_what_the_numpy_backend_and_the_dense_formula_drop"
DROPOUT_REVEAL = f"{DROPOUT}::test_each_output_and_value_gradient_reveals_exactly_the_kept_elements"
DROPOUT_STEADY = f"{DROPOUT}::test_the_planners_tiles_drop_in_the_steady_loop"
DROPOUT_CHUNK = f"{DROPOUT}::test_the_kernels_count_batch_rows_and_keys_from_a_chunks_offsets"
DROPOUT_TILE = f"{DROPOUT}::test_a_keep_tile_holds_every_rows_bits_for_any_reader"

MUTANTS = (
    # ---- the front door and the Problem
    m("window-right-off-by-one",
      [("(j >= i - left) & (j <= i + right)",
        "(j >= i - left) & (j < i + right)", "def tile(self, xp, i0: int, i1: int, j0: int, j1: int,")],
      [NUMPY],
      "the numpy backend's per-tile visibility hides the diagonal key"),
    m("key-range-short",
      [("i1 - 1 + (m - n) + right + 1)",
        "i1 - 1 + (m - n) + right)")],
      [NUMPY],
      "the last visible key of a causal row tile is never swept"),
    m("tile-top-left",
      [("i = xp.arange(i0, i1)[:, None] + (m - n)",
        "i = xp.arange(i0, i1)[:, None]")],
      [NUMPY, f"{CASES}::test_causal_is_bottom_right_aligned"],
      "a tile's visibility aligned top-left instead of bottom-right"),
    m("default-scale-1/d",
      [("return 1.0 / math.sqrt(d) if d > 0 else 1.0",
        "return 1.0 / d if d > 0 else 1.0")],
      [f"{CASES}::test_result_is_exact_softmax_attention", NUMPY],
      "softmax temperature wrong by default"),
    m("causal-ignores-window",
      [("right = 0 if right is None else min(right, 0)",
        "right = 0",
        "def of(cls, window=None, causal: bool = False)")],
      [f"{CASES}::test_window_and_causal_intersect", NUMPY],
      "causal=True discards a window's tighter right side"),
    # ---- the NumPy backend
    m("numpy-no-rescale",
      [("o_new = alpha[..., None] * o_i + ",
        "o_new = o_i + ")],
      [NUMPY],
      "the running output is not rescaled when the running max grows (needs a second key tile)"),
    m("numpy-no-sum-rescale",
      [("l_new = alpha * l_i + ",
        "l_new = l_i + ")],
      [NUMPY],
      "the running sum is not rescaled"),
    m("numpy-lse-log2",
      [("m_i + xp.log(l_i)",
        "m_i + xp.log2(l_i)")],
      [NUMPY],
      "lse in base 2"),
    m("numpy-multiply-by-zero",
      [("    if bool(finite.all()):\n",
        "    if True:\n")],
      [NUMPY],
      "hidden values weighted by 0 instead of removed: 0 * inf = NaN leaks"),
    m("numpy-bias-hides-nothing",
      [("if problem.bias_hides:",
        "if False:")],
      [NUMPY, f"{INPUTS}::test_a_minus_inf_bias_hides_its_key_like_the_mask"],
      "a -inf bias weights its key by 0 instead of hiding it: NaN in that key leaks"),
    m("window-sides-unclamped",
      [("return far if side is None else max(-far, min(far, int(side)))",
        "return far if side is None else int(side)")],
      [f"{INPUTS}::test_window_sides_of_any_size"],
      "a window side past int64 overflows a backend's arithmetic"),
    m("numpy-unmasked-tile",
      [("visible = problem.window_tile(i0, i1, j0, j1)",
        "visible = None")],
      [NUMPY],
      "tiles straddling the window edge take every key"),
    # ---- the NumPy backward
    m("backward-no-delta",
      [("        dp -= delta\n",
        ""),
       ("augmented(do_i, -delta, xp)",
        "augmented(do_i, 0 * delta, xp)")],
      [f"{BACKWARD}::test_matches_reference"],
      "dS without FlashAttention-2's D_i = rowsum(dO * O): the softmax Jacobian's second term dropped"),
    m("backward-ds-unselected",
      [("    return ds_ij if visible is None else xp.where(visible, ds_ij, 0)\n",
        "    return ds_ij\n")],
      [f"{BACKWARD}::test_hidden_keys_get_zero_gradient_and_their_nan_never_leaks"],
      "dS of hidden pairs weighted by P = 0 instead of selected away: a NaN hidden value leaks into dq and dk"),
    m("backward-dk-unscaled",
      [("(ds_ij, -1, -2), scaled_q_i, visible_t, xp, q_finite)",
        "(ds_ij, -1, -2), q_i, visible_t, xp, q_finite)")],
      [f"{BACKWARD}::test_matches_reference"],
      "dK without the softmax scale"),
    m("backward-key-range-dq-dropped",
      [("            dq[piece[0][0]] += part\n",
        "            pass\n")],
      [f"{BACKWARD}::test_one_head_past_the_row_and_key_tiles"],
      "dQ of a head's key ranges after the first is summed apart and never added"),
    m("backward-threads-share-blas",
      [("    control.hold_one()\n",
        "    control.hold_one() if threads > 1 else None\n"),
       ("        control.release()\n",
        "        control.release() if threads > 1 else None\n")],
      [f"{BACKWARD}::test_workers_run_pieces_side_by_side_with_blas_on_one_thread"],
      "pieces on the calling thread keep BLAS's threads: their bits may differ from the worker threads'"),
    m("backward-broadcast-not-summed",
      [("    axes = tuple(i for i, (size, full) in enumerate(zip(shape, x.shape)) if size == 1 and full != 1)\n",
        "    axes = ()\n")],
      [f"{BACKWARD}::test_broadcast_axes_are_summed_and_shapes_kept"],
      "a gradient of a broadcast operand keeps one group member's share instead of the group's sum"),
    # ---- the merge of split keys
    m("merge-unshifted",
      [("weights = xp.exp(parts_lse - shift)",
        "weights = xp.exp(parts_lse)"),
       ("lse[...] = xp.log(total) + shift",
        "lse[...] = xp.log(total)")],
      [FMA_SPLIT, MMA_SPLIT, "tests/test_merge.py"],
      "exp(lse_s) overflows float32 once lse passes 88"),
    m("merge-unweighted",
      [("0, weights[..., None] * parts_out)",
        "0, parts_out)")],
      [FMA_SPLIT, "tests/test_merge.py"],
      "splits added without their weights"),
    # ---- cuflash.dask
    m("dask-window-shifted-wrongly",
      [("left - shift, None if right is None else right + shift",
        "left + shift, None if right is None else right - shift")],
      ["tests/test_dask.py::test_equals_attention_under_any_chunking"],
      "a chunk pair sees the global window unshifted the wrong way: off-diagonal pairs hide the wrong keys"),
    m("dask-last-visible-chunk-dropped",
      [("col + width <= first or col >= last:",
        "col + width <= first or col + width >= last:")],
      ["tests/test_dask.py::test_hidden_chunk_pairs_make_no_task",
       "tests/test_dask.py::test_equals_attention_under_any_chunking"],
      "the key chunk holding a query chunk's last visible keys makes no task"),
    m("dask-broadcast-axis-indexed",
      [("index = tuple(i if x.shape[a] != 1 else 0 for a, i in enumerate(batch_index))",
        "index = tuple(batch_index)")],
      ["tests/test_dask.py::test_broadcast_head_axis_is_never_copied",
       "tests/test_dask.py::test_equals_attention_under_any_chunking"],
      "a size-1 batch axis indexed by the batch block: a key to a chunk that does not exist"),
    m("resident-evicts-a-captured-table",
      [("key = next((key for key in _resident if key not in _captured), None)",
        "key = next(iter(_resident), None)")],
      ["tests/test_cupy_shim.py::test_resident_tables_outlive_every_launch_that_may_read_them"],
      "a geometry table a captured CUDA graph reads is freed"),
    m("resident-evicts-while-queued",
      [("    xp.cuda.Device(key[0]).synchronize()\n",
        "")],
      ["tests/test_cupy_shim.py::test_resident_tables_outlive_every_launch_that_may_read_them"],
      "a geometry table is freed while kernels queued on other streams may still read it"),
    m("geometry-fields-swapped",
      [('("split_out", np.int64), ("split_lse", np.int64)',
        '("split_lse", np.int64), ("split_out", np.int64)')],
      ["tests/test_layout.py"],
      "the declared table no longer matches the struct the kernels read"),
    m("split-drops-a-key",
      [("min_ll(ops.keys.end, (split + 1) * g.split_keys)",
        "min_ll(ops.keys.end, (split + 1) * g.split_keys - 1)")],
      [FMA_SPLIT],
      "the last key of every split is never swept"),
    # ---- the CUDA-core kernel
    m("window-right-off-by-one-kernels",
      [("hi = i + ops.offset + right + 1 - j0;",
        "hi = i + ops.offset + right - j0;")],
      [FMA, MMA],
      "every kernel hides each row's diagonal key (their shared score step, Scores)"),
    m("unmasked-tail-kernels",
      [("max_ll(min_ll(hi, cols), 0)",
        "max_ll(min_ll(hi, 128), 0)")],
      [FMA, MMA],
      "the zero-filled keys past m count as scores of 0"),
    m("mask-ignored-kernels",
      [("if (visible && ops.has_mask) visible = mask[",
        "if (false) visible = mask[")],
      [FMA, MMA],
      "the mask is never read"),
    m("bias-base-e-kernels",
      [("s += b * A(kLog2e);",
        "s += b;")],
      [FMA, MMA],
      "the bias added in the natural-log domain to scores kept in the log2 domain"),
    m("bias-hides-nothing-kernels",
      [("if (ops.bias_hides) visible = b != -infinity<A>();",
        "")],
      [FMA, MMA, f"{INPUTS}::test_a_minus_inf_bias_hides_its_key_like_the_mask"],
      "a -inf bias weights its key by 0 instead of hiding it: NaN in that key leaks"),
    m("softmax-no-rescale",
      [("O.at(r, c) *= alpha;",
        "O.at(r, c) *= r % 2 == 0 ? alpha : Acc(1);")],
      [MMA, FMA],
      "half of O_i's rows (in the tensor-core fragments: the rows + 8) not rescaled when the running max moves"),
    m("softmax-sum-not-rescaled",
      [("l[r] *= alpha;",
        "")],
      [MMA, FMA],
      "l_i keeps its old reference when the running max moves"),
    m("softmax-max-never-moves",
      [("const bool moved = m_new > m[r];",
        "const bool moved = m_new > m[r] + Acc(200);")],
      [MMA, FMA],
      "the running max lags by up to 200 (log2): P = exp2(S - m_i) overflows float32"),
    m("softmax-empty-row-max",
      [("m[r] = lowest<Acc>()",
        "m[r] = -infinity<Acc>()")],
      [MMA, "tests/test_kernel_mma.py::test_fully_masked_rows_and_bias_minus_inf", FMA],
      "a row with nothing visible yet takes P = exp2(-inf + inf) = NaN"),
    m("softmax-lse-log2",
      [("(m[r] + log2_(total)) * Acc(kLn2)",
        "(m[r] + log2_(total))")],
      [FMA, MMA],
      "lse in base 2 (both forward kernels' shared softmax)"),
    m("softmax-row-sum-one-lane",
      [("const Acc total = lanes_sum<Lanes>(l[r]);",
        "const Acc total = l[r];")],
      [FMA, MMA],
      "a row's sum taken from one lane's columns, not from all the lanes that share the row"),
    m("fma-multiply-by-zero",
      [("(hidden[a] >> c & 1u) ? hidden_p<Acc>() : S.x[a][c]",
        "S.x[a][c]")],
      [FMA, FMA_NAN],
      "hidden keys weighted by exp2(-inf) = 0 instead of skipped: 0 * inf = NaN leaks"),
    m("fma-prefetch-into-the-tile-in-use",
      [("load_kv_async(key_start(t + 1), stage ^ 1);",
        "load_kv_async(key_start(t + 1), stage);",
        "struct FwdBlock {")],
      [FMA],
      "two stages: the next tile's K and V copied over the tile being computed"),
    m("fma-no-cp-async-wait",
      [("            ptx::cp_async_wait<0>();\n            __syncthreads();  // tile j has landed",
        "            __syncthreads();  // tile j has landed")],
      [FMA],
      "two stages: the barrier does not wait for the tile's copies to land"),
    # ---- the CUDA-core backward kernels
    m("bwd-no-delta-kernels",
      [("ds = visible ? p * (dP - t.delta) : A(0);",
        "ds = visible ? p * dP : A(0);")],
      [BWD_SIMT],
      "dS without D_i = rowsum(dO * O) in both kernels"),
    m("bwd-multiply-by-zero",
      [("out[a][c] = (Careful && p_j[a][t] < Acc(0)) ? out[a][c] : o;",
        "out[a][c] = o;")],
      [BWD_SIMT, f"{BWD_SIMT_FILE}::test_hidden_non_finite_keys_never_leak", FMA_NAN],
      "hidden pairs weighted by 0 instead of skipped: an inf in a hidden key or query row leaks as NaN"),
    m("bwd-dq-prefetch-in-use",
      [("load_kv_async(key_start(t + 1), stage ^ 1);",
        "load_kv_async(key_start(t + 1), stage);",
        "struct DqBlock {")],
      [BWD_SIMT],
      "dQ's two stages: the next key tile's K and V copied over the tile being computed"),
    m("bwd-dkdv-prefetch-in-use",
      [("load_queries_async(query_start(t + 1), stage ^ 1);",
        "load_queries_async(query_start(t + 1), stage);")],
      [BWD_SIMT],
      "dK dV's two stages: the next query tile's Q, dO and row terms written over the tile being computed"),
    m("bwd-dq-missing-barrier",
      [("        __syncthreads();\n        weighted_rows<RPT, DPT, RG, Smem::LDP, Smem::LDD>(dQ",
        "        weighted_rows<RPT, DPT, RG, Smem::LDP, Smem::LDD>(dQ")],
      ["tests/simt/test_simt_race.py::test_race_mode_is_silent_on_correct_kernels"],
      "dQ reads the shared dS tile before every lane of its row group has written it"),
    m("bwd-query-range-short",
      [("const long long end = min_ll(n, j1 - 1 - offset + left + 1);",
        "const long long end = min_ll(n, j1 - 1 - offset + left);")],
      [BWD_SIMT],
      "the last query that sees a key tile is never swept: dK, dV miss its share"),
    m("bwd-dbias-unwritten",
      [("if (!plain && (p.flags & kWantDbias) && r < rows && jj < cols)",
        "if (!plain && (p.flags & kWantDbias) && r < rows && jj < cols - 1)")],
      [BWD_SIMT],
      "the last key of each tile gets no bias gradient"),
    m("bwd-mma-careless",
      [("const bool careful = partial && "
        "__syncthreads_or(mma::tile_nonfinite<T, Bc, D, Threads, Smem::LDD>(K_j, cols));",
        "const bool careful = false;")],
      [f"{BWD_SIMT_FILE}::test_hidden_non_finite_keys_never_leak"],
      "dQ on tensor cores even where a hidden key holds inf: 0 * inf = NaN leaks into dq"),
    m("bwd-mma-prefetch-in-use",
      [("load(order.at(t + 1), ring.before(), ring.hop_before(), steady);",
        "load(order.at(t + 1), ring.stage, 0, steady);")],
      [f"{BWD_SIMT_FILE}::test_tensor_core_kernels_match_reference"],
      "two stages: the next swept tile's copies (dQ's K and V, dK dV's Q, dO and row terms) over the tile in use"),
    m("bwd-mma-dv-from-ds",
      [("if (!careful) {\n            add_dv_dk(P, dS, Q_i, dO_i);",
        "if (!careful) {\n            add_dv_dk(dS, dS, Q_i, dO_i);")],
      [f"{BWD_SIMT_FILE}::test_tensor_core_kernels_match_reference"],
      "the other tiles' dV accumulates dS^T dO instead of P^T dO"),
    m("bwd-mma-f64-split-columns",
      [("d0(at.warp % Split * DS), e0(at.warp % Split * ES)", "d0(at.warp % Split * DS), e0(0)")],
      [f"{BWD_SIMT_FILE}::test_the_planners_configurations"],
      "float64's dK dV at d = e = 128 (a pair of warps per 16 keys): both warps of a pair take dV's first half of "
      "columns, the second half never written"),
    m("bwd-mma-steady-dv-from-ds",
      [("add_dv_dk(P, dS, Q_i, dO_i);",
        "add_dv_dk(dS, dS, Q_i, dO_i);",
        "plain_gradients(P, dS, s.terms + stage * Br);")],
      [f"{BWD_SIMT_FILE}::test_tensor_core_steady_loops_match_reference"],
      "the steady tiles' dV accumulates dS^T dO instead of P^T dO"),
    m("bwd-mma-steady-no-delta",
      [("t.shift, t.delta, p.scale_log2",
        "t.shift, 0.0f, p.scale_log2",
        "struct MmaDkdvBlock {")],
      [f"{BWD_SIMT_FILE}::test_tensor_core_steady_loops_match_reference"],
      "dK dV's steady tiles: dS without D_i"),
    m("bwd-mma-dkdv-window-untransposed",
      [("seen_whole(ops.queries, Br, ops.keys.begin, Bc, -ops.offset, right, left)",
        "seen_whole(ops.queries, Br, ops.keys.begin, Bc, -ops.offset, left, right)")],
      [f"{BWD_SIMT_FILE}::test_tensor_core_plain_tiles_inside_a_window"],
      "dK dV's plain query tiles from the window as the queries see it, not transposed: edge tiles taken as plain"),
    # ---- the tensor-core backward of float32 (3xTF32, TF32) and float64 (DMMA)
    m("bwd-mma-f32-own-tiles-one-pass",
      [("split_tf32(x, f.hi[i], f.lo[i]);", "f.hi[i] = ptx::cvt_rna_tf32(x), f.lo[i] = 0u;",
        "template <int Passes> struct Products<float, Passes> {")],
      [BWD_WIDE],
      "3xTF32's own tiles and P, dS without their low parts: one TF32 pass where float32 is promised"),
    m("bwd-mma-f32-swept-lo-unread",
      [("ptx::ldmatrix_x4(b.lo, b_at + (16 * np * LDB + 8 * kk) * 4 + lo_bytes);",
        "ptx::ldmatrix_x4(b.lo, b_at + (16 * np * LDB + 8 * kk) * 4);")],
      [BWD_WIDE],
      "S and dP take the swept tile's high parts for its low ones: a_lo b_hi + a_hi b_hi + a_hi b_hi"),
    m("bwd-mma-f32-kn-column-order",
      [("const float w[4] = {W[mt][kk][0], W[mt][kk][2], W[mt][kk][1], W[mt][kk][3]};",
        "const float w[4] = {W[mt][kk][0], W[mt][kk][1], W[mt][kk][2], W[mt][kk][3]};")],
      [BWD_WIDE],
      "dV += P^T dO and dQ += dS K on TF32: the accumulators' columns 2t, 2t + 1 taken as the k indices t, t + 4"),
    m("bwd-mma-f32-split-without-barrier",
      [("Math::template prepare<Bc, E, Smem::LDE, Threads>(s.V + stage * Bc * Smem::LDE, kLoBytes);\n"
        "__syncthreads();",
        "Math::template prepare<Bc, E, Smem::LDE, Threads>(s.V + stage * Bc * Smem::LDE, kLoBytes);")],
      [f"{BWD_SIMT_FILE}::test_float32_and_float64_tensor_core_backward_in_race_mode"],
      "dQ's warps read K_j and V_j while the others still split them to TF32 (a race the emulator's schedules do "
      "not show: its warps meet at the products' first collective)"),
    m("bwd-mma-f32-careful-without-low-parts",
      [("if constexpr (LoBytes != 0)", "if constexpr (false)")],
      [BWD_NON_FINITE],
      "the CUDA-core path of tiles with hidden non-finite rows takes float32's high TF32 parts alone"),
    m("bwd-mma-model-low-parts-of-the-own-tiles",
      [("low_parts = (k_tiles if not self.keys_own else q_tiles)",
        "low_parts = (q_tiles if not self.keys_own else k_tiles)")],
      [f"{BWD_SIMT_FILE}::test_float32_and_float64_tensor_core_backward_under_address_sanitizer"],
      "the planner's shared-memory model counts 3xTF32's low parts of the block's own tiles, not of the swept ones: "
      "the launch gives a block less shared memory than its kernel uses (tests/test_cubin.py's layout check "
      "refuses it too, as a static_assert)"),
    m("bwd-mma-f64-careful-pitch",
      [("mma::acc_by_selection<T, Bc, D, MT, Smem::LDD, kLoBytes>(",
        "mma::acc_by_selection<T, Bc, D, MT, mma::Padded<D, T>::ld, kLoBytes>(")],
      [BWD_NON_FINITE],
      "dQ's CUDA-core path reads float64's K_j with 16 bytes of padding per row where it has 32"),
    m("bwd-row-terms-no-empty-rows",
      [("terms[..., 0] = xp.where(lse == -np.inf, acc.type(0), shift)",
        "terms[..., 0] = shift")],
      [f"{BWD_SIMT_FILE}::test_row_terms_shift_a_row_that_saw_nothing_by_zero"],
      "a row that saw no key keeps its shift of -inf: its P = exp2(-inf + inf) is NaN"),
    # ---- the tensor-core kernel
    m("mma-multiply-by-zero",
      [("partial && __syncthreads_or(mma::tile_nonfinite<T, Bc, E, Threads, Smem::LDV>",
        "false && __syncthreads_or(mma::tile_nonfinite<T, Bc, E, Threads, Smem::LDV>")],
      [MMA, "tests/test_kernel_mma.py::test_nan_and_inf_in_hidden_keys_never_leak"],
      "P V on tensor cores even where hidden values hold inf or NaN"),
    m("mma-window-edge-tile-twice",
      [("t < tiles - plain.lo ? plain.lo + t : t - (tiles - plain.lo);",
        "t < tiles - plain.lo ? plain.lo + t : t - (tiles - plain.lo) + 1;")],
      ["tests/test_kernel_mma.py::test_tiles_before_a_windows_first_plain_one_are_swept_last",
       f"{BWD_SIMT_FILE}::test_tensor_core_kernels_match_reference"],
      "the tiles before a window's first plain one visit one tile late: the first is never swept, one twice"),
    m("mma-steady-one-too-many",
      [("min(plain.hi, full - (Stages - 1)) - plain.lo",
        "min(plain.hi, full - (Stages - 2)) - plain.lo")],
      ["tests/test_kernel_mma.py::test_memcheck_under_address_sanitizer",
       f"{BWD_SIMT_FILE}::test_backward_under_address_sanitizer"],
      "the last steady visit prefetches a short last tile through the chunk loaders (whole rows past m)"),
    m("mma-hot-loop-never-leaves",
      [("if (softmax.raise_max(S, p.scale_log2, m_old)) return true;",
        "softmax.raise_max(S, p.scale_log2, m_old);")],
      ["tests/test_kernel_mma.py::test_hot_loop_leaves_to_rescale_when_a_later_tile_holds_the_max"],
      "the steady tiles' hot loop moves m_i but never leaves to rescale O_i and l_i"),
    m("mma-part-values",
      [("V_j + c0 * Smem::LDV * (int)sizeof(T), kLoBytes);",
        "V_j, kLoBytes);")],
      ["tests/test_kernel_mma.py::test_other_tiles_in_two_parts"],
      "a tile's second part of keys multiplies P by the first part's value rows"),
    m("mma-part-visibility",
      [("score_step(S, hidden, step, j0 + c0, part_cols);",
        "score_step(S, hidden, step, j0, part_cols);")],
      ["tests/test_kernel_mma.py::test_other_tiles_in_two_parts"],
      "a tile's second part of keys takes the window of the first"),
    m("rows-past-n-visible-kernels",
      [("    if (i >= n) return {0, 0};\n",
        "")],
      [BWD_SIMT],
      "queries past the swept tile count in dK and dV (the backward passes n = the tile's end)"),
    m("partial-ignores-a-short-tile",
      [("ops.has_mask || ops.bias_hides || cols < Bc ||",
        "ops.has_mask || ops.bias_hides ||")],
      [FMA, MMA, BWD_SIMT],
      "a short last tile taken as full: the zero-filled keys past m count as scores"),
    # ---- the launch's tables and the planner
    m("params-fields-swapped",
      [('[("scale_log2", acc), ("scale", acc)',
        '[("scale", acc), ("scale_log2", acc)')],
      ["tests/test_layout.py"],
      "the declared Params no longer match the struct every kernel takes"),
    m("limit-drifts",
      [("Q_REGISTER_WORDS = 192",
        "Q_REGISTER_WORDS = 160")],
      ["tests/test_layout.py::test_every_limit_a_family_shares_with_its_kernel_holds"],
      "the planner's model of Q_i in registers no longer matches the kernel's"),
    m("plan-kept-for-the-wrong-kind",
      [("return _plan(shape, device, block, kind)",
        'return _plan(shape, device, block, "forward")')],
      ["tests/test_tiling.py::test_plans_are_kept_per_shape_device_block_and_kind", BWD_SIMT],
      "a kept plan answers for another kind of kernel: the backward launches the forward"),
    # ---- the tensor-core kernel's float32 and float64 products (mma_tile.cuh's FwdMath)
    m("mma-f32-two-passes",
      [("ptx::mma_m16n8k8_tf32(c, a.lo, b_hi, c);",
        "")],
      [MMA_WIDE],
      "3xTF32 without its a_lo b_hi pass: float32 no longer exact to its rule"),
    m("mma-f32-lo-not-stored",
      [("if (Passes == 3) *reinterpret_cast<Chunk16*>",
        "if (Passes == 4) *reinterpret_cast<Chunk16*>")],
      [MMA_WIDE],
      "3xTF32's low parts never written to shared memory: the products read whatever is there"),
    m("mma-f32-pv-key-order",
      [("const float p[4] = {P[mt][kk][0], P[mt][kk][2], P[mt][kk][1], P[mt][kk][3]};",
        "const float p[4] = {P[mt][kk][0], P[mt][kk][1], P[mt][kk][2], P[mt][kk][3]};")],
      [MMA_WIDE],
      "P's fragment for the TF32 P V in the C layout's order: keys 2t + 1 and rows g + 8 swapped"),
    m("mma-f64-bottom-rows",
      [("mma2(c, a.x[0], a.x[1], b.x[n]);",
        "mma2(c, a.x[0], a.x[0], b.x[n]);")],
      [MMA_WIDE],
      "float64 S of rows g + 8 from rows g's Q fragment"),
    # ---- the emulator's PTX twins and collectives
    m("mma-twin-a-fragment",
      [("row = g + 8 * (r & 1); k = 2 * t + h + 8 * (r >> 1);",
        "row = g + 8 * (r >> 1); k = 2 * t + h + 8 * (r & 1);")],
      [PTX],
      "a1 and a2 of the m16n8k16 A fragment swapped"),
    m("mma-twin-c-fragment",
      [("row = (lane >> 2) + 8 * (e >> 1);",
        "row = (lane >> 2) + 8 * (e & 1);")],
      [PTX],
      "the C/D fragment's rows taken from the wrong bit"),
    m("ldmatrix-twin-trans",
      [("unsigned lo = Trans ? M[j][col][row] : M[j][row][col];",
        "unsigned lo = M[j][row][col];")],
      [PTX],
      "ldmatrix .trans delivers the untransposed low half"),
    m("mma-f64-twin-c-fragment",
      [("for (int e = 0; e < 2; e++) C[g][2 * t + e] = L.c[e];",
        "for (int e = 0; e < 2; e++) C[g][t + 4 * e] = L.c[e];")],
      [f"{PTX}::test_mma_f64_fragment_layout_exact"],
      "the f64 mma's C elements taken from columns t and t + 4"),
    m("mma-f64-twin-k-reversed",
      [("for (int k = 0; k < 4; k++) acc = std::fma(",
        "for (int k = 3; k >= 0; k--) acc = std::fma(")],
      [f"{PTX}::test_mma_f64_random_values_bit_for_bit"],
      "the f64 mma's fma chain runs over k backwards"),
    m("mma-f64-twin-ftz",
      [("::cuflash_simt::set_mxcsr(mxcsr & ~0x8040u);",
        "::cuflash_simt::set_mxcsr(mxcsr);")],
      [f"{PTX}::test_mma_f64_random_values_bit_for_bit"],
      "the f64 mma flushes float64 subnormals, as the emulator's -ftz flushes float32"),
    m("cvt-tf32-twin-ties-toward-zero",
      [("return sign | ((mag + 0x1000u) & 0xffffe000u);",
        "return sign | ((mag + 0x0fffu) & 0xffffe000u);")],
      [f"{PTX}::test_cvt_rna_tf32_by_hand", f"{PTX}::test_cvt_rna_tf32_bit_for_bit"],
      "cvt.rna.tf32 rounds ties toward zero"),
    m("shfl-up-delta-unmasked",
      [("case UP: j = lane - (b & 31); ok = j >= max_lane; break;",
        "case UP: j = lane - b; ok = j >= max_lane; break;")],
      ["tests/simt/test_simt_basics.py::test_shuffle_up_by_33_is_up_by_one"],
      "__shfl_up_sync uses the whole delta, where PTX reads its low five bits"),
    m("cp-async-window-unpoisoned",
      [("  else cp_poison(c, true);\n  f->cp_queue.push_back(c);",
        "  f->cp_queue.push_back(c);")],
      ["tests/simt/test_simt_cp_async.py::test_memcheck_reports_an_access_inside_the_window"],
      "memcheck no longer sees a cp.async destination touched before its wait"),
    m("race-blocks-ordered",
      [("    if (f.tsan_copy) L.race_retired.push_back(f.tsan_copy);\n    f.tsan_copy = nullptr;\n    "
        "std::free(f.tsan_landed);\n    f.tsan_landed = nullptr;\n",
        "")],
      ["tests/simt/test_simt_race.py::test_race_mode_reports_global_memory_races_between_blocks"],
      "a thread's cp.async copies carry one block's clock into the next: races between blocks go unreported"),
    # ---- patterns in the kernels (mods, sinks, block masks)
    m("kernel-visits-drop-last",
      [("last = first_from(list, count, base + tiles);", "last = first_from(list, count, base + tiles - 1);")],
      ["tests/test_blockmask.py::test_the_kernels_visit_only_the_tiles_a_block_mask_shows",
       "tests/test_blockmask.py::test_attention_through_a_block_mask_matches_the_dense_mask"],
      "a block of the kernels never visits the last tile its block mask shows"),
    m("kernel-every-tile-whole",
      [("if constexpr (Mods::kBlocks) return (shown[t] & 1) != 0;", "if constexpr (Mods::kBlocks) return true;")],
      ["tests/test_blockmask.py::test_attention_through_a_block_mask_matches_the_dense_mask"],
      "the kernels take every tile a block mask shows as shown whole: mask_mod never hides a key of a partial tile"),
    m("kernel-mod-slope-dropped",
      [("ds = visible ? p * (dP - t.delta) * slope : A(0);", "ds = visible ? p * (dP - t.delta) : A(0);")],
      ["tests/test_mods.py::test_builtins_forward_and_backward_match_their_formulas"],
      "the CUDA-core backward forgets d score_mod / d score"),
    m("kernel-sink-ignored",
      [("l[r] = !first ? Acc(0) : sink >= m[r] ? Acc(1) : exp2_(sink - m[r]);", "l[r] = Acc(0);")],
      ["tests/test_mods.py::test_sinks_join_the_denominator_and_a_row_that_sees_nothing_gets_zero_and_the_sink"],
      "the kernels' rows start from the sink's max but leave its term out of the denominator"),
    m("covering-optimistic",
      [("kinds = np.where(high == HIDDEN, HIDDEN,", "kinds = np.where(low == HIDDEN, HIDDEN,")],
      ["tests/test_blockmask.py::test_attention_through_a_block_mask_matches_the_dense_mask"],
      "re-tiling a block mask to coarser kernel tiles hides a tile that is only partly hidden"),
    m("table-gradient-flat-index",
      [("flat = flat * target.shape[axis] + at", "flat = flat + at")],
      ["tests/test_mods.py::test_gradients_reach_the_arrays_score_mod_closes_over"],
      "a table gradient lands on the wrong element of a table of two or more axes"),
    m("table-gradient-through-the-score",
      [("memo[id(x)] = ONE if x is wrt else ZERO", "memo[id(x)] = ONE")],
      ["tests/test_mods.py::test_gradients_reach_the_arrays_score_mod_closes_over"],
      "d score_mod / d a table read also counts d score_mod / d score"),
    m("varlen-kernel-keys-at-query-rows",
      [("return {p.cu_seqlens_q[s + 1] - q0, p.cu_seqlens_k[s + 1] - k0, q0, k0};",
        "return {p.cu_seqlens_q[s + 1] - q0, p.cu_seqlens_k[s + 1] - k0, q0, q0};")],
      [f"{VARLEN}::test_each_sequence_is_attention_on_its_own"],
      "the kernels read a packed sequence's keys from its query offset"),
    m("varlen-blocked-keys-as-queries",
      [('m=rows["k"][1] - rows["k"][0],', 'm=rows["q"][1] - rows["q"][0],')],
      [f"{VARLEN}::test_each_sequence_is_attention_on_its_own"],
      "the blocked algorithm gives a packed sequence as many keys as queries"),
    m("paged-row-without-its-page-offset",
      [("return src + walk.table[page] * walk.stride + (long long)(x - page * walk.size) * row_stride;",
        "return src + walk.table[page] * walk.stride + (long long)x * row_stride;")],
      [f"{PAGED}::test_each_sequence_attends_to_its_pages"],
      "a paged key's row within its page is its position in the sequence"),
    m("paged-values-at-the-keys-page-stride",
      [("x == kK ? p.pages.stride_k : p.pages.stride_v", "p.pages.stride_k")],
      [f"{PAGED}::test_each_sequence_attends_to_its_pages"],
      "the kernels walk the value cache's pages with the key cache's stride"),
    m("paged-kernel-longest-sequence-everywhere",
      [("if constexpr (kPaged) return {p.n, p.pages.seqlens[batch_item() / p.sequence_items], 0, 0};",
        "if constexpr (kPaged) return {p.n, p.m, 0, 0};")],
      [f"{PAGED}::test_each_sequence_attends_to_its_pages"],
      "every paged sequence sees as many keys as the longest"),
    m("paged-gather-drops-a-short-last-page",
      [("pages = pages[:-(-m // self.page_size)]", "pages = pages[:m // self.page_size]")],
      [f"{PAGED}::test_each_sequence_attends_to_its_pages"],
      "the numpy backend leaves out a sequence's last, partly filled page"),
    m("paged-append-one-row-late",
      [("position = cached[:, None] + xp.arange(k_new.shape[1])[None, :]",
        "position = cached[:, None] + 1 + xp.arange(k_new.shape[1])[None, :]")],
      [f"{PAGED}::test_each_sequence_attends_to_its_pages"],
      "new keys are written one row past the cached ones"),
    m("paged-chunks-from-the-page-start",
      [("src = first_row + offset;", "src = first_row;")],
      [f"{PAGED}::test_prefill_into_pages_on_the_planners_tiles"],
      "the chunk loaders copy every thread's chunks of a paged tile from its first row"),
    m("paged-last-page-id-unchecked",
      [("bad = used & ((table < 0) | (table >= num_pages))", "bad = used & ((table < 0) | (table > num_pages))")],
      [f"{PAGED}::test_bad_arguments_are_clear_errors"],
      "a page id one past the caches' last page is taken (and read past the cache)"),
    # ---- attention dropout
    m("dropout-philox-words-rotated",
      [("return (w.x[0] >= threshold) | (w.x[1] >= threshold) << 1 | (w.x[2] >= threshold) << 2 |\n"
        "(w.x[3] >= threshold) << 3;",
        "return (w.x[1] >= threshold) | (w.x[2] >= threshold) << 1 | (w.x[3] >= threshold) << 2 |\n"
        "(w.x[0] >= threshold) << 3;", "__device__ __forceinline__ unsigned group_keeps(")],
      [f"{DROPOUT}::test_a_row_keeps_what_cuflash_dropout_keeps", DROPOUT_REVEAL],
      "key j takes word (j + key0) + 1 & 3 of its Philox call, not word (j + key0) & 3"),
    m("dropout-keep-bits-unshifted",
      [("const int k = c + *reinterpret_cast<const int*>(at);", "const int k = c;")],
      [DROPOUT_TILE, DROPOUT_REVEAL],
      "a keep tile is read as if its keys started on a Philox group (a window's key tiles do not)"),
    m("dropout-keep-tile-without-its-last-group",
      [("for (int x = 2 * kPairs; x < groups; x += 2)", "for (int x = 2 * kPairs; x < Cols / 4; x += 2)")],
      [DROPOUT_TILE, DROPOUT_REVEAL],
      "a tile whose keys start off a Philox group never makes the group its last keys fall in"),
    m("dropout-batch-item-unstrided",
      [("b += (unsigned long long)(item % d.shape[axis] * d.strides[axis]);",
        "b += (unsigned long long)(item % d.shape[axis]);")],
      [DROPOUT_CHUNK, DROPOUT_DENSE],
      "the kernels count a batch item's index without the batch axes' strides"),
    m("dropout-rows-from-zero",
      [("row = (unsigned)(i0 + d.row0);", "row = (unsigned)i0;")],
      [DROPOUT_CHUNK],
      "the kernels count query rows from the chunk's first, not the call's (row0 left out)"),
    m("dropout-fma-sum-of-kept",
      [("for (int c = 0; c < CPT; ++c) S.x[a][c] = keep[TC * c] ? S.x[a][c] : Acc(0);",
        "for (int c = 0; c < CPT; ++c) { if (!keep[TC * c]) softmax.l[a] -= S.x[a][c]; "
        "S.x[a][c] = keep[TC * c] ? S.x[a][c] : Acc(0); }")],
      [DROPOUT_DENSE],
      "the CUDA-core forward's running sum l_i takes only the kept probabilities"),
    m("dropout-mma-sum-of-kept",
      [("void drop_probabilities(ScoreTile<NP>& S, int buffer, int c0) const {",
        "void drop_probabilities(ScoreTile<NP>& S, int buffer, int c0) {"),
       ("S.x[mt][nt][2 * h + x] = keep[8 * nt + x] ? S.x[mt][nt][2 * h + x] : Acc(0);",
        "{ if (!keep[8 * nt + x]) softmax.l[2 * mt + h] -= S.x[mt][nt][2 * h + x]; "
        "S.x[mt][nt][2 * h + x] = keep[8 * nt + x] ? S.x[mt][nt][2 * h + x] : Acc(0); }")],
      [DROPOUT_STEADY, DROPOUT_DENSE],
      "the tensor-core forward's running sum l_i takes only the kept probabilities"),
    m("dropout-forward-unscaled",
      [("for (int c = 0; c < EPT; ++c) O_i.x[a][c] *= Acc(p.dropout.scale);",
        "for (int c = 0; c < EPT; ++c) O_i.x[a][c] *= Acc(1);")],
      [DROPOUT_DENSE],
      "the CUDA-core forward leaves out the kept probabilities' 1 / (1 - p)"),
    m("dropout-mma-next-tile-into-the-read-buffer",
      [("dropout().template fill<Threads>((t + 1) & 1, ops.queries.begin, key_start(t + 1));",
        "dropout().template fill<Threads>(t & 1, ops.queries.begin, key_start(t + 1));")],
      [DROPOUT_STEADY, DROPOUT_REVEAL],
      "the tensor-core forward makes the next tile's keep bits over the ones its warps are reading"),
    m("dropout-mma-parts-from-the-tile-start",
      [("c0 + 2 * (lane % 4));", "2 * (lane % 4));")],
      [f"{DROPOUT}::test_split_keys_and_other_tiles_drop_the_same_elements"],
      "the tensor-core forward's second part of a tile takes the keep bits of the first"),
    m("dropout-fma-dv-undropped",
      [("if constexpr (kDropout) p_ij *= z;", "")],
      [DROPOUT_REVEAL, DROPOUT_DENSE],
      "the CUDA-core dK dV kernel's dV takes every probability, dropped or not"),
    m("dropout-mma-dv-undropped",
      [("plain_gradients(P, dS, s.terms + stage * Br);\nif constexpr (kDropout) drop_p(P);",
        "plain_gradients(P, dS, s.terms + stage * Br);")],
      [DROPOUT_STEADY],
      "the tensor-core dK dV kernel's steady tiles give dV every probability, dropped or not"),
    m("dropout-fma-ds-without-z",
      [("if constexpr (kDropout) dp *= keep[TC * c] ? Acc(p.dropout.scale) : Acc(0);", "")],
      [DROPOUT_DENSE],
      "the CUDA-core dQ kernel's dS = P (dP - D), not P (dP Z - D)"),
    m("dropout-mma-ds-without-z",
      [("products(P, dS, K_j, V_j);\nif constexpr (kDropout) drop_dp(dS);\nplain_gradients(P, dS);",
        "products(P, dS, K_j, V_j);\nplain_gradients(P, dS);")],
      [DROPOUT_STEADY],
      "the tensor-core dQ kernel's steady tiles take dS = P (dP - D), not P (dP Z - D)"),
    m("dropout-numpy-sum-of-kept",
      [("l_new = alpha * l_i + p_ij.sum(axis=-1)\n    if problem.dropout is not None:\n"
        "        p_ij *= dropout_factor(problem, index, *tile)",
        "if problem.dropout is not None:\n        p_ij *= dropout_factor(problem, index, *tile)\n"
        "    l_new = alpha * l_i + p_ij.sum(axis=-1)")],
      [DROPOUT_DENSE],
      "the blocked forward's running sum takes the dropped, scaled probabilities"),
    m("shfl-xor-twin",
      [("default: j = lane ^ (b & 31); ok = j <= max_lane; break;",
        "default: j = lane ^ (b & 15); ok = j <= max_lane; break;")],
      ["tests/simt/test_simt_basics.py"],
      "__shfl_xor_sync ignores the lane mask's top bit"),
)

IGNORE = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis", "build")


def pattern(text: str) -> "re.Pattern[str]":
    """text as a regular expression in which every run of whitespace matches any run of whitespace (or none
    where text has it at its ends)."""
    words = text.split()
    return re.compile(r"\s+".join(re.escape(w) for w in words))


def sources(root: Path) -> dict:
    """{path relative to root: text} of every file a mutant may change."""
    return {str(path.relative_to(root)): path.read_text() for glob in SOURCES for path in sorted(root.glob(glob))}


def locate(edit: Edit, texts: dict) -> Tuple[str, int, int]:
    """(file, start, end) of the text an edit changes; ValueError when its anchor or text is not found once."""
    where = ""
    if edit.within:
        anchors = [(f, a) for f, t in texts.items() for a in pattern(edit.within).finditer(t)]
        if len(anchors) != 1:
            raise ValueError(f"{edit.within!r} occurs {len(anchors)} times in the project, not once")
        where, anchor = anchors[0]
        found = pattern(edit.old).search(texts[where], anchor.end())
        if found is None:
            raise ValueError(f"{edit.old!r} does not occur after {edit.within!r} in {where}")
        return where, found.start(), found.end()
    hits = [(f, x) for f, t in texts.items() for x in pattern(edit.old).finditer(t)]
    if len(hits) != 1:
        listed = ", ".join(sorted({f for f, _ in hits}))
        raise ValueError(f"{edit.old!r} occurs {len(hits)} times in the project ({listed}), not once: give the "
                         f"definition it lives in (within=)")
    where, found = hits[0]
    return where, found.start(), found.end()


def mutated(mutant: Mutant, texts: dict) -> dict:
    """{file: its mutated text} for the files the mutant changes; ValueError (naming the mutant) when an edit no
    longer applies."""
    texts = dict(texts)
    changed = {}
    for edit in mutant.edits:
        try:
            where, start, end = locate(edit, texts)
        except ValueError as exc:
            raise ValueError(f"mutant {mutant.name}: {exc}") from None
        texts[where] = changed[where] = texts[where][:start] + edit.new + texts[where][end:]
    return changed


def apply(mutant: Mutant, root: Path) -> None:
    for where, text in mutated(mutant, sources(root)).items():
        (root / where).write_text(text)


def run_one(mutant: Mutant, timeout: float) -> dict:
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="cuflash-mutant-") as tmp:
        copy = Path(tmp) / "project"
        shutil.copytree(ROOT, copy, ignore=IGNORE)
        apply(mutant, copy)
        env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
                   "-rf", *mutant.tests]
        try:
            result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
            output, code = result.stdout + result.stderr, result.returncode
        except subprocess.TimeoutExpired:
            output, code = "", None
    failed = re.findall(r"^FAILED (\S+)", output, flags=re.M)
    if code is None:
        verdict, by = "TIMEOUT", ""
    elif "CompileError" in output:  # g++ refused the mutated kernel: no semantic bug was tested
        verdict, by = "ERROR", "the mutated source does not compile"
    elif failed:
        verdict, by = "caught", failed[0].split(" ")[0]
    elif code == 0:
        verdict, by = "SURVIVED", ""
    else:  # an error that is no test failure (collection, a build error): the mutant is not semantic
        verdict, by = "ERROR", output.strip().splitlines()[-1] if output.strip() else f"exit {code}"
    return dict(mutant=mutant.name, verdict=verdict, by=by, seconds=round(time.time() - start, 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one mutant's tests may take")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    chosen = [x for x in MUTANTS if not args.names or x.name in args.names]
    unknown = set(args.names) - {x.name for x in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants: {', '.join(sorted(unknown))}")
    texts = sources(ROOT)
    if args.list:
        for x in chosen:
            print(f"{x.name:34} {', '.join(sorted(mutated(x, texts))):32} {x.why}")
        return 0
    for x in chosen:  # fail fast on a list that no longer applies
        mutated(x, texts)
    start = time.time()
    print(f"{'mutant':34} {'verdict':9} {'seconds':>7}  caught by")
    results = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for row in pool.map(lambda x: run_one(x, args.timeout), chosen):
            results.append(row)
            print(f"{row['mutant']:34} {row['verdict']:9} {row['seconds']:7.1f}  {row['by']}", flush=True)
    caught = sum(r["verdict"] == "caught" for r in results)
    print(f"{caught} of {len(results)} mutants caught in {time.time() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
