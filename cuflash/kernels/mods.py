"""A traced score_mod and mask_mod as CUDA (mods.cuh): the struct of device functions Scores calls, and the tables
the kernels read them with.

Each node of the expression becomes one `const` local of its kind's C type (float: the accumulator type A, int:
long long, bool), in the order the numpy backend evaluates them, so the generated function reads as the
expression does. A kernel compiled with mods is cached by KernelMods.key: the expressions and their tables' dtypes
and ranks, never their lengths, contents or the problem's sizes, which reach the kernel at each launch (Args).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

MAX_TABLES, MAX_TABLE_AXES, MAX_BATCH_AXES = 8, 4, 6  # kMaxTables, kMaxTableAxes, kMaxBatchAxes in mods.cuh
STRUCT = "GeneratedMods"
TYPES = {"float": "A", "int": "long long", "bool": "bool"}
ELEMENT_TYPES = {"b1": "bool", "i1": "signed char", "i2": "short", "i4": "int", "i8": "long long",
                 "u1": "unsigned char", "u2": "unsigned short", "u4": "unsigned int", "u8": "unsigned long long",
                 "f2": "__half", "f4": "float", "f8": "double", "bfloat16": "__nv_bfloat16"}

# The layout of Args (mods.cuh), for launch.PARAMS; tests/test_layout.py holds them together.
TABLE = np.dtype([("data", np.uint64), ("shape", np.int64, (MAX_TABLE_AXES,)),
                  ("stride", np.int64, (MAX_TABLE_AXES,))], align=True)
VISITS = np.dtype([("count", np.uint64), ("list", np.uint64), ("entry_stride", np.int64, (MAX_BATCH_AXES,)),
                   ("owned", np.int64), ("width", np.int64)], align=True)
ARGS = np.dtype([("table", TABLE, (MAX_TABLES,)), ("batch", np.int64, (MAX_BATCH_AXES,)), ("sinks", np.uint64),
                 ("error", np.uint64), ("visits", VISITS)], align=True)


@dataclass(frozen=True)
class KernelMods:
    """What a kernel compiled with mods adds to its source (source: ahead of the kernels), what it is cached by
    (key), the arrays it reads (score_mod's tables, then mask_mod's) and, for each table, its mod and number there
    (for an error's message)."""

    source: str
    key: str
    arrays: Tuple[Any, ...]
    owners: Tuple[Tuple[str, int], ...]


def element_type(array) -> str:
    """The C type of a captured array's elements (NumPy, CuPy or torch)."""
    text = str(array.dtype)
    if "bfloat16" in text:
        return ELEMENT_TYPES["bfloat16"]
    if text.startswith("torch."):
        import torch
        code = torch.empty(0, dtype=array.dtype).numpy().dtype
    else:
        code = np.dtype(array.dtype)
    name = ELEMENT_TYPES.get(f"{code.kind}{code.itemsize}")
    if name is None:
        raise TypeError(f"mods: a table of dtype {array.dtype} cannot be read by a kernel")
    return name


def unsupported(score, mask, nbatch: int) -> Optional[str]:
    """Why these traced mods cannot be compiled into the kernels (the backends then run the blocked algorithm),
    or None."""
    arrays = (score.arrays if score else ()) + (mask.arrays if mask else ())
    if nbatch > MAX_BATCH_AXES:
        return f"the batch has {nbatch} axes (the kernels' mods take at most {MAX_BATCH_AXES})"
    if len(arrays) > MAX_TABLES:
        return f"the mods close over {len(arrays)} arrays (the kernels take at most {MAX_TABLES})"
    if any(len(a.shape) > MAX_TABLE_AXES for a in arrays):
        return f"a captured array has more than {MAX_TABLE_AXES} axes"
    return None


def kernel_mods(score, mask, nbatch: int, sinks: bool = False, tables=None, blocks: bool = False) -> KernelMods:
    """The CUDA of a traced score_mod and mask_mod (mods.Traced; either may be None) over nbatch batch axes,
    whether the forward's rows start from sinks, and whether blocks visit only a block mask's tiles (blocks).
    tables: the arrays the kernel reads (score_mod's, then mask_mod's: their element types are the CUDA's), by
    default the traced ones."""
    def flag(x) -> str:
        return "true" if x else "false"
    lines = ["// The mods of this kernel, written by cuflash/kernels/mods.py from their traced expressions.",
             "namespace cuflash {", "namespace mods {", "",
             f"struct {STRUCT} : NoMods {{  // NoMods: what it does not define",
             f"    static constexpr bool kScore = {flag(score)}, kMask = {flag(mask)}, kSinks = {flag(sinks)}, "
             f"kBlocks = {flag(blocks)};",
             f"    static constexpr int kBatchAxes = {nbatch};"]
    keys, arrays, owners = [], [], []
    tables = tuple((score.arrays if score else ()) + (mask.arrays if mask else ())) if tables is None else tables
    if score is not None:
        lines += ["", f"    // score_mod: {score.expr.text}"]
        own = tables[:len(score.arrays)]
        lines += function("score", "A", score.program(), nbatch, own, 0)
        lines += ["", "    // d score_mod / d score, the backward's slope"]
        lines += function("slope", "A", score.program(slope=True), nbatch, own, 0)
        keys.append(key_of("score_mod", score.expr, own))
        arrays += list(own)
        owners += [("score_mod", t) for t in range(len(score.arrays))]
    if mask is not None:
        lines += ["", f"    // mask_mod: {mask.expr.text}"]
        own = tables[len(arrays):]
        lines += function("mask", "bool", mask.program(), nbatch, own, len(arrays))
        keys.append(key_of("mask_mod", mask.expr, own))
        arrays += list(own)
        owners += [("mask_mod", t) for t in range(len(mask.arrays))]
    lines += ["};", "", "}  // namespace mods", "}  // namespace cuflash", f"#define CUFLASH_MODS {STRUCT}", ""]
    key = "; ".join([f"batch axes {nbatch}"] + keys + (["sinks"] if sinks else []) + (["blocks"] if blocks else []))
    return KernelMods("\n".join(lines), key, tuple(arrays), tuple(owners))


def key_of(name: str, expr, arrays) -> str:
    tables = ", ".join(f"table{t}: {element_type(a)}[{len(a.shape)}]" for t, a in enumerate(arrays))
    return f"{name}({expr.text}; {tables})"


def function(name: str, result: str, program, nbatch: int, arrays, first_table: int) -> List[str]:
    """One static device function of the struct: (score,) the batch item's indices b, the query row i, the key j
    and the tables, computing the program's nodes (Traced.program) in order. first_table: the number of the mod's
    table 0 among the kernel's."""
    params = ("A score, " if name != "mask" else "") + "const long long* b, long long i, long long j, const Args& args"
    lines = ["    template <typename A>",
             f"    __device__ __forceinline__ static {result} {name}({params}) {{"]
    names: Dict[int, str] = {}
    body: List[str] = []
    for x in program:
        if x.op == "index":
            names[id(x)] = f"b[{x.value}]" if x.value < nbatch else ("i" if x.value == nbatch else "j")
            continue
        if x.op == "score":
            names[id(x)] = "score"
            continue
        if x.op == "const":
            names[id(x)] = literal(x)
            continue
        local = f"v{len(body)}"
        args = [names[id(a)] for a in x.args]
        if x.op == "table":
            t = first_table + x.value
            axes = len(x.args)
            index = ", ".join(args) if args else "0"
            element = element_type(arrays[x.value])
            body.append(f"const long long {local}_at[{max(axes, 1)}] = {{{index}}};")
            body.append(f"const {TYPES[x.kind]} {local} = read<{TYPES[x.kind]}, {element}, {axes}>(args, {t}, "
                        f"{local}_at);")
        else:
            body.append(f"const {TYPES[x.kind]} {local} = {operation(x, args)};")
        names[id(x)] = local
    lines += [f"        {line}" for line in body]
    lines += [f"        return {names[id(program[-1])]};", "    }"]
    return lines


def literal(x) -> str:
    if x.kind == "bool":
        return "true" if x.value else "false"
    if x.kind == "int":
        return "(-9223372036854775807LL - 1)" if x.value == -2**63 else f"{x.value}LL"
    value = float(x.value)
    if value != value:
        return "not_a_number<A>()"
    if value in (float("inf"), float("-inf")):
        return ("-" if value < 0 else "") + "infinity_<A>()"
    return f"A({value.hex()})"


# How each operation is written, by kind of result: {a}, {b}, {c} are its arguments.
FLOAT = {
    "negative": "(-{a})", "absolute": "fabs_({a})", "sign": "sign({a})", "square": "({a} * {a})",
    "exp": "exp_({a})", "exp2": "exp2_({a})", "expm1": "expm1_({a})", "log": "log_({a})", "log2": "log2_({a})",
    "log1p": "log1p_({a})", "sqrt": "sqrt_({a})", "tanh": "tanh_({a})", "sin": "sin_({a})", "cos": "cos_({a})",
    "floor": "floor_({a})", "ceil": "ceil_({a})", "trunc": "trunc_({a})", "reciprocal": "(A(1) / {a})",
    "add": "({a} + {b})", "subtract": "({a} - {b})", "multiply": "({a} * {b})", "true_divide": "({a} / {b})",
    "floor_divide": "float_floor_divide({a}, {b})", "remainder": "float_remainder({a}, {b})",
    "power": "pow_({a}, {b})", "minimum": "minimum({a}, {b})", "maximum": "maximum({a}, {b})",
}
INT = {
    "negative": "negative({a})", "absolute": "absolute({a})", "sign": "sign({a})", "square": "multiply({a}, {a})",
    "invert": "(~{a})", "add": "add({a}, {b})", "subtract": "subtract({a}, {b})", "multiply": "multiply({a}, {b})",
    "floor_divide": "floor_divide({a}, {b})", "remainder": "remainder({a}, {b})", "power": "power({a}, {b})",
    "minimum": "minimum({a}, {b})", "maximum": "maximum({a}, {b})", "bitwise_and": "({a} & {b})",
    "bitwise_or": "({a} | {b})", "bitwise_xor": "({a} ^ {b})",
}
BOOL = {
    "logical_not": "(!{a})", "bitwise_and": "({a} && {b})", "bitwise_or": "({a} || {b})",
    "bitwise_xor": "({a} != {b})", "less": "({a} < {b})", "less_equal": "({a} <= {b})", "greater": "({a} > {b})",
    "greater_equal": "({a} >= {b})", "equal": "({a} == {b})", "not_equal": "({a} != {b})",
}


def operation(x, args: List[str]) -> str:
    if x.op == "where":
        return "({} ? {} : {})".format(*args)
    if x.op == "cast":
        (a,) = args
        source = x.args[0].kind
        if x.kind == "bool":
            return f"({a} != 0)"
        if x.kind == "int":
            return f"to_int({a})" if source == "float" else f"(long long)({a})"
        return f"A({a})"
    table = {"float": FLOAT, "int": INT, "bool": BOOL}[x.kind]
    form = table.get(x.op)
    if form is None:
        raise NotImplementedError(f"mods: no CUDA for {x.op} of kind {x.kind}")
    return form.format(**dict(zip("abc", args)))
