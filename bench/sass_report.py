"""SASS report: the hot loop of each kernel the planner picks, read statically from the compiler's SASS.

    python -m bench.sass_report [--gpu H100 ...] [--dtype float16 ...] [--d 64 ...] [--n N] [--m M] [--causal]
                                [--block mma|fma|BrxBc] [--kernels all|forward|backward] [--precision P ...]
                                [--json FILE] [--sass-dir DIR] [--tiny]

Each kernel is compiled with NVRTC for the GPU's architecture (no GPU needed) and disassembled with cuobjdump.
In its SASS the loops are the backward branches; the key-tile loop (the swept-tile loop of the backward) is the
outermost loop holding the tensor-core or FMA instructions, and the loops inside it (tile loads, the CUDA-core
products) are weighted by trip counts derived from the template arguments. Counted per warp and per tile: the
instructions of the steady state's path through the loop (full tiles, no mask or bias, no inf or NaN), by class,
and, beside them, every instruction compiled inside the loop (cold paths included). From documented per-SM rates
follows an upper bound on TFLOP/s per kernel and the resource that bounds it.

These are estimates from static code and published rates, not measurements: latencies, stalls, occupancy,
caches and DRAM are not modelled.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from cuflash import DeviceLimits, bfloat16, nvrtc, tiling
from cuflash import mods as cuflash_mods
from cuflash.family import Shape

SCHEMA = "cuflash-sass-report/1"

# ----------------------------------------------------------------------------------------------------------------
# SASS: instructions and their classes

LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", re.M)
FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$", re.M)


@dataclass(frozen=True)
class Instr:
    addr: int
    pred: str  # "" when unpredicated
    op: str  # the full opcode with its modifiers, "HMMA.16816.F32"
    args: str

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


def parse(text: str) -> List[Instr]:
    return [Instr(int(a, 16), (p or "").strip(), op, args.strip()) for a, p, op, args in LINE.findall(text)]


def split_functions(sass: str) -> Dict[str, str]:
    """cuobjdump's SASS text per mangled function name."""
    parts = FUNCTION.split(sass)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


CLASSES = {
    "tensor": "HMMA DMMA IMMA",
    "fma": "FFMA DFMA HFMA2",
    "float": "FMUL FADD FMNMX FSEL FSETP FCHK FRND DMUL DADD DSETP DMNMX HADD2 HMUL2 HMNMX2 HSETP2 "
             "F2F F2FP F2I I2F I2FP",
    "shared_load": "LDS LDSM",
    "shared_store": "STS",
    "cp_async": "LDGSTS",
    "global": "LDG STG",
    "local": "LDL STL",
    "mufu": "MUFU",
    "barrier": "BAR WARPSYNC DEPBAR LDGDEPBAR MEMBAR",
    "branch": "BRA BRX JMP BSSY BSYNC EXIT RET CALL BREAK",
    "shuffle": "SHFL",
    "integer": "IMAD IADD3 IADD LEA SHF SHL SHR LOP3 ISETP IMNMX VIMNMX VIADD VIADDMNMX IABS SEL MOV PRMT "
               "S2R S2UR CS2R P2R R2P R2UR PLOP3 POPC FLO BMSK BREV",
}
CLASS_OF = {op: cls for cls, ops in CLASSES.items() for op in ops.split()}
CLASS_NAMES = tuple(CLASSES) + ("other",)


def classify(ins: Instr) -> str:
    """The class of an instruction: by its opcode; HFMA2.MMA with zero operands is nvcc's idiom for moving a
    constant (not a multiply-add), an instruction predicated on @!PT never executes (ptxas pads with them), and
    the uniform datapath (U...) does integer and address work."""
    if ins.pred == "@!PT":
        return "other"
    if ins.base == "HFMA2" and ins.args.split(",")[1:3] == [" -RZ", " RZ"]:
        return "integer"
    if ins.base in CLASS_OF:
        return CLASS_OF[ins.base]
    return "integer" if ins.base.startswith("U") else "other"


TERMINATORS = {"EXIT", "RET", "BPT", "KILL"}


def is_jump(ins: Instr) -> bool:
    """BRA, JMP, and CALL.REL.NOINC: a call that pushes no return address, which the compiler uses as a loop's
    exit branch (on sm_80, a loop that ends in an unconditional BRA back leaves by one)."""
    return ins.base in ("BRA", "JMP") or ins.op.startswith("CALL.REL.NOINC")


def branch_target(ins: Instr) -> Optional[int]:
    if not is_jump(ins):
        return None
    found = re.findall(r"0x([0-9a-f]+)", ins.args)
    return int(found[-1], 16) if found else None


def falls_through(ins: Instr) -> bool:
    """Whether execution may go on to the next instruction: not after an unconditional jump or exit."""
    conditional = bool(ins.pred) or ".DIV" in ins.op or re.match(r"!?U?P\d", ins.args or "")
    return conditional or (not is_jump(ins) and ins.base != "BRX" and ins.base not in TERMINATORS)


# ----------------------------------------------------------------------------------------------------------------
# Loops: backward branches


@dataclass
class Loop:
    """Instructions [head, end] (indices); latches: the backward branches to head; children: loops directly
    inside."""

    head: int
    end: int
    latches: List[int]
    children: List["Loop"] = field(default_factory=list)

    def contains(self, other: "Loop") -> bool:
        return self.head <= other.head and other.end <= self.end and other is not self


def forward_successors(code: Sequence[Instr], index: Dict[int, int], i: int) -> List[int]:
    """Where execution may go after instruction i, going forward: the next instruction, a later branch target."""
    succ = [i + 1] if falls_through(code[i]) and i + 1 < len(code) else []
    target = branch_target(code[i])
    if target is not None and index.get(target, -1) > i:
        succ.append(index[target])
    return succ


def runs_into(code: Sequence[Instr], index: Dict[int, int], head: int, latch: int) -> bool:
    """Whether going forward from head, inside [head, latch], reaches latch: a loop's body does; the jump back
    from an out-of-line stub (a divergent warp's collective, placed after the kernel's exit) does not."""
    seen, todo = {head}, [head]
    while todo:
        i = todo.pop()
        if i == latch:
            return True
        for j in forward_successors(code, index, i):
            if j <= latch and j not in seen:
                seen.add(j)
                todo.append(j)
    return False


def find_loops(code: Sequence[Instr]) -> List[Loop]:
    """The loop tree (top-level loops, their inner loops as children) from the backward branches: a branch to an
    earlier instruction from which going forward reaches it again. (A branch to itself, the trap after the last
    exit, is none.) Loops whose spans cross are not nested code; the larger is kept."""
    index = {ins.addr: i for i, ins in enumerate(code)}
    by_head: Dict[int, Loop] = {}
    for i, ins in enumerate(code):
        target = branch_target(ins)
        if target is not None and target < ins.addr and target in index and runs_into(code, index, index[target], i):
            loop = by_head.setdefault(index[target], Loop(index[target], i, []))
            loop.end = max(loop.end, i)
            loop.latches.append(i)
    accepted: List[Loop] = []
    for loop in sorted(by_head.values(), key=lambda lp: lp.head - lp.end):  # largest first
        if not any(lp.head < loop.head <= lp.end < loop.end or loop.head < lp.head <= loop.end < lp.end
                   for lp in accepted):
            accepted.append(loop)
    top = []
    for loop in accepted:
        parent = min((lp for lp in accepted if lp.contains(loop)), key=lambda lp: lp.end - lp.head, default=None)
        (parent.children if parent else top).append(loop)
    for loop in accepted:
        loop.children.sort(key=lambda lp: lp.head)
    return sorted(top, key=lambda lp: lp.head)


def span_classes(code: Sequence[Instr], loop: Loop) -> Counter:
    return Counter(classify(ins) for ins in code[loop.head:loop.end + 1])


def key_loop(code: Sequence[Instr], loops: Sequence[Loop]) -> Loop:
    """The key-tile loop: the top-level loop with the most tensor-core instructions, or FMA where none has any.
    Where several hold as many (a kernel that compiles its steady state's tiles in a loop of their own, apart from
    the tiles that need masks or checks), the smallest: the others carry the cold paths. Where all of that loop's
    products and loads sit in one inner loop, the tiles run there (the hot loop), and the loop around it only
    takes a rare path (the forward's rescale when a row's max grows): the inner loop is the key-tile loop."""
    spans = [(span_classes(code, lp), lp) for lp in loops]
    for cls in ("tensor", "fma"):
        most = max((s[0][cls] for s in spans), default=0)
        if most:
            loop = min((lp for counts, lp in spans if counts[cls] == most), key=lambda lp: lp.end - lp.head)
            return _hot_loop(code, loop, cls)
    raise ValueError("no loop holds tensor-core or FMA instructions")


def _hot_loop(code: Sequence[Instr], loop: Loop, cls: str) -> Loop:
    def work(lp):
        counts = span_classes(code, lp)
        return counts[cls], counts["cp_async"] + counts["global"]

    for child in loop.children:
        if work(child) == work(loop) and work(child)[1]:
            return _hot_loop(code, child, cls)
    return loop


def kind_of(code: Sequence[Instr], loop: Loop) -> str:
    """What an inner loop does, from what it holds: "tensor", "fma" (CUDA-core products), "load" (global to
    shared) or "other"."""
    classes = span_classes(code, loop)
    for kind, cls in (("tensor", "tensor"), ("fma", "fma"), ("load", "global"), ("load", "cp_async")):
        if classes[cls]:
            return kind
    return "other"


# ----------------------------------------------------------------------------------------------------------------
# The steady state's path through a loop
#
# Cold code (masks, biases, tiles that straddle the window, inf or NaN in hidden rows, divergent warps) only adds
# instructions, so the steady state's tile takes the cheapest way through each branch: the path from the loop's
# head to its back edge with the fewest instructions, each inner loop counted as its own cheapest iteration times
# its trip count. Branches are taken independently, so the path may combine conditions that cannot hold
# together: it is a lower bound on the work of a tile, which is what an upper bound on speed needs. What every
# tile does is required: the path passes each tensor-core instruction, and one loop of each group of alternative
# inner loops the tile must run (its loads, the CUDA-core kernels' products: a vector and an element copy, a
# partial and a full tile's version); the other inner loops are cold, avoided where a path can.

Tally = Counter  # (class, opcode) -> instructions


def tally(ins: Instr) -> Tally:
    return Counter({(classify(ins), ins.op): 1})


def scaled(counts: Tally, factor: int) -> Tally:
    return Counter({key: n * factor for key, n in counts.items()})


def _nodes(code: Sequence[Instr], loop: Loop):
    """The loop's body as a graph in address order: {start index: (inner loop or None, successors, is a latch)},
    each inner loop collapsed into one node; no edge leaves the loop or goes backward."""
    index = {ins.addr: i for i, ins in enumerate(code)}
    owner = {i: child for child in loop.children for i in range(child.head, child.end + 1)}

    def onward(first, last):  # the nodes reached from instructions [first, last] going past last
        return sorted({owner[j].head if j in owner else j for i in range(first, last + 1)
                       for j in forward_successors(code, index, i) if last < j <= loop.end})

    nodes, i = {}, loop.head
    while i <= loop.end:
        child = owner.get(i)
        last = child.end if child else i
        nodes[i] = (child, onward(i, last), i in loop.latches)
        i = last + 1
    return nodes


def reachable(nodes, start: int) -> set:
    seen, todo = set(), [start]
    while todo:
        i = todo.pop()
        for j in nodes[i][1]:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    return seen


def groups_of(nodes, candidates: Sequence[Loop]) -> List[List[Loop]]:
    """Required inner loops grouped into alternatives: two loops neither of which reaches the other are two
    versions of one step (if/else copies), so the path takes one of them. Groups in address order."""
    reach = {lp.head: reachable(nodes, lp.head) for lp in candidates}
    group = {lp.head: lp.head for lp in candidates}

    def root(h):
        while group[h] != h:
            h = group[h]
        return h

    for a in candidates:
        for b in candidates:
            if a.head < b.head and b.head not in reach[a.head] and a.head not in reach[b.head]:
                group[root(b.head)] = root(a.head)
    groups: Dict[int, List[Loop]] = {}
    for lp in candidates:
        groups.setdefault(root(lp.head), []).append(lp)
    return [groups[h] for h in sorted(groups)]


def cheapest_path(code: Sequence[Instr], loop: Loop, cost: Dict[int, Tally], groups: Sequence[Sequence[Loop]]):
    """The tally of the cheapest path from the loop's head through its back edge that passes one loop of each
    group in order; `cost` holds each inner loop's tally (an iteration times its trip count). The other inner
    loops (CUDA-core fallbacks, scans for inf or NaN, element-wise copies) are cold: the path avoids them where it
    can, and takes them weighted 1 where it cannot. Every tensor-core instruction of the loop's own body is on the
    path too: each tile computes all of its products (no edge may jump over one). None when no path passes them."""
    required = {lp.head for members in groups for lp in members}
    optional = {child.head for child in loop.children} - required
    inner = {i for child in loop.children for i in range(child.head, child.end + 1)}
    products = [i for i in range(loop.head, loop.end + 1) if i not in inner and classify(code[i]) == "tensor"]
    counts = _cheapest(code, loop, cost, groups, optional, products)
    return counts if counts is not None else _cheapest(code, loop, cost, groups, set(), products)


def unrolled_copies_path(code: Sequence[Instr], loop: Loop, cost: Dict[int, Tally], copies: int,
                         groups: Sequence[Sequence[Loop]] = ()):
    """The cheapest path that passes at least `copies` 16-byte global loads of its own (cp.async or LDG), a full
    tile's loads unrolled (the other way a tile may take its loads), and one loop of each of `groups` in order
    (the products' inner loops, where they have them), and no other inner loop. None when no path does."""
    inner = {i for child in loop.children for i in range(child.head, child.end + 1)}
    products = [i for i in range(loop.head, loop.end + 1) if i not in inner and classify(code[i]) == "tensor"]
    avoid = {child.head for child in loop.children} - {lp.head for members in groups for lp in members}
    return _cheapest(code, loop, cost, groups, avoid, products, copies)


def is_chunk_load(ins: Instr) -> bool:
    return classify(ins) in ("global", "cp_async") and ins.op.startswith("LDG") and "128" in ins.op.split(".")


def _cheapest(code, loop, cost, groups, avoid, products, copies=0):
    """A path's state: the groups passed, in order, and the 16-byte loads passed (up to `copies`)."""
    nodes = _nodes(code, loop)
    goal = (len(groups), copies)
    states = [(g, c) for g in range(len(groups) + 1) for c in range(copies + 1)]

    def skips_a_product(i, j):
        k = bisect.bisect_right(products, i)
        return k < len(products) and products[k] < j

    stage = {lp.head: g for g, members in enumerate(groups) for lp in members}
    inf = math.inf
    best: Dict[tuple, Tuple[float, Optional[tuple]]] = {(loop.head, (0, 0)): (0, None)}
    finish: Tuple[float, Optional[tuple]] = (inf, None)
    for i in sorted(nodes):
        child, succ, latch = nodes[i]
        if i in avoid:
            continue
        weight = sum(cost[i].values()) if child is not None else 1
        for k in states:
            if (i, k) not in best:
                continue
            after = best[(i, k)][0] + weight
            g, c = k
            g2 = g + 1 if child is not None and stage.get(i) == g else g
            c2 = min(copies, c + 1) if copies and child is None and is_chunk_load(code[i]) else c
            if latch and k == goal and after < finish[0]:
                finish = (after, (i, k))
            for j in succ:
                if after < best.get((j, (g2, c2)), (inf,))[0] and not skips_a_product(i, j):
                    best[(j, (g2, c2))] = (after, (i, k))
    if finish[1] is None:
        return None
    counts, state = Counter(), finish[1]
    while state is not None:
        i = state[0]
        counts += cost[i] if nodes[i][0] is not None else tally(code[i])
        state = best[state][1]
    return counts


def span_tally(code: Sequence[Instr], loop: Loop, trips: Dict[int, int]) -> Tally:
    """Every instruction compiled inside the loop, each inner loop weighted by its trip count (1 when unknown)."""
    counts = Counter()
    inner = {i for child in loop.children for i in range(child.head, child.end + 1)}
    for i in range(loop.head, loop.end + 1):
        if i not in inner:
            counts += tally(code[i])
    for child in loop.children:
        counts += scaled(span_tally(code, child, {}), trips.get(child.head, 1))
    return counts


# ----------------------------------------------------------------------------------------------------------------
# Trip counts of the inner loops, per kernel family
#
# A tile of each kernel runs these steps as inner loops, in source order: a tile load from global to shared
# memory (a 16-byte chunk per thread per source iteration; an element per iteration in the element-wise copy for
# strided views), the backward's per-row terms (lse and D_i, a row per thread), and, in the CUDA-core kernels,
# the tile products (R x C FMAs per thread per source iteration). A compiled loop's trip count is the step's work
# per thread divided by the work one compiled iteration does (so unrolling is read from the SASS, not assumed):
# chunks by its 16-byte global loads, elements by its global loads, rows by its shared stores (two per row), FMAs
# by its FMA instructions. The tensor-core kernels' products are unrolled whole (but float32's and float64's over
# the head dims, a step a time): their inner loops are the loads (in the forward, the prefetch of a later tile),
# the others cold (CUDA-core fallbacks, scans for inf or NaN).

LANES_PER_ROW = 16  # kLanesPerRow in kernels/forward.cuh: the lanes of a row group


@dataclass(frozen=True)
class Step:
    name: str
    unit: str  # what `work` counts per thread: "chunks" (and `elements`), "rows", "fmas" or "mmas" (per warp)
    work: int
    elements: int = 0

    @property
    def kind(self) -> str:
        return {"fmas": "fma", "mmas": "tensor"}.get(self.unit, "load")


def steps(plan) -> List[Step]:
    """The inner loops a tile of the plan's kernel runs, in source order."""
    shape, config, kind = plan.shape, plan.config, plan.family.kind
    D, E = plan.family.buckets(shape, config)
    threads, chunk = 32 * config.warps, 16 // shape.dtype.itemsize
    Br, Bc, d, e = config.Br, config.Bc, shape.d, shape.e

    def load(name, rows, cols):
        return Step(name, "chunks", -(-rows * cols // chunk // threads), -(-rows * cols // threads))

    if kind == "dkdv":
        loads = [load("Q_i", Br, D), load("dO_i", Br, E), Step("lse and D_i", "rows", -(-Br // threads))]
    else:
        loads = [load("K_j", Bc, D), load("V_j", Bc, E)]
    if config.variant == "mma":
        if shape.dtype.itemsize == 2:
            return loads
        # float32 and float64 take Q K^T step by step in a loop (kernels/mma_tile.cuh's kUnrollSteps), and so do
        # the backward's products over the head dims (backward_mma.cuh's Products::nk): tensor instructions per
        # warp are MT x (swept columns / 8) x (D / step) x those of one step (3 or 1 TF32, 2 DMMA)
        item = shape.dtype.itemsize
        per_step = 2 if item == 8 else 3 if shape.precision == "highest" else 1
        own, swept = (Bc, Br) if kind == "dkdv" else (Br, Bc)
        split = plan.family.column_split(shape) if kind == "dkdv" else 1  # float64's pairs of warps per 16 keys
        mt = own * split // (16 * config.warps)

        def product(name, width):
            return Step(name, "mmas", mt * (swept // 8) * (width * item // 32) * per_step)
        if kind == "forward":
            return loads + [product("S = Q K^T over d", D)]
        if kind == "dkdv":
            return loads + [product("S^T = K Q^T over d", D), product("dP^T = V dO^T over e", E)]
        return loads + [product("S = Q K^T over d", D), product("dP = dO V^T over e", E)]
    own = (Bc if kind == "dkdv" else Br) // (threads // LANES_PER_ROW)  # rows of the block's own tile per thread
    products = {
        "forward": [("S = Q K^T over d", Bc, d), ("O += P V over Bc", E, Bc)],
        "dq": [("S = Q K^T over d", Bc, d), ("dP = dO V^T over e", Bc, e), ("dQ += dS K over Bc", D, Bc)],
        "dkdv": [("S^T = K Q^T over d", Br, d), ("dP^T = V dO^T over e", Br, e), ("dV += P^T dO over Br", E, Br),
                 ("dK += dS^T Q over Br", D, Br)],
    }[kind]
    return loads + [Step(name, "fmas", own * (cols // LANES_PER_ROW) * width) for name, cols, width in products]


def keep_bit_loop(code: Sequence[Instr], loop: Loop, once: Tally, plan) -> Optional[Tuple[int, str]]:
    """(trip count, how) of a dropout kernel's keep-bit loop (kernels/tile.cuh KeepTile::fill: the block's Philox
    calls, two groups of four keys and one byte stored per pair; the loop of a tile whose keys start on a group),
    or None for any other inner loop. Per thread: Br x Bc / 8 bytes over the block's threads."""
    if not plan.shape.dropout or loop.children:
        return None
    bytes_each = sum(n for (cls, op), n in once.items() if op.startswith("STS.U8"))
    if not bytes_each:
        return None
    work = -(-plan.config.Br * (plan.config.Bc // 8) // (32 * plan.config.warps))
    return max(1, -(-work // bytes_each)), f"{work} keep-bit bytes per thread / {bytes_each} per iteration"


def per_iteration(step: Step, counts: Tally) -> Tuple[int, int]:
    """(the step's work per thread, the work one compiled iteration with these counts does), in one unit."""
    def count(test):
        return sum(n for (cls, op), n in counts.items() if test(cls, op))

    if step.unit == "fmas":
        return step.work, count(lambda cls, op: cls == "fma")
    if step.unit == "mmas":
        return step.work, count(lambda cls, op: cls == "tensor")
    if step.unit == "rows":
        return step.work, count(lambda cls, op: cls == "shared_store") // 2
    chunks = count(lambda cls, op: cls in ("global", "cp_async") and op.startswith("LDG") and "128" in op.split("."))
    if chunks:
        return step.work, chunks
    return step.elements, count(lambda cls, op: op.startswith("LDG"))


# ----------------------------------------------------------------------------------------------------------------
# The analysis of one kernel


@dataclass
class LoopReport:
    """A kernel's key-tile loop: the steady-state path's tally and the span's (per warp, per tile), its
    addresses, its inner loops (address, kind, step, trip count) and notes on what could not be derived."""

    path: Tally
    span: Tally
    first: int
    last: int
    inner: List[dict]
    notes: List[str]
    loads: str = "loops"  # how the path takes the tile's loads: through its load loops, or "unrolled"


def iteration(code: Sequence[Instr], loop: Loop) -> Tally:
    """An inner loop's cheapest iteration, its own inner loops weighted 1 (their trip counts are not derived)."""
    counts = cheapest_path(code, loop, {c.head: iteration(code, c) for c in loop.children}, [])
    return counts if counts is not None else span_tally(code, loop, {})


def analyze(sass: str, plan) -> LoopReport:
    """The key-tile loop of one kernel's SASS, counted for the plan's tile."""
    code = parse(sass)
    loop = key_loop(code, find_loops(code))
    required = {"tensor", "load"} if plan.config.variant == "mma" else {"load", "fma"}
    candidates = [c for c in loop.children if kind_of(code, c) in required]
    groups = groups_of(_nodes(code, loop), candidates)
    wanted = steps(plan)
    notes = []
    kinds = [kind_of(code, g[0]) for g in groups]
    looped = wanted  # the steps with an inner loop of their own; a full tile's loads may be unrolled in the body
    if kinds != [s.kind for s in looped]:  # whole tiles' copies unrolled; the row terms still a loop of their own
        looped = [s for s in wanted if s.unit != "chunks"]
    if kinds != [s.kind for s in looped]:
        looped = [s for s in wanted if s.kind != "load"]
    if kinds != [s.kind for s in looped]:
        notes.append(f"the inner loops ({kinds}) do not match the steps ({[s.name for s in wanted]}): trip count "
                     f"unknown: weighted 1")
        wanted = looped = []
    step_of = {lp.head: s for g, s in zip(groups, looped) for lp in g}
    cost, trips, inner = {}, {}, []
    keep_bits, keep_heads = Counter(), set()  # a dropout kernel's keep bits of a tile: every tile makes them once
    for child in loop.children:
        once = iteration(code, child)
        step = step_of.get(child.head)
        trip, how = 1, "trip count unknown: weighted 1"
        keeps = keep_bit_loop(code, child, once, plan)
        if step is not None:
            work, each = per_iteration(step, once)
            if each:
                trip, how = max(1, -(-work // each)), f"{work} {step.unit} per thread / {each} per iteration"
        elif keeps is not None:
            trip, how = keeps
            keep_bits += scaled(once, trip)
            keep_heads.add(child.head)
        cost[child.head], trips[child.head] = scaled(once, trip), trip
        inner.append({"address": f"{code[child.head].addr:#x}-{code[child.end].addr:#x}", "kind": kind_of(code, child),
                      "step": "keep bits" if keeps is not None and step is None else step.name if step else None,
                      "required": child in candidates, "iteration": sum(once.values()), "trips": trip,
                      "trip_count": how})
    # The keep bits count once on the path, whether it passes their loop or the branch around it (the last tile
    # makes none: the path is a tile of the steady state).
    cost.update({head: Counter() for head in keep_heads})
    path = cheapest_path(code, loop, cost, groups)
    chunks = sum(s.work for s in wanted if s.unit == "chunks")
    products = [g for g, s in zip(groups, looped) if s.kind != "load"]  # the product loops an unrolled tile passes
    unrolled = unrolled_copies_path(code, loop, cost, chunks, products) if chunks else None
    # the tile's loads: through load loops, or copies unrolled in the body (all of them where no load loop exists)
    loads = "unrolled" if wanted and not any(s.unit == "chunks" for s in looped) else "loops"
    if unrolled is not None and (path is None or sum(unrolled.values()) < sum(path.values())):
        path, loads = unrolled, "unrolled"
    if path is None:
        notes.append("no path passes every required inner loop: the cheapest path without them")
        path = cheapest_path(code, loop, cost, [])
    path = path + keep_bits
    return LoopReport(path, span_tally(code, loop, trips), code[loop.head].addr, code[loop.end].addr, inner, notes,
                      loads)


# ----------------------------------------------------------------------------------------------------------------
# Per-SM rates and the bound


@dataclass(frozen=True)
class Rates:
    """Documented per-SM throughputs per clock (NVIDIA's architecture whitepapers; the CUDA C Programming Guide's
    table of arithmetic instruction throughput) and the boost clock of the vendor's peak figures. The SM counts
    are cuflash.DeviceLimits.known's."""

    clock_ghz: float
    tensor_16bit: float  # dense float16/bfloat16 FLOP through mma.sync (TF32: half of it)
    tensor_fp64: float  # dense float64 FLOP through DMMA (mma.m8n8k4)
    fp32: int  # lanes of FFMA, FMUL, FADD (the 16-bit CUDA-core ops counted alike)
    fp64: int  # lanes of DFMA, DMUL, DADD
    issue: int = 4  # warp instructions: 4 schedulers, one each per clock
    shared_bytes: int = 128  # 32 banks of 4 bytes
    mufu: int = 16  # lanes of MUFU (exp2, reciprocal): 4 per scheduler


# A100 (SXM): 312 dense fp16 tensor TFLOP/s = 108 SMs x 1.41 GHz x 2048 FLOP (1024 FMA) per clock; 64 FP32 and
# 32 FP64 lanes per SM. H100/H200 (SXM): 989 dense TFLOP/s = 132 x 1.83 GHz x 4096 FLOP per clock, through wgmma;
# mma.sync, which these kernels use, reaches about two thirds of that (measured on Hopper by others), taken here
# as 2731 FLOP per clock; 128 FP32 and 64 FP64 lanes per SM. TF32 runs at half the 16-bit rate (156 and 495
# dense TFLOP/s); float64 tensor cores give 19.5 TFLOP/s on an A100 (128 FLOP per clock) and 67 on an H100/H200
# (277 per clock), through mma.m8n8k4 alone.
RATES = {
    "A100": Rates(1.41, 2048, 128, 64, 32),
    "H100": Rates(1.83, 4096 * 2 / 3, 277, 128, 64),
    "H200": Rates(1.83, 4096 * 2 / 3, 277, 128, 64),
}
MMA_FLOPS = {"16816": 4096, "1688": 2048, "8816": 2048, "884": 512}  # per warp: 2 m n k of the shape
# (sm_90's SASS names DMMA's shape DMMA.8, sm_80's DMMA.884: every DMMA is m8n8k4)
FP32_PIPE, FP64_PIPE = {"FFMA", "FMUL", "FADD", "HFMA2", "HADD2", "HMUL2"}, {"DFMA", "DMUL", "DADD"}


def shared_wavefronts(op: str) -> int:
    """128-byte transfers of one warp-wide shared-memory access: 32 lanes times its width (broadcasts not
    credited); ldmatrix .x4 moves four 8x8 matrices of 16-bit values, 128 bytes each."""
    parts = op.split(".")
    if parts[0] == "LDSM":
        return int(parts[-1]) if parts[-1].isdigit() else 1
    width = next((int(p) for p in parts[1:] if p in ("64", "128")), 32)
    return max(1, 32 * width // 8 // 128)


def useful_flops(plan) -> int:
    """FLOPs of one tile (Br x Bc pairs): the forward's two products, 4 Br Bc d; the dq kernel's three (S, dP, dQ),
    the dkdv kernel's four (S, dP, dV, dK); 2 Br Bc per head-dimension column each."""
    pair, d, e = 2 * plan.config.Br * plan.config.Bc, plan.shape.d, plan.shape.e
    return {"forward": pair * (d + e), "dq": pair * (2 * d + e), "dkdv": pair * 2 * (d + e)}[plan.family.kind]


def bound(path: Tally, plan, rates: Rates, sm_count: int) -> dict:
    """Clocks per tile, per resource, for an SM busy with one block (the path per warp times the block's warps);
    the slowest resource bounds the tile, and TFLOP/s = useful FLOPs / its clocks x clock rate x SMs."""
    clocks = Counter()
    for (cls, op), n in path.items():
        base = op.split(".")[0]
        clocks["issue"] += n / rates.issue
        if cls == "tensor":
            shape = "884" if base == "DMMA" else next((p for p in op.split(".")[1:] if p in MMA_FLOPS), "16816")
            rate = rates.tensor_fp64 if base == "DMMA" else \
                rates.tensor_16bit / 2 if "TF32" in op.split(".") else rates.tensor_16bit
            clocks["tensor"] += n * MMA_FLOPS[shape] / rate
        if cls in ("fma", "float") and base in FP32_PIPE:
            clocks["fma"] += n * 32 / rates.fp32
        if base in FP64_PIPE:
            clocks["fma"] += n * 32 / rates.fp64
        if cls in ("shared_load", "shared_store", "cp_async"):  # cp.async writes shared memory
            clocks["shared"] += n * shared_wavefronts(op) * 128 / rates.shared_bytes
        if cls == "mufu":
            clocks["mufu"] += n * 32 / rates.mufu
    per_block = {r: round(clocks[r] * plan.config.warps, 1) for r in ("issue", "tensor", "fma", "shared", "mufu")}
    resource = max(per_block, key=per_block.get)
    tflops = useful_flops(plan) / per_block[resource] * rates.clock_ghz * 1e9 * sm_count / 1e12
    return {"clocks_per_tile": per_block, "bound": resource, "tflops": round(tflops, 1)}


# ----------------------------------------------------------------------------------------------------------------
# Compiling and disassembling

# What CuPy's RawModule adds to every NVRTC compile (cupy/cuda/compiler.py): the SASS read is the SASS that runs.
CUPY_FLAGS = ("-ftz=true", "--device-as-default-execution-space")


def cuobjdump() -> Optional[str]:
    """The cuobjdump executable: on PATH, or from the nvidia-cuda-cuobjdump wheel; None unless nvdisasm (which
    cuobjdump runs for -sass) sits beside it or on PATH."""
    candidates = [shutil.which("cuobjdump")]
    try:
        import nvidia
        candidates += [path for root in nvidia.__path__
                       for path in sorted(glob.glob(os.path.join(root, "*", "bin", "cuobjdump")))]
    except ImportError:
        pass
    for path in filter(None, candidates):
        beside = os.path.join(os.path.dirname(path), "nvdisasm")
        if os.access(path, os.X_OK) and (os.access(beside, os.X_OK) or shutil.which("nvdisasm")):
            return path
    return None


def nvrtc_available() -> bool:
    try:
        from cupy.cuda import nvrtc as binding
        binding.getVersion()
    except Exception:  # no CuPy, or no NVRTC library
        return False
    return True


def compile_sass(text: str, names: Sequence[str], arch: str) -> Dict[str, dict]:
    """{name expression: {"sass": cuobjdump's text for that function, "usage": ptxas's figures}} of kernels of
    the source string `text` (Plan.code: a kernel file and its mods) compiled for arch; cached in the temporary
    directory under a hash of the source, the names, the architecture and the flags."""
    names = sorted(set(names))
    key = hashlib.sha256("\n".join([SCHEMA, text, arch, *names, *CUPY_FLAGS]).encode()).hexdigest()[:24]
    cache = os.path.join(tempfile.gettempdir(), f"cuflash-sass-{key}.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    cubin, log, lowered = nvrtc.compile_program(text, names, arch, CUPY_FLAGS)
    usage = nvrtc.parse_ptxas(log)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernels.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout
    functions = split_functions(sass)
    result = {name: {"sass": functions[lowered[name]], "usage": vars(usage[lowered[name]])} for name in names}
    with open(cache + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(cache + ".tmp", cache)
    return result


def _compile(job):
    return compile_sass(*job)


# ----------------------------------------------------------------------------------------------------------------
# The report

DTYPES = {"float16": np.float16, "bfloat16": bfloat16, "float32": np.float32, "float64": np.float64}


# Mods a kernel can be compiled with (--mods): built-ins over (B, H) batches, their tables as a model has them.
MODS = {
    "softcap": lambda: (cuflash_mods.softcap(30.0), None),
    "alibi": lambda: (cuflash_mods.alibi(cuflash_mods.alibi_slopes(16)), None),
    "documents": lambda: (None, cuflash_mods.documents(np.zeros((1, 16384), np.int64))),
}


def kernel_mods_of(name: Optional[str]):
    """The CUDA of the named built-in mods (MODS) for two batch axes, or None."""
    if name is None:
        return None
    from cuflash.kernels import mods as kernel_mods
    score, mask = MODS[name]()
    return kernel_mods.kernel_mods(score and cuflash_mods.trace(score, "score", 2),
                                   mask and cuflash_mods.trace(mask, "mask", 2), 2)


def plans(gpu: str, dtype: str, d: int, n: int, m: int, batch: int, block, kernels_wanted: str,
          precision: str = "highest", mods: Optional[str] = None, paged: bool = False, dropout: bool = False):
    """[(kind, plan, or the sentence saying why there is none)] of what the planner picks for the problem (with
    the named mods compiled in: MODS; paged: the forward kernels that walk a paged cache's pages; dropout: the
    kernels that drop probabilities)."""
    device = DeviceLimits.known(gpu)
    shape = Shape(DTYPES[dtype], d, d, n, m, batch, precision, paged=paged, dropout=dropout)
    code = kernel_mods_of(mods)
    result = []
    if paged:
        kernels_wanted = "forward"  # a paged cache is read by the forward only
    if kernels_wanted in ("all", "forward"):
        try:
            result.append(("forward", tiling.plan(shape, device, block).with_mods(code)))
        except ValueError as exc:
            result.append(("forward", str(exc)))
    if kernels_wanted in ("all", "backward"):
        try:
            backward = tiling.backward_plans(shape, device, block)
        except ValueError as exc:
            backward = str(exc)
        if backward is None:
            backward = "no backward kernel serves this shape here: the blocked backward runs"
        result += [("backward", backward)] if isinstance(backward, str) else \
            [(p.family.kind, p.with_mods(code)) for p in backward]
    return result


def partial_fraction(plan, causal: bool) -> Optional[float]:
    """The share of the (query tile, key tile) pairs a launch visits that are partial (straddling the causal
    diagonal, or a short last key tile): those take the per-element visibility path, which the per-tile figures
    leave out. None when n or m is unknown or the tiles are too many to count here."""
    n, m, Br, Bc = plan.shape.n, plan.shape.m, plan.config.Br, plan.config.Bc
    if not n or not m or -(-n // Br) * -(-m // Bc) > 1 << 21:
        return None
    reach = m - n if causal else m  # query i sees keys up to i + reach (causal: bottom-right aligned)
    visited = partial = 0
    for i0 in range(0, n, Br):
        for j0 in range(0, min(m, min(n, i0 + Br) + reach), Bc):
            visited += 1
            partial += min(m, j0 + Bc) - j0 < Bc or j0 + Bc - 1 > i0 + reach
    return partial / visited if visited else 0.0


def classes(counts: Tally) -> Dict[str, int]:
    by = Counter()
    for (cls, _), n in counts.items():
        by[cls] += n
    return {cls: by[cls] for cls in CLASS_NAMES}


def ratio(a: float, b: float) -> Optional[float]:
    return round(a / b, 2) if b else None


def report_row(gpu: str, plan, compiled: dict, causal: bool) -> dict:
    """Everything the report says of one kernel (the JSON's row)."""
    loop = analyze(compiled["sass"], plan)
    path, span = classes(loop.path), classes(loop.span)
    total = sum(path.values())
    ldsm = sum(n for (_, op), n in loop.path.items() if op.startswith("LDSM"))
    lds = sum(n for (_, op), n in loop.path.items() if op.startswith("LDS.") or op == "LDS")
    device = DeviceLimits.known(gpu)
    row = {
        "gpu": gpu, "arch": device.arch, "sm_count": device.sm_count, "dtype": plan.shape.dtype.name,
        "precision": plan.shape.precision,
        "d": plan.shape.d, "e": plan.shape.e, "n": plan.shape.n, "m": plan.shape.m, "causal": causal,
        "kind": plan.family.kind, "kernel": plan.name, "config": str(plan.config), "warps": plan.config.warps,
        "mods": None if plan.mods is None else plan.mods.key, "paged": plan.shape.paged,
        "dropout": plan.shape.dropout,
        "usage": compiled["usage"], "loop": {"first": f"{loop.first:#x}", "last": f"{loop.last:#x}"},
        "per_tile": {"instructions": total, **path}, "span": {"instructions": sum(span.values()), **span},
        "opcodes": {op: n for (_, op), n in sorted(loop.path.items())},
        "inner_loops": loop.inner, "loads": loop.loads, "notes": loop.notes,
        "work": "tensor" if path["tensor"] else "fma",
        "instructions_per_mma": ratio(total, path["tensor"]), "instructions_per_fma": ratio(total, path["fma"]),
        "span_per_mma": ratio(sum(span.values()), span["tensor"]),
        "span_per_fma": ratio(sum(span.values()), span["fma"]),
        "ldmatrix_per_mma": ratio(ldsm, path["tensor"]), "shared_loads_per_fma": ratio(lds, path["fma"]),
        "flops_per_tile": useful_flops(plan), "partial_tiles": partial_fraction(plan, causal),
    }
    if plan.mods is not None:  # every tile takes the per-element path, whose cheapest way may skip the mods
        row["notes"] = row["notes"] + ["compiled with mods: no plain tiles, so the per-tile figures are the "
                                       "cheapest path through the per-element code (it may skip the mods' own "
                                       "code) and no bound is given; registers, spills and span hold"]
    elif gpu in RATES and not loop.notes:  # with a trip count unknown, a bound would mean nothing
        row.update(bound(loop.path, plan, RATES[gpu], device.sm_count))
    return row


def run(gpus, dtypes, head_dims, n, m, causal=False, block=None, kernels_wanted="all", batch=1, workers=2,
        precisions=("highest",), mods=None, paged=False, dropout=False):
    """(rows, {(gpu, name expression): SASS}) for every kernel the planner picks, one NVRTC program per source
    string and architecture, compiled in parallel. precisions: those of float32 to plan for (the other dtypes take
    the first). mods: the built-in mods (MODS) the kernels are compiled with, or None. paged: the paged cache's
    forward kernels. dropout: the kernels compiled for attention dropout."""
    picked = [(gpu, dtype, d, kind, plan) for gpu in gpus for dtype in dtypes for d in head_dims
              for precision in (precisions if dtype == "float32" else precisions[:1])
              for kind, plan in plans(gpu, dtype, d, n, m, batch, block, kernels_wanted, precision, mods, paged,
                                      dropout)]
    jobs = {}
    for gpu, _, _, _, plan in picked:
        if not isinstance(plan, str):
            jobs.setdefault((plan.code, DeviceLimits.known(gpu).arch), set()).add(plan.name)
    keys = sorted(jobs)
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(keys)))) as pool:
        built = dict(zip(keys, pool.map(_compile, [(code, sorted(jobs[(code, arch)]), arch)
                                                   for code, arch in keys])))
    rows, sass = [], {}
    for gpu, dtype, d, kind, plan in picked:
        if isinstance(plan, str):
            rows.append({"gpu": gpu, "dtype": dtype, "d": d, "kind": kind, "skipped": plan})
            continue
        compiled = built[(plan.code, DeviceLimits.known(gpu).arch)][plan.name]
        rows.append(report_row(gpu, plan, compiled, causal))
        sass[(gpu, plan.name)] = compiled["sass"]
    return rows, sass


def short_name(name: str) -> str:
    """fwd_mma<128,64,64,64,8,2>: the name expression without the namespace and the element type."""
    template, _, args = name.replace("cuflash::", "").partition("<")
    return f"{template}<{','.join(a.strip() for a in args.rstrip('>').split(',')[1:])}>"


COLUMNS = (("gpu", "<5"), ("dtype", "<8"), ("d", ">4"), ("kernel", "<29"), ("regs", ">4"), ("instr", ">6"),
           ("span", ">6"), ("per mma|fma", ">11"), ("span/op", ">7"), ("ldsm/mma", ">8"), ("lds/fma", ">7"),
           ("cp.async", ">8"), ("mufu", ">4"), ("bar", ">3"), ("br", ">4"), ("local", ">5"), ("bound", "<6"),
           ("TFLOP/s", ">7"))


def block_barriers(row: dict) -> int:
    """BAR instructions on a row's path: the block's barriers (the barrier class also holds cp.async's commits
    and waits, DEPBAR and LDGDEPBAR, which hold up one thread, not the block)."""
    return sum(n for op, n in row["opcodes"].items() if op.split(".")[0] == "BAR")


def table(rows: Sequence[dict]) -> str:
    def line(values):
        return " ".join(format("-" if v is None else v, spec) for v, (_, spec) in zip(values, COLUMNS)).rstrip()

    def fixed(value, digits=2):
        return None if value is None else f"{value:.{digits}f}"

    lines = [line(name for name, _ in COLUMNS)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['gpu']:5} {r['dtype']:8} {r['d']:>4} {r['kind']}: {r['skipped']}")
            continue
        t, tensor = r["per_tile"], r["work"] == "tensor"
        per = f"{r['instructions_per_mma']:.2f} mma" if tensor else f"{r['instructions_per_fma']:.2f} fma"
        span_per = fixed(r["span_per_mma"] if tensor else r["span_per_fma"])
        lines.append(line((r["gpu"], r["dtype"], r["d"], short_name(r["kernel"]), r["usage"]["registers"],
                           t["instructions"], r["span"]["instructions"], per, span_per,
                           fixed(r["ldmatrix_per_mma"]) if tensor else None,
                           None if tensor else fixed(r["shared_loads_per_fma"]), t["cp_async"], t["mufu"],
                           block_barriers(r), t["branch"], t["local"], r.get("bound"), fixed(r.get("tflops"), 1))))
    return "\n".join(lines)


HEADER = """Estimates read statically from SASS, not measurements. Per warp and per key tile (the backward: per swept
tile) of each kernel's steady state: full tiles, no mask or bias, inner loops weighted by their trip counts.
instr: the cheapest path through the key-tile loop (where the steady tiles run: the forward's hot loop, without
the rare rescale around it); span: every instruction compiled inside it (cold paths too); per mma|fma and
span/op: each per tensor-core instruction (HMMA, DMMA) or FMA; bar: block barriers (BAR) on the path.
bound: the resource with the most clocks per tile (issue, tensor, fma, shared, mufu) with one block per SM;
TFLOP/s: the upper bound that gives at the boost clock, from documented per-SM rates (--json has them all)."""

METHOD = {
    "compile": "NVRTC with CuPy's flags (" + " ".join(CUPY_FLAGS) + "); SASS by cuobjdump",
    "loop": "the key-tile loop is the outermost loop (backward branch) holding the most tensor-core (else FMA) "
            "instructions; where several hold as many (a kernel that compiles its steady state's tiles in a loop of "
            "their own), the smallest; and where all of its products and loads sit in one inner loop (the forward's "
            "hot loop, which leaves only to rescale when a row's max grows), that inner loop",
    "path": "the steady state's tile: the cheapest path from the loop's head through its back edge, each inner loop "
            "an iteration's cheapest path times its trip count; it passes every tensor-core instruction and one copy "
            "of every load and CUDA-core product loop, and avoids the other (cold) loops where it can; or, where a "
            "full tile's loads are unrolled and that is cheaper, no inner loop but as many 16-byte loads of its own "
            "as the tile's chunks per thread (loads: \"unrolled\"); branches are taken independently, so it is a "
            "lower bound on a tile's instructions",
    "span": "every instruction compiled inside the loop, inner loops weighted by their trip counts (1 where unknown); "
            "FlashAttention-2's loop is branch-free, so its own count is both",
    "trip_counts": "a step's work per thread (16-byte chunks, elements, rows, FMAs: from the template arguments) "
                   "over the work one compiled iteration does (read from its SASS); weighted 1 where unknown",
    "bound": "clocks per tile for an SM busy with one block: issue (4 warp instructions per clock), tensor (mma.sync "
             "FLOPs), fma (FP32/FP64 lanes), shared (128 bytes per clock, broadcasts not credited), mufu (16 lanes "
             "per clock); latency, stalls, occupancy, caches and DRAM are not modelled",
    "flops": "per tile: forward 4 Br Bc d; dq 6 Br Bc d (S, dP, dQ); dkdv 8 Br Bc d (S, dP, dV, dK)",
    "keep_bits": "kernels compiled for dropout: the loop that makes a tile's keep bits (kernels/tile.cuh "
                 "KeepTile::fill, one byte of two Philox calls per iteration) weighted by its trip count, Br Bc / 8 "
                 "bytes over the block's threads, and counted once per tile on the path (the steady state makes the "
                 "next tile's every tile); the loop of a group past a tile's keys (keys off a group) is cold",
}


def parse_block(text: str):
    """--block: "mma", "fma" or BrxBc."""
    if text in ("mma", "fma"):
        return text
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"takes mma, fma or BrxBc (128x64), not {text!r}")
    return int(match.group(1)), int(match.group(2))


def sass_file_name(gpu: str, name: str) -> str:
    return f"{gpu}-" + re.sub(r"[^A-Za-z0-9]+", "_", name.replace("cuflash::", "")).strip("_") + ".sass"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sass_report", description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="append", choices=sorted(RATES), help="default: H100 and A100")
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES), help="default: float16, bfloat16, float32")
    parser.add_argument("--d", action="append", type=int, help="head dim (d = e; default 64 and 128)")
    parser.add_argument("--n", type=int, default=16384, help="queries (default 16384)")
    parser.add_argument("--m", type=int, default=16384, help="keys (default 16384)")
    parser.add_argument("--batch", type=int, default=1, help="batch x heads: the planner splits the keys when the "
                                                             "query tiles are too few to fill the GPU (default 1)")
    parser.add_argument("--causal", action="store_true", help="also give the share of tiles on the diagonal")
    parser.add_argument("--block", type=parse_block, help="force the kernels: mma, fma or BrxBc")
    parser.add_argument("--kernels", choices=("all", "forward", "backward"), default="all")
    parser.add_argument("--json", help="write every count and assumption to this file")
    parser.add_argument("--sass-dir", help="write each kernel's SASS to its own file in this folder")
    parser.add_argument("--precision", action="append", choices=("highest", "tf32", "fma"),
                        help="float32's precision= (default highest); several give a row each")
    parser.add_argument("--tiny", action="store_true", help="CI mode: the float16 forward at d = 64 on an H100")
    parser.add_argument("--mods", choices=sorted(MODS), help="compile the kernels with a built-in mod: their hot "
                                                             "loop then has no plain tiles (every tile is partial)")
    parser.add_argument("--paged", action="store_true", help="the forward kernels that read a paged KV cache "
                                                                "(attention_paged), walking each row's page")
    parser.add_argument("--dropout", action="store_true", help="the kernels compiled for attention dropout "
                                                                  "(dropout_p > 0), which regenerate the keep bits")
    args = parser.parse_args(argv)
    if cuobjdump() is None or not nvrtc_available():
        print("sass_report: needs NVRTC, cuobjdump and nvdisasm: pip install nvidia-cuda-nvrtc-cu12 "
              "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm", file=sys.stderr)
        return 2
    if args.tiny:
        gpus, dtypes, dims, wanted = ["H100"], ["float16"], [64], "forward"
    else:
        gpus, dtypes = args.gpu or ["H100", "A100"], args.dtype or ["float16", "bfloat16", "float32"]
        dims, wanted = args.d or [64, 128], args.kernels
    rows, sass = run(gpus, dtypes, dims, args.n, args.m, args.causal, args.block, wanted, args.batch,
                     precisions=tuple(args.precision or ["highest"]), mods=args.mods, paged=args.paged,
                     dropout=args.dropout)
    print(HEADER)
    print(f"n = {args.n}, m = {args.m}, batch x heads = {args.batch}{', causal' if args.causal else ''}"
          f"{', paged keys and values (kernels that walk the pages)' if args.paged else ''}"
          f"{', attention dropout (kernels that regenerate the keep bits)' if args.dropout else ''}\n")
    print(table(rows))
    for r in rows:
        for note in r.get("notes", []):
            print(f"note: {r['gpu']} {short_name(r['kernel'])}: {note}")
        if args.causal and r.get("partial_tiles") is not None:
            print(f"causal: {r['gpu']} {short_name(r['kernel'])}: {100 * r['partial_tiles']:.1f}% of its tiles "
                  f"straddle the diagonal and take the per-element path, not counted above")
    if args.json:
        command = "python -m bench.sass_report " + " ".join(sys.argv[1:] if argv is None else argv)
        document = {"schema": SCHEMA, "command": command.strip(), "estimates": HEADER, "method": METHOD,
                    "rates": {gpu: vars(rates) for gpu, rates in RATES.items()}, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
    if args.sass_dir:
        os.makedirs(args.sass_dir, exist_ok=True)
        for (gpu, name), text in sass.items():
            with open(os.path.join(args.sass_dir, sass_file_name(gpu, name)), "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
