"""Executing a Plan: the launches (grid, block, shared memory, the kernel's one parameter struct) and the per-launch
geometry table.

Shared by the cupy and simt backends, which differ only in how a module is compiled (cupy.RawModule or the
emulator's RawModule) and in the arrays the Problem holds (CuPy or NumPy: problem.xp). Each backend gives run()
a function that launches one Launch on its module. Nothing here plans: what to launch is the plan's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from .kernels import mods as kernel_mods
from .merging import combine
from .tiling import Plan

# The per-launch geometry table, declared once: the C struct Geometry of kernels/tile.cuh, field for field
# (tests/test_layout.py checks sizes, offsets and constants through the compiler: layout_asserts).
MAX_BATCH_DIMS = 6  # kMaxBatchDims
# The Operand enum's order: the forward's operands, then the backward's (dout; terms, two per query row: row_terms;
# the gradients in the accumulator type).
OPERANDS = ("q", "k", "v", "mask", "bias", "out", "lse", "dout", "terms", "dq", "dk", "dv", "dbias")
ROW_VECTORS = ("lse",)  # one value per query row: a row stride and no column stride
LOG2E = 1.4426950408889634
OPERAND_STRIDES = np.dtype([("row", np.int64), ("col", np.int64), ("batch", np.int64, (MAX_BATCH_DIMS,))])
GEOMETRY = np.dtype([
    ("batch_count", np.int64), ("rank", np.int64), ("shape", np.int64, (MAX_BATCH_DIMS,)),
    ("op", OPERAND_STRIDES, (len(OPERANDS),)),
    ("split_keys", np.int64), ("split_out", np.int64), ("split_lse", np.int64)])
MAX_GRID_Y = 65535
RESIDENT_LIMIT = 256  # device copies of geometry tables kept per process
SIZES = ("n", "m", "d", "e", "left", "right")
PACKED_OFFSETS = ("cu_seqlens_q", "cu_seqlens_k")  # packed sequences' offsets (problem.Packed), null without
# The C struct Pages of kernels/tile.cuh: paged keys and values (problem.Paged), zero without.
PAGES = np.dtype([("table", np.uint64), ("seqlens", np.uint64), ("table_stride", np.int64), ("size", np.int64),
                  ("stride_k", np.int64), ("stride_v", np.int64)])
# The C struct Dropping of kernels/tile.cuh: attention dropout (problem.dropout: cuflash/dropout.py), zero without.
DROPPING = np.dtype([("seed", np.uint64), ("base", np.int64), ("row0", np.int64), ("key0", np.int64),
                     ("shape", np.int64, (MAX_BATCH_DIMS,)), ("strides", np.int64, (MAX_BATCH_DIMS,)),
                     ("rank", np.int64), ("scale", np.float64), ("threshold", np.uint32)], align=True)


def params_dtype(acc) -> np.dtype:
    """The C struct Params of kernels/tile.cuh, field for field, for accumulator type acc (float32 or float64):
    every kernel's one parameter, passed by value. A pointer per operand (OPERANDS; 0 where absent), the geometry
    table's, the packed sequences' offsets and batch items per sequence (0 without), the pages (PAGES), the sizes
    and the window's reach, scale log2(e) and scale in acc, the launch flags and the mods' Args
    (kernels/mods.py)."""
    acc = np.dtype(acc)
    pointers = OPERANDS + ("geometry",) + PACKED_OFFSETS
    return np.dtype([(name, np.uint64) for name in pointers] + [("sequence_items", np.int64), ("pages", PAGES),
                                                                 ("dropout", DROPPING)] +
                    [(name, np.int64) for name in SIZES] +
                    [("scale_log2", acc), ("scale", acc), ("flags", np.int32), ("mods", kernel_mods.ARGS)],
                    align=True)


PARAMS = {np.dtype(acc).name: params_dtype(acc) for acc in (np.float32, np.float64)}
PARAMS_OF = {"float32": "__half", "float64": "double"}  # an element type whose Params have that accumulator

# LaunchFlags in kernels/block.cuh
VECTOR_Q, VECTOR_K, VECTOR_V, HAS_MASK, HAS_BIAS, WANT_LSE, BIAS_HIDES = 1, 2, 4, 8, 16, 32, 64
VECTOR_DOUT, WANT_DBIAS = 128, 256
FLAGS = {"kVectorQ": VECTOR_Q, "kVectorK": VECTOR_K, "kVectorV": VECTOR_V, "kHasMask": HAS_MASK,
         "kHasBias": HAS_BIAS, "kWantLse": WANT_LSE, "kBiasHides": BIAS_HIDES, "kVectorDout": VECTOR_DOUT,
         "kWantDbias": WANT_DBIAS}
VECTOR_FLAGS = (("q", VECTOR_Q), ("k", VECTOR_K), ("v", VECTOR_V), ("dout", VECTOR_DOUT))


def layout_asserts() -> List[str]:
    """C++ static_asserts that the kernels' Geometry, OperandStrides, Params, Operand and LaunchFlags are what this
    module writes: compiled after kernels/block.cuh, they fail on any drift."""
    def check(expr: str, value: int) -> str:
        return f'static_assert({expr} == {value}, "launch.py declares {expr} == {value}");'

    lines = [check("cuflash::kMaxBatchDims", MAX_BATCH_DIMS), check("(int)cuflash::kOperands", len(OPERANDS)),
             f'static_assert(cuflash::kLog2e == {LOG2E!r}, "launch.py declares LOG2E == {LOG2E!r}");']
    lines += [check(f"(int)cuflash::k{name.capitalize()}", index) for index, name in enumerate(OPERANDS)]
    lines += [check(f"(int)cuflash::{name}", value) for name, value in FLAGS.items()]
    lines += [check(f"cuflash::mods::kMax{name}", value) for name, value in (
        ("Tables", kernel_mods.MAX_TABLES), ("TableAxes", kernel_mods.MAX_TABLE_AXES),
        ("BatchAxes", kernel_mods.MAX_BATCH_AXES))]
    structs = [("OperandStrides", OPERAND_STRIDES), ("Geometry", GEOMETRY), ("Pages", PAGES), ("Dropping", DROPPING),
               ("mods::Table", kernel_mods.TABLE),
               ("mods::Visits", kernel_mods.VISITS), ("mods::Args", kernel_mods.ARGS)] + \
        [(f"Params<{PARAMS_OF[acc]}>", dtype) for acc, dtype in PARAMS.items()]
    for struct, dtype in structs:
        fields = dtype.fields or {}
        lines.append(check(f"sizeof(cuflash::{struct})", dtype.itemsize))
        lines += [check(f"__builtin_offsetof(cuflash::{struct}, {name})", fields[name][1]) for name in fields]
    return lines


@dataclass
class Launch:
    """One kernel launch: args holds the kernel's Params (a NumPy array of one PARAMS element, which CuPy passes by
    value), arrays the arrays its pointers point into (the emulator's profile names them global memory)."""

    name: str
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    shared_mem: int
    args: tuple
    arrays: tuple = ()

    @property
    def params(self):
        """The kernel's Params as a NumPy record: params["flags"], params["e"], ..."""
        return self.args[0][0]


# ----------------------------------------------------------------------------------------------------------------
# Operands as the kernel sees them


def address(x) -> int:
    """Data pointer of a NumPy or CuPy array, its view offset included."""
    if isinstance(x, np.ndarray):
        return int(x.ctypes.data)
    return int(x.data.ptr)  # CuPy


def element_strides(x) -> Optional[Tuple[int, ...]]:
    """Strides in elements, or None when a byte stride is not a whole number of elements."""
    item = x.dtype.itemsize
    if any(s % item for s in x.strides):
        return None
    return tuple(s // item for s in x.strides)


def vector_ok(x, strides) -> bool:
    """16-byte loads need unit column stride and 16-byte aligned pointer, row and batch strides."""
    item = x.dtype.itemsize
    return (strides[-1] == 1 or x.shape[-1] <= 1) and address(x) % 16 == 0 and \
        all((s * item) % 16 == 0 for s in strides[:-1])


def coalesce(shape, strides_per_operand):
    """Drop size-1 batch dims and merge neighbours that every operand walks contiguously (like NumPy's iterator),
    so most problems reach the kernel with one or two batch dims."""
    dims = [(size, [s[i] for s in strides_per_operand]) for i, size in enumerate(shape) if size != 1]
    merged = []
    for size, strides in dims:
        if merged:
            prev_size, prev_strides = merged[-1]
            if all(p == s * size for p, s in zip(prev_strides, strides)):
                merged[-1] = (prev_size * size, strides)
                continue
        merged.append((size, strides))
    operands = range(len(strides_per_operand))
    return [size for size, _ in merged], [[strides[x] for _, strides in merged] for x in operands]


# ----------------------------------------------------------------------------------------------------------------
# Launches


def launches(problem, out, lse, plan: Plan, split_strides: Tuple[int, int] = (0, 0),
             patterns: Optional["KernelPatterns"] = None) -> List[Launch]:
    """The kernel launches that compute problem into out (and lse when not None) as planned: one per column block
    of e (the first also writes lse), times one per index of the leading batch dims when the batch has more dims
    than the kernel takes after coalescing. With split keys, out and lse are split 0's partial results (in the
    accumulator type), split_strides the elements from one split's out and lse to the next's, and the blocks of
    every split run in the same launches. patterns: what the plan's mods read (kernel_patterns)."""
    check_plan(problem, plan)
    result = []
    for index, (e0, e1) in enumerate(plan.column_blocks):
        operands = {"q": problem.q, "k": problem.k, "v": problem.v[..., e0:e1], "mask": problem.mask,
                    "bias": problem.bias, "out": out[..., e0:e1], "lse": lse if index == 0 else None}
        result += _batch_launches(problem, operands, e1 - e0, plan, split_strides, patterns)
    return result


def row_terms(problem, dout, out, lse):
    """What the backward kernels need of each query row, made once for both: (shift, D_i) pairs in the accumulator
    type, shape (*batch, n, 2), contiguous (a query tile's pairs are copied as they are, 8 or 16 bytes a row).
    shift = lse log2 e, the lse in the log2 domain of P = exp2(s log2 e - shift), and 0 where lse is -inf: that row
    saw no key, and its P = exp2(-inf - 0) = 0, never NaN. D_i = rowsum(dO_i * O_i), FlashAttention-2's
    preprocessing."""
    xp, acc, packed = problem.xp, problem.acc_dtype, problem.packed
    if problem.shape.packed:  # per row of the packed arrays, read at the sequences' rows
        dout, out, lse = (packed.whole(x, "q") for x in (dout, out, lse))
    terms = xp.empty(tuple(lse.shape) + (2,), dtype=acc)
    with np.errstate(invalid="ignore", over="ignore"):
        shift = lse.astype(acc) * acc.type(LOG2E)
        terms[..., 0] = xp.where(lse == -np.inf, acc.type(0), shift)
        terms[..., 1] = problem.delta(dout, out)
    return packed.batched(terms, problem.batch[0], problem.n) if problem.shape.packed else terms


def backward_operands(problem, dout, terms, grads) -> dict:
    """Every operand of the backward kernels by name: dout and the row terms (row_terms) in, grads = (dq, dk, dv,
    dbias or None) over the whole batch in the accumulator type out. Made once for both kernels."""
    return {"q": problem.q, "k": problem.k, "v": problem.v, "mask": problem.mask, "bias": problem.bias, "dout": dout,
            "terms": terms, **dict(zip(("dq", "dk", "dv", "dbias"), grads))}


def backward_launches(problem, plan: Plan, operands: dict, patterns=None) -> List[Launch]:
    """The launches of one backward kernel as planned (a plan of kind "dq" or "dkdv") on backward_operands."""
    check_plan(problem, plan)
    return _batch_launches(problem, operands, problem.e, plan, (0, 0), patterns)


def check_plan(problem, plan: Plan) -> None:
    if plan.shape != problem.shape:
        raise ValueError(f"attention: a plan for {plan.shape} cannot run a problem of {problem.shape}")


def _batch_launches(problem, operands, e, plan: Plan, split_strides, patterns=None) -> List[Launch]:
    """operands: arrays by name (OPERANDS), None or absent where the kernel has none."""
    xp = problem.xp
    patterns = None if patterns is None else patterns.planned(plan, xp)
    # Operands whose byte strides are not whole elements (exotic views) are copied once.
    operands = {name: x if x is None or element_strides(x) is not None else xp.ascontiguousarray(x)
                for name, x in operands.items()}
    nb = len(problem.batch)

    def batch_strides_of(arrays, dims):
        return [element_strides(arrays[name])[:dims] if arrays.get(name) is not None else (0,) * dims
                for name in OPERANDS]

    shape, batch_strides = coalesce(problem.batch, batch_strides_of(operands, nb))
    if len(shape) <= MAX_BATCH_DIMS:
        return [_launch(problem, operands, shape, batch_strides, e, plan, split_strides, patterns)]
    assert patterns is None, "kernel_patterns keeps the kernels' mods to a batch one launch covers"
    # Dropout counts the batch item over the whole launch's batch (Params::dropout): kernel_patterns sends problems of
    # more than MAX_BATCH_DIMS batch axes, the only ones launched per leading index, to the blocked algorithm.
    assert problem.dropout is None, "kernel_patterns keeps dropout to a batch one launch covers"
    # Too many batch dims: launch per index of the leading ones, on views.
    lead = len(problem.batch) - MAX_BATCH_DIMS
    result = []
    for index in np.ndindex(*problem.batch[:lead]):
        views = {name: None if x is None else x[index] for name, x in operands.items()}
        sub_shape, sub_strides = coalesce(problem.batch[lead:], batch_strides_of(views, MAX_BATCH_DIMS))
        result.append(_launch(problem, views, sub_shape, sub_strides, e, plan, split_strides))
    return result


def geometry_table(shape, batch_strides, operands, plan: Plan, split_strides) -> np.ndarray:
    """The Geometry of one launch as int64 words: the coalesced batch shape, every operand's row, column and batch
    strides (in elements; zero for an absent one), and the key split."""
    table = np.zeros((), GEOMETRY)
    table["batch_count"], table["rank"] = math.prod(shape), len(shape)
    table["shape"][:] = 1
    table["shape"][:len(shape)] = shape
    for index, name in enumerate(OPERANDS):
        x = operands.get(name)
        if x is not None:
            s = element_strides(x)
            assert s is not None, name  # _batch_launches copied those with strides of parts of an element
            op = table["op"][index]
            op["row"], op["col"] = (s[-1], 0) if name in ROW_VECTORS else s[-2:]
            op["batch"][:len(shape)] = batch_strides[index]
    table["split_keys"] = plan.split_keys
    table["split_out"], table["split_lse"] = split_strides
    return table.reshape(1).view(np.int64)


def launch_flags(problem, operands) -> int:
    flags = 0
    for name, bit in VECTOR_FLAGS:
        x = operands.get(name)
        if x is not None and vector_ok(x, element_strides(x)) and pages_aligned(problem, name):
            flags |= bit
    if operands.get("mask") is not None:
        flags |= HAS_MASK
    if operands.get("bias") is not None:
        flags |= HAS_BIAS | (BIAS_HIDES if problem.bias_hides else 0)
    if operands.get("lse") is not None:
        flags |= WANT_LSE
    if operands.get("dbias") is not None:
        flags |= WANT_DBIAS
    return flags


def pages_aligned(problem, name: str) -> bool:
    """Whether a paged operand's pages start 16 bytes apart (every operand of an unpaged problem: True)."""
    paged = problem.paged
    if paged is None or name not in ("k", "v"):
        return True
    return paged.page_stride(name) * problem.dtype.itemsize % 16 == 0


def kernel_params(problem, operands, table, e, flags, patterns=None) -> np.ndarray:
    """The kernel's Params (one PARAMS element) for these operands (arrays by name; None or absent: a null
    pointer, never read), the device's geometry table and what the mods read (patterns, or none)."""
    params = np.zeros(1, PARAMS[problem.acc_dtype.name])
    for name in OPERANDS:
        if operands.get(name) is not None:
            params[name] = address(operands[name])
    params["geometry"] = address(table)
    left, right = problem.window.reach(problem.n, problem.m)  # int64 whatever the sides
    for name, value in zip(SIZES, (problem.n, problem.m, problem.d, e, left, right)):
        params[name] = value
    params["scale_log2"], params["scale"] = problem.scale * LOG2E, problem.scale
    params["flags"] = flags
    if problem.shape.packed:
        for name in PACKED_OFFSETS:
            params[name] = address(getattr(problem.packed, name))
        params["sequence_items"] = problem.batch_size // problem.batch[0]
    if problem.paged is not None:
        paged, pages = problem.paged, params["pages"]
        pages["table"], pages["seqlens"] = address(paged.block_table), address(paged.seqlens)
        pages["table_stride"], pages["size"] = paged.block_table.shape[1], paged.page_size
        pages["stride_k"], pages["stride_v"] = paged.page_stride("k"), paged.page_stride("v")
        params["sequence_items"] = problem.batch_size // problem.batch[0]
    if problem.dropout is not None:
        write_dropout(params["dropout"], problem.dropout, problem.batch)
    if patterns is not None:
        patterns.write(params["mods"], problem.batch)
    return params


def write_dropout(record, dropout, batch) -> None:
    """Params::dropout (kernels/tile.cuh Dropping) of a problem of this batch shape (kernels take dropout only
    where it has at most MAX_BATCH_DIMS axes: kernel_patterns)."""
    record["seed"], record["base"], record["row0"], record["key0"] = dropout.seed, dropout.base, dropout.row0, \
        dropout.key0
    record["shape"][0, :len(batch)] = batch
    record["strides"][0, :len(batch)] = dropout.strides
    record["rank"], record["scale"], record["threshold"] = len(batch), dropout.scale, dropout.threshold


def _launch(problem, operands, shape, batch_strides, e, plan: Plan, split_strides, patterns=None) -> Launch:
    table = resident(problem.xp, geometry_table(shape, batch_strides, operands, plan, split_strides))
    params = kernel_params(problem, operands, table, e, launch_flags(problem, operands), patterns)
    batch_count = math.prod(shape)
    grid_y = max(1, min(batch_count, MAX_GRID_Y))
    grid = (plan.grid_x, grid_y, -(-batch_count // grid_y))
    arrays = tuple(x for x in operands.values() if x is not None) + (table,) + \
        (() if patterns is None else patterns.arrays) + packed_offsets(problem)
    return Launch(plan.name, grid, plan.block, plan.shared_mem, (params,), arrays)


def packed_offsets(problem) -> tuple:
    """The arrays of a packed problem's offsets, or a paged problem's table, key counts and caches, which its
    kernels read (none without)."""
    if problem.paged is not None:
        paged = problem.paged
        return paged.block_table, paged.seqlens, paged.k_cache, paged.v_cache
    if not problem.shape.packed:
        return ()
    return tuple(getattr(problem.packed, name) for name in PACKED_OFFSETS)


# ----------------------------------------------------------------------------------------------------------------
# Patterns: what the kernels' mods read (Params::mods)


@dataclass
class KernelPatterns:
    """A call's mods as its kernels take them: their CUDA (kernels/mods.KernelMods: the plan's, with_mods), the
    arrays they close over as arrays of the call's module (tables), the sinks ((*batch,) in the accumulation type,
    contiguous; None: none) and the int32 a read outside a table writes its table's number + 1 into (error)."""

    mods: Any
    tables: Tuple[Any, ...]
    sinks: Any
    error: Any
    block_mask: Any = None
    visits: Tuple[Any, ...] = ()  # planned(): the block mask's (count, entries, owned) on the plan's tiles

    @property
    def arrays(self) -> tuple:
        return tuple(x for x in self.tables + (self.sinks, self.error) + self.visits[:2] if x is not None)

    def planned(self, plan: Plan, xp) -> "KernelPatterns":
        """These patterns for one plan's kernel: with a block mask, the tiles its blocks visit (BlockMask.visits
        on the plan's tiles, its blocks' own axis first)."""
        if self.block_mask is None:
            return self
        keys_own = plan.family.tiles_along == "keys"
        return dataclasses.replace(self, visits=self.block_mask.visits(plan.config.Br, plan.config.Bc, keys_own, xp))

    def write(self, args, batch) -> None:
        """Params::mods (an array of one ARGS record) for a problem of this batch shape."""
        args["batch"][0, :] = 1
        args["batch"][0, :len(batch)] = batch
        if self.visits:
            count, entries, owned = self.visits
            visits = args["visits"]
            visits["count"], visits["list"] = address(count), address(entries)
            visits["entry_stride"][0, :len(batch)] = self.block_mask.entry_strides(len(batch))
            visits["owned"], visits["width"] = owned, entries.shape[1]
        tables = args["table"]
        for t, table in enumerate(self.tables):
            tables["data"][0, t] = address(table)
            tables["shape"][0, t, :table.ndim] = table.shape
            tables["stride"][0, t, :table.ndim] = element_strides(table)
        args["sinks"] = 0 if self.sinks is None else address(self.sinks)
        args["error"] = 0 if self.error is None else address(self.error)

    def check_reads(self) -> None:
        """The IndexError of a read outside a table, after the launches (on a GPU this waits for them)."""
        if self.error is None:
            return
        flagged = int(self.error[0])
        if flagged:
            name, number = self.mods.owners[flagged - 1]
            shape = tuple(self.tables[flagged - 1].shape)
            raise IndexError(f"{name}: an index is out of bounds for table{number} (shape {shape}), the array it "
                             f"closes over; mods do not wrap negative indices")


def kernel_patterns(problem, forward: bool) -> Tuple[Optional[KernelPatterns], Optional[str]]:
    """(the problem's mods as its kernels take them, or None where it has none; why the kernels cannot take them,
    or None). forward: whether the sinks enter (the backward reads them through the lse)."""
    score, mask, blocks = problem.score_mod, problem.mask_mod, problem.block_mask
    sinks = problem.sinks if forward else None
    if problem.dropout is not None and len(problem.batch) > MAX_BATCH_DIMS:
        return None, (f"attention dropout over {len(problem.batch)} batch axes is the blocked algorithm's (the kernels "
                      f"count a batch item's place over at most {MAX_BATCH_DIMS})")
    if score is None and mask is None and sinks is None and blocks is None:
        return None, None
    if problem.score_mod_grads and not forward:
        return None, "the gradients of score_mod's arrays are the blocked algorithm's"
    why = kernel_mods.unsupported(score, mask, len(problem.batch))
    if why is not None:
        return None, why
    xp = problem.xp
    tables = tuple(kernel_table(a, xp) for a in (score.arrays if score else ()) + (mask.arrays if mask else ()))
    code = kernel_mods.kernel_mods(score, mask, len(problem.batch), sinks is not None, tables, blocks is not None)
    sinks = None if sinks is None else xp.ascontiguousarray(sinks)
    error = xp.zeros(1, dtype=np.int32) if tables else None
    return KernelPatterns(code, tables, sinks, error, blocks), None


def kernel_table(array, xp):
    """A captured array as the kernels read it: an array of xp (torch's by DLPack; bfloat16 as float32) whose byte
    strides are whole elements."""
    from .mods import as_module_array
    if "bfloat16" in str(array.dtype) and type(array).__module__.startswith("torch"):
        array = array.float()
    table = as_module_array(array, xp)
    return table if element_strides(table) is not None else xp.ascontiguousarray(table)


# ----------------------------------------------------------------------------------------------------------------
# Small constant arrays kept on the device


_resident: Dict[tuple, Any] = {}  # (device id, dtype, bytes) -> device array holding those bytes, oldest first
_captured: Set[tuple] = set()  # keys of the tables a CUDA graph capture has used


def resident(xp, host: np.ndarray):
    """`host` as an array of xp. On a GPU it is copied once per device and kept: a loop of calls with the same shapes
    then makes no host-to-device copy (which would block the host) and no allocation per call.

    Lifetime, the one invariant: a table is freed only when no launch can read it any more. Kernels queued on any
    stream of its device have finished before it is evicted (the device is synchronized first), and a table a
    graph capture used is never evicted, since every replay of that graph reads it."""
    if xp is np:
        return host
    key = (xp.cuda.Device().id, host.dtype.str, host.tobytes())
    stream = xp.cuda.get_current_stream()
    array = _resident.get(key)
    if array is None:
        if stream.is_capturing():
            raise RuntimeError("attention: the first call with these shapes (and strides) on this device copies a "
                               "small table to the GPU, which a CUDA graph cannot capture: make one call outside "
                               "the capture first (a warm-up), then capture")
        if len(_resident) >= RESIDENT_LIMIT:
            _evict_oldest(xp)
        array = _resident[key] = xp.asarray(host)
        # The copy runs on the current stream; a later call may launch on another one, so it must have landed.
        stream.synchronize()
    elif stream.is_capturing():
        _captured.add(key)
    return array


def _evict_oldest(xp) -> None:
    """Drop the oldest table no captured graph holds, once its device has finished every queued kernel."""
    key = next((key for key in _resident if key not in _captured), None)
    if key is None:
        return  # every table belongs to a captured graph: keep them all
    xp.cuda.Device(key[0]).synchronize()
    del _resident[key]


# ----------------------------------------------------------------------------------------------------------------
# Split keys (flash-decoding)


# A backend's way to its kernels: get_kernel(plan) compiles the plan's kernel (once) and returns a function that
# launches one Launch of it on the backend's module.
GetKernel = Callable[[Plan], Callable[["Launch"], Any]]


def run(problem, out, lse, plan: Plan, get_kernel: GetKernel, patterns: Optional[KernelPatterns] = None) -> None:
    """Launch every kernel of the plan (get_kernel: the backend's, GetKernel). With split keys the partial results
    land in scratch in the accumulator type and are combined into out and lse. A launch error names the kernel and
    the configuration. patterns: what the plan's mods read (kernel_patterns)."""
    if plan.splits > 1:
        xp, acc = problem.xp, problem.acc_dtype
        parts_out = xp.empty((plan.splits,) + tuple(out.shape), dtype=acc)
        parts_lse = xp.empty((plan.splits,) + tuple(out.shape[:-1]), dtype=acc)
        strides = parts_out.strides[0] // acc.itemsize, parts_lse.strides[0] // acc.itemsize
        _run(launches(problem, parts_out[0], parts_lse[0], plan, strides, patterns), plan, get_kernel)
        combine(parts_out, parts_lse, out, lse, xp)
    else:
        _run(launches(problem, out, lse, plan, patterns=patterns), plan, get_kernel)
    if patterns is not None:
        patterns.check_reads()


def run_backward(problem, plans, dout, out, lse, grads, get_kernel: GetKernel,
                 patterns: Optional[KernelPatterns] = None) -> None:
    """The backward kernels as planned (tiling.backward_plans): the row terms first (row_terms: the lse in the log2
    domain and D_i = rowsum(dout * out), FlashAttention-2's preprocessing), then each kernel, the only writer of its
    gradients."""
    operands = backward_operands(problem, dout, row_terms(problem, dout, out, lse), grads)
    for plan in plans:
        if plan.grid_x:  # no keys: dk and dv are empty, dq stays 0
            _run(backward_launches(problem, plan, operands, patterns), plan, get_kernel)
    if patterns is not None:
        patterns.check_reads()


def _run(todo: List[Launch], plan: Plan, get_kernel: GetKernel) -> None:
    for launch in todo:
        if launch.grid[2] > MAX_GRID_Y:
            raise ValueError(f"attention: a batch of {launch.grid[1] * launch.grid[2]} items is more than one launch "
                             f"can cover")
        kernel = get_kernel(plan)
        try:
            kernel(launch)
        except Exception as exc:
            raise RuntimeError(
                f"attention: launching {launch.name} (block {plan.config}, grid {launch.grid}, "
                f"{launch.shared_mem} bytes of shared memory) failed: {exc}") from exc
