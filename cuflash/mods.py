"""Attention patterns as functions of indices: score_mod and mask_mod, traced once into an expression.

A mod is an ordinary Python function of one integer index per batch axis, the query row i and the key j;
score_mod takes the score first (the scaled score after bias=, in the accumulation type) and returns a new one,
mask_mod returns whether the key is seen. cuflash calls it once with symbolic arguments (Expr), which record
what it does: Python's arithmetic, comparison and bitwise operators, Python numbers, NumPy ufuncs, np.where,
np.clip, .astype, and the indexing of arrays it closes over (closure variables, default arguments and global
names: they become the expression's tables). The expression is what every backend runs: the numpy backend
evaluates it on each tile's index grids (evaluate), and its derivative with respect to the score (derivative)
takes the backward through score_mod.

Numbers are constants of the expression; arrays are read at each call, so new contents never change it. Integers
compute in int64 and floats in the accumulation type (a float table is read in it too); an index must lie inside
its table's axis (negative indices do not wrap): one outside is an IndexError.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
import numbers
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

KINDS = ("bool", "int", "float")
_IF_HINT = ("Python's if, and, or, not, min() and max() need True or False while the function is traced, but this "
            "is an expression of the indices; use np.where(c, a, b) for if, & | ~ for and, or, not, and "
            "np.minimum / np.maximum")


class TraceError(TypeError):
    """A mod does something that cannot be traced into an expression (the message names it and the fix).

    A ``TypeError``: Python's ``if``, ``and``, ``or``, ``not``, ``min``, ``max`` on an index ("use np.where or
    & | ~"), an unsupported call (``np.sort``), a float index, an array made inside the function.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> q = k = v = np.ones((1, 8, 4))
    >>> def branching(b, i, j):
    ...     return True if i >= j else False
    >>> try:
    ...     cuflash.attention(q, k, v, mask_mod=branching)
    ... except cuflash.mods.TraceError as error:
    ...     print(type(error).__name__, isinstance(error, TypeError))
    TraceError True
    """


# ----------------------------------------------------------------------------------------------------------------
# The expression


class Expr:
    """One node of a traced mod: op (score, index, const, table, a unary, binary or ternary operator, cast), its
    arguments, its kind (bool, int or float) and, for leaves, a value (the index's position, the constant, the
    table's number). Operators on it build larger expressions."""

    __slots__ = ("op", "args", "kind", "value", "_text")
    __array_ufunc__: Any  # set below: NumPy ufuncs applied to an Expr build one
    __hash__ = object.__hash__

    def __init__(self, op: str, args: Tuple["Expr", ...], kind: str, value: Any = None):
        self.op, self.args, self.kind, self.value = op, args, kind, value
        self._text: Optional[str] = None

    @property
    def text(self) -> str:
        """The canonical text of the expression (what a compiled kernel is cached by)."""
        if self._text is None:
            if self.op == "const":
                self._text = repr(self.value) if self.kind != "float" else float(self.value).hex()
            elif self.op == "index":
                self._text = f"idx{self.value}"
            elif self.op == "score":
                self._text = "score"
            elif self.op == "table":
                self._text = f"table{self.value}[{', '.join(a.text for a in self.args)}]"
            else:
                self._text = f"{self.op}({', '.join(a.text for a in self.args)})"
        return self._text

    def __repr__(self) -> str:
        return f"Expr({self.text}: {self.kind})"

    # Python's operators
    def __add__(self, other): return binary("add", self, other)
    def __radd__(self, other): return binary("add", other, self)
    def __sub__(self, other): return binary("subtract", self, other)
    def __rsub__(self, other): return binary("subtract", other, self)
    def __mul__(self, other): return binary("multiply", self, other)
    def __rmul__(self, other): return binary("multiply", other, self)
    def __truediv__(self, other): return binary("true_divide", self, other)
    def __rtruediv__(self, other): return binary("true_divide", other, self)
    def __floordiv__(self, other): return binary("floor_divide", self, other)
    def __rfloordiv__(self, other): return binary("floor_divide", other, self)
    def __mod__(self, other): return binary("remainder", self, other)
    def __rmod__(self, other): return binary("remainder", other, self)
    def __pow__(self, other): return binary("power", self, other)
    def __rpow__(self, other): return binary("power", other, self)
    def __lt__(self, other): return binary("less", self, other)
    def __le__(self, other): return binary("less_equal", self, other)
    def __gt__(self, other): return binary("greater", self, other)
    def __ge__(self, other): return binary("greater_equal", self, other)
    def __eq__(self, other): return binary("equal", self, other)  # type: ignore[override]
    def __ne__(self, other): return binary("not_equal", self, other)  # type: ignore[override]
    def __and__(self, other): return binary("bitwise_and", self, other)
    def __rand__(self, other): return binary("bitwise_and", other, self)
    def __or__(self, other): return binary("bitwise_or", self, other)
    def __ror__(self, other): return binary("bitwise_or", other, self)
    def __xor__(self, other): return binary("bitwise_xor", self, other)
    def __rxor__(self, other): return binary("bitwise_xor", other, self)
    def __neg__(self): return unary("negative", self)
    def __pos__(self): return self
    def __abs__(self): return unary("absolute", self)
    def __invert__(self): return unary("invert", self)

    # torch's spellings (a mod written for torch.nn.attention.flex_attention traces unchanged)
    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        return _torch_call(func, args, kwargs or {})

    def abs(self): return unary("absolute", self)
    def exp(self): return unary("exp", self)
    def log(self): return unary("log", self)
    def sqrt(self): return unary("sqrt", self)
    def tanh(self): return unary("tanh", self)
    def float(self): return cast(self, "float")
    def double(self): return cast(self, "float")
    def long(self): return cast(self, "int")
    def int(self): return cast(self, "int")
    def bool(self): return cast(self, "bool")
    def clamp(self, min=None, max=None): return clip(self, min, max)  # noqa: A002 (torch's names)
    def type(self, dtype): return self.astype(dtype)
    device = None  # an expression lives wherever the call runs: .to(x.device) keeps it as it is

    def to(self, *args, **kwargs):
        """.to(dtype) casts; .to(device) (or None, an Expr's device) is the expression itself."""
        dtype = kwargs.get("dtype", next((a for a in args if kind_of_dtype_or_none(a)), None))
        return self if dtype is None else self.astype(dtype)

    def new_ones(self, shape=(), dtype=None, **kwargs):  # a number: torch's mask functions start from one
        return cast(const(1), kind_of_dtype_or_none(dtype) or self.kind)

    def new_zeros(self, shape=(), dtype=None, **kwargs):
        return cast(const(0), kind_of_dtype_or_none(dtype) or self.kind)

    def astype(self, dtype, copy=True) -> "Expr":  # noqa: ARG002 (NumPy's signature)
        """The value as dtype's kind: an integer type computes in int64, a floating type in the accumulation
        type, bool is `!= 0`."""
        kind = kind_of_dtype(dtype)
        if kind is None:
            raise TraceError(f"mods: .astype({dtype!r}) is not supported; use bool, an integer or a float type")
        return cast(self, kind)

    def __bool__(self):
        raise TraceError(f"mods: {_IF_HINT} (expression: {self.text})")

    def __index__(self):
        raise TraceError(f"mods: {self.text} is an expression of the indices, not a Python int: index only arrays "
                         f"the function closes over (a closure variable, default argument or global name) with it")

    def __int__(self):
        raise TraceError(f"mods: int() of {self.text}: use .astype(int)")

    def __float__(self):
        raise TraceError(f"mods: float() of {self.text} (math functions take numbers): use the NumPy ufunc (np.exp, "
                         f"np.log, ...) or .astype(float)")

    def __iter__(self):
        raise TraceError(f"mods: {self.text} is one number per (query, key) pair, not a sequence")

    def __array__(self, *args, **kwargs):
        raise TraceError(f"mods: {self.text} cannot become an array: index only arrays the function closes over "
                         f"(they are traced); an array made inside the function is not")

    def __array_function__(self, func, types_, args, kwargs):
        handler = _ARRAY_FUNCTIONS.get(func)
        if handler is None:
            raise TraceError(f"mods: np.{func.__name__} is not supported in a mod; use arithmetic, NumPy ufuncs, "
                             f"np.where or np.clip")
        return handler(*args, **kwargs)


def _array_ufunc(self, ufunc, method, *inputs, **kwargs):
    if method != "__call__" or kwargs:
        raise TraceError(f"mods: np.{ufunc.__name__}.{method} or its keywords are not supported; call the ufunc "
                         f"on its inputs alone")
    name = _UFUNC_ALIASES.get(ufunc.__name__, ufunc.__name__)
    if len(inputs) == 1 and name in UNARY:
        return unary(name, inputs[0])
    if len(inputs) == 2 and name in BINARY:
        return binary(name, *inputs)
    raise TraceError(f"mods: np.{ufunc.__name__} is not supported in a mod; supported: "
                     f"{', '.join(sorted(UNARY | BINARY))}")


Expr.__array_ufunc__ = _array_ufunc

# Operators by NumPy's ufunc names: what each computes on which kinds.
UNARY = frozenset({"negative", "absolute", "invert", "logical_not", "sign", "square", "exp", "exp2", "expm1",
                   "log", "log2", "log1p", "sqrt", "tanh", "sin", "cos", "floor", "ceil", "trunc", "reciprocal"})
FLOAT_UNARY = frozenset({"exp", "exp2", "expm1", "log", "log2", "log1p", "sqrt", "tanh", "sin", "cos", "floor",
                         "ceil", "trunc", "reciprocal"})
ARITHMETIC = frozenset({"add", "subtract", "multiply", "true_divide", "floor_divide", "remainder", "power",
                        "minimum", "maximum"})
COMPARISON = frozenset({"less", "less_equal", "greater", "greater_equal", "equal", "not_equal"})
BITWISE = frozenset({"bitwise_and", "bitwise_or", "bitwise_xor", "logical_and", "logical_or", "logical_xor"})
BINARY = ARITHMETIC | COMPARISON | BITWISE
_UFUNC_ALIASES = {"divide": "true_divide", "abs": "absolute", "fmin": "minimum", "fmax": "maximum",
                  "mod": "remainder"}


_TORCH_NAMES = {"neg": "negative", "abs": "absolute", "sub": "subtract", "mul": "multiply", "div": "true_divide",
                "true_divide": "true_divide", "fmod": "remainder", "pow": "power", "fmin": "minimum",
                "fmax": "maximum", "eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal",
                "gt": "greater", "ge": "greater_equal", "bitwise_not": "invert", "rsqrt": None}


def _torch_call(func, args, kwargs):
    """A torch function or Tensor method applied to Exprs, as the NumPy ufunc of the same meaning."""
    name = getattr(func, "__name__", str(func)).strip("_")
    name = {"radd": "add", "rsub": "rsub", "rmul": "multiply", "rtruediv": "rtruediv", "and": "bitwise_and",
            "or": "bitwise_or", "xor": "bitwise_xor", "invert": "invert", "truediv": "true_divide",
            "floordiv": "floor_divide", "mod": "remainder"}.get(name, name)
    if name == "rsub":
        return binary("subtract", args[1], args[0])
    if name == "rtruediv":
        return binary("true_divide", args[1], args[0])
    if name == "where" and len(args) == 3:
        return where(*args)
    if name in ("clamp", "clip"):
        return clip(args[0], kwargs.get("min", args[1] if len(args) > 1 else None),
                    kwargs.get("max", args[2] if len(args) > 2 else None))
    if name in ("sigmoid",):
        return binary("true_divide", 1.0, binary("add", 1.0, unary("exp", unary("negative", args[0]))))
    if name in ("to", "type", "float", "long", "int", "double", "bool"):
        return getattr(const(args[0]), name)(*args[1:])
    name = _TORCH_NAMES.get(name, name)
    if kwargs:
        raise TraceError(f"mods: torch.{name} with keywords {sorted(kwargs)} is not supported in a mod")
    if name in UNARY and len(args) == 1:
        return unary(name, args[0])
    if name in BINARY and len(args) == 2:
        return binary(name, *args)
    raise TraceError(f"mods: torch.{getattr(func, '__name__', func)} is not supported in a mod; use arithmetic, "
                     f"torch.where, torch.clamp or the elementwise functions")


def kind_of_dtype_or_none(x) -> Optional[str]:
    """The kind of x when x is a dtype (NumPy's or torch's), else None (a device, a string naming one)."""
    if x is None or isinstance(x, str) or type(x).__name__ == "device":
        return None
    try:
        return kind_of_dtype(x)
    except Exception:  # not a dtype at all
        return None


def kind_of_dtype(dtype) -> Optional[str]:
    try:
        char = np.dtype(dtype).kind
    except TypeError:
        char = getattr(dtype, "kind", None)
        if char is None:  # a torch dtype
            text = str(dtype)
            char = "b" if "bool" in text else "i" if "int" in text else "f" if "float" in text else None
    return {"b": "bool", "i": "int", "u": "int", "f": "float"}.get(char or "")


def const(x) -> Expr:
    """A Python or NumPy number (or a 0-d array of one) as a constant of the expression."""
    if isinstance(x, Expr):
        return x
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "biuf":
        x = x[()]  # a number NumPy computed while tracing (np.abs(3)), not a captured array: those are Tables
    elif type(x).__module__.startswith("torch") and getattr(x, "ndim", None) == 0:
        x = x.item()  # likewise a 0-d tensor made while tracing
    if isinstance(x, (bool, np.bool_)):
        return Expr("const", (), "bool", bool(x))
    if isinstance(x, (numbers.Integral, np.integer)):
        value = int(x)
        if not -2**63 <= value < 2**63:
            raise TraceError(f"mods: the integer {value} does not fit in int64")
        return Expr("const", (), "int", value)
    if isinstance(x, (numbers.Real, np.floating)):
        return Expr("const", (), "float", float(x))
    if isinstance(x, Table):
        return x.value()
    raise TraceError(f"mods: {type(x).__name__} {x!r:.60} cannot enter a mod; use Python numbers, or index a "
                     f"captured array")


def promote(*kinds: str) -> str:
    """The kind arithmetic gives: float if any float, else int (bools count as ints)."""
    return "float" if "float" in kinds else "int"


def unary(op: str, x) -> Expr:
    x = const(x)
    if op == "invert" and x.kind == "bool":
        op = "logical_not"
    if op == "logical_not":
        return Expr(op, (cast(x, "bool"),), "bool")
    if op == "invert" and x.kind == "float":
        raise TraceError(f"mods: ~ on the float {x.text}; ~ negates a bool (a comparison) or an integer's bits")
    if op in FLOAT_UNARY:
        return Expr(op, (cast(x, "float"),), "float")
    x = cast(x, promote(x.kind))  # negative, absolute, sign, square of a bool: of the int
    return Expr(op, (x,), x.kind)


def binary(op: str, a, b) -> Expr:
    a, b = const(a), const(b)
    if op in COMPARISON:
        kind = "bool" if a.kind == b.kind == "bool" else promote(a.kind, b.kind)
        return Expr(op, (cast(a, kind), cast(b, kind)), "bool")
    if op in BITWISE:
        if op.startswith("logical_"):  # np.logical_and and friends: of the truth values
            a, b, op = cast(a, "bool"), cast(b, "bool"), op.replace("logical_", "bitwise_")
        if "float" in (a.kind, b.kind):
            raise TraceError(f"mods: {op.replace('bitwise_', '')} (& | ^) of a float ({a.text}, {b.text}); they "
                             f"combine bools (comparisons) or integers")
        kind = "bool" if a.kind == b.kind == "bool" else "int"
        return Expr(op, (cast(a, kind), cast(b, kind)), kind)
    kind = "float" if op == "true_divide" else promote(a.kind, b.kind)
    return Expr(op, (cast(a, kind), cast(b, kind)), kind)


def cast(x: Expr, kind: str) -> Expr:
    if x.kind == kind:
        return x
    if x.op == "const":
        value = {"bool": bool, "int": int, "float": float}[kind](x.value)
        return Expr("const", (), kind, value)
    return Expr("cast", (x,), kind)


def where(condition, a, b) -> Expr:
    condition, a, b = const(condition), const(a), const(b)
    if condition.kind != "bool":
        condition = binary("not_equal", condition, 0)
    kind = "bool" if a.kind == b.kind == "bool" else promote(a.kind, b.kind)
    return Expr("where", (condition, cast(a, kind), cast(b, kind)), kind)


def clip(x, a_min, a_max, out=None, **kwargs) -> Expr:
    if out is not None or kwargs:
        raise TraceError("mods: np.clip takes no out= or keywords in a mod")
    result = const(x)
    if a_min is not None:
        result = binary("maximum", result, a_min)
    if a_max is not None:
        result = binary("minimum", result, a_max)
    return result


def _where(condition, x=None, y=None):
    if x is None or y is None:
        raise TraceError("mods: np.where(condition) alone gives indices; a mod takes np.where(condition, x, y)")
    return where(condition, x, y)


_ARRAY_FUNCTIONS: Dict[Any, Callable[..., Expr]] = {np.where: _where, np.clip: clip}


# ----------------------------------------------------------------------------------------------------------------
# Captured arrays


class Table:
    """An array a mod closes over, as the tracer hands it to the function: indexing it with one integer
    expression per axis reads an element (an Expr); its shape, ndim and dtype are the array's."""

    def __init__(self, number: int, array: Any, name: str):
        self.number, self.array, self.name = number, array, name
        self.shape = tuple(int(s) for s in array.shape)
        self.ndim = len(self.shape)
        self.dtype = array.dtype
        kind = kind_of_dtype(array.dtype)
        if kind is None:
            raise TraceError(f"mods: the captured array {name} has dtype {array.dtype}; a mod reads bool, integer or "
                             f"real floating arrays")
        self.kind: str = kind

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __getitem__(self, key) -> Expr:
        key = key if isinstance(key, tuple) else (key,)
        if len(key) != self.ndim:
            raise TraceError(f"mods: {self.name} has {self.ndim} axes (shape {self.shape}) but was indexed with "
                             f"{len(key)}; index it with one integer expression per axis")
        parts = []
        for axis, k in enumerate(key):
            if isinstance(k, (slice, type(Ellipsis))) or k is None:
                raise TraceError(f"mods: {self.name}[...] with a slice, ... or None on axis {axis}: a mod reads one "
                                 f"element per (query, key) pair; give one integer expression per axis")
            k = const(k)
            if k.kind != "int":
                raise TraceError(f"mods: {self.name} indexed on axis {axis} with the {k.kind} {k.text}: an index "
                                 f"must be an integer (use .astype(int), or np.where for a bool)")
            parts.append(k)
        return Expr("table", tuple(parts), self.kind, self.number)

    def value(self) -> Expr:
        if self.ndim:
            raise TraceError(f"mods: {self.name} (shape {self.shape}) used whole; index it with one integer "
                             f"expression per axis")
        return Expr("table", (), self.kind, self.number)

    # A 0-d array takes part in arithmetic as its value.
    def __add__(self, o): return self.value() + o
    def __radd__(self, o): return o + self.value()
    def __sub__(self, o): return self.value() - o
    def __rsub__(self, o): return o - self.value()
    def __mul__(self, o): return self.value() * o
    def __rmul__(self, o): return o * self.value()
    def __truediv__(self, o): return self.value() / o
    def __rtruediv__(self, o): return o / self.value()
    def __neg__(self): return -self.value()

    def __array__(self, *args, **kwargs):
        raise TraceError(f"mods: {self.name} used as a whole array; a mod reads one element per (query, key) pair "
                         f"by indexing it")


def is_array(x) -> bool:
    """A NumPy, CuPy or torch array (anything with a tuple shape and a dtype; NumPy's scalars are numbers)."""
    return isinstance(getattr(x, "shape", None), tuple) and hasattr(x, "dtype") and \
        not isinstance(x, (np.generic, Table, Expr, type, types.ModuleType))


class _Capture:
    """The tables of one trace: each captured array once, by identity, in the order the function reaches them."""

    def __init__(self):
        self.tables: List[Table] = []
        self._by_id: Dict[int, Table] = {}
        self._functions: Dict[int, Any] = {}

    def wrap(self, value, name: str):
        if isinstance(value, (tuple, list)):  # and_masks' parts, or a tuple of tables
            return type(value)(self.wrap(x, name) for x in value)
        if is_array(value):
            table = self._by_id.get(id(value))
            if table is None:
                table = Table(len(self.tables), value, name)
                self.tables.append(table)
                self._by_id[id(value)] = table
            return table
        if isinstance(value, types.FunctionType):
            return self.rebind(value)
        return value

    def rebind(self, fn):
        """fn with the arrays its closure, defaults and global names hold replaced by Tables (functions it holds
        likewise: and_masks' parts)."""
        if id(fn) in self._functions:
            return self._functions[id(fn)]
        self._functions[id(fn)] = fn  # a function that names itself reaches itself: left as it is
        code = fn.__code__
        cells = None
        if fn.__closure__:
            cells = tuple(types.CellType(self.wrap(_contents(c), name)) if _filled(c) else c
                          for c, name in zip(fn.__closure__, code.co_freevars))
        names = _global_names(code)
        fn_globals = fn.__globals__
        if any(is_array(fn_globals.get(name)) or isinstance(fn_globals.get(name), types.FunctionType)
               for name in names):
            fn_globals = dict(fn_globals)
            for name in names:
                if name in fn_globals:
                    fn_globals[name] = self.wrap(fn_globals[name], name)
        defaults = fn.__defaults__ and tuple(self.wrap(x, "a default argument") for x in fn.__defaults__)
        new = types.FunctionType(code, fn_globals, fn.__name__, defaults, cells)
        new.__kwdefaults__ = fn.__kwdefaults__
        self._functions[id(fn)] = new
        return new


def captured(fn) -> List[Tuple[str, Any]]:
    """(name, value) of what a function closes over: closure cells, defaults and the global names it reads (and
    what the functions among them close over)."""
    found: List[Tuple[str, Any]] = []
    seen: set = set()

    def visit(f):
        if not isinstance(f, types.FunctionType) or id(f) in seen:
            return
        seen.add(id(f))
        values = [(name, _contents(c)) for name, c in zip(f.__code__.co_freevars, f.__closure__ or ()) if _filled(c)]
        values += [("a default argument", x) for x in f.__defaults__ or ()]
        values += [(name, f.__globals__[name]) for name in _global_names(f.__code__) if name in f.__globals__]
        for name, value in values:
            for x in value if isinstance(value, (tuple, list)) else (value,):
                found.append((name, x))
                visit(x)
    visit(fn)
    return found


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _contents(cell):
    return cell.cell_contents


def _global_names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


# ----------------------------------------------------------------------------------------------------------------
# Tracing


@dataclasses.dataclass(frozen=True, eq=False)
class Traced:
    """A traced mod: its kind ("score" or "mask"), expression, the arrays it reads (in table order) and which
    batch axes it reads (the axes a block mask must tell apart)."""

    kind: str
    expr: Expr
    arrays: Tuple[Any, ...]
    batch_axes: frozenset
    nbatch: int

    @property
    def key(self) -> str:
        """What a kernel compiled for this mod is cached by: the expression and its tables' kinds and ndims."""
        tables = ", ".join(f"table{t}: {kind_of_dtype(a.dtype)}[{len(a.shape)}]" for t, a in enumerate(self.arrays))
        return f"{self.kind}_mod({self.expr.text}; {tables})"

    def program(self, slope: bool = False) -> List[Expr]:
        """The nodes of its expression (slope: of its derivative with respect to the score) in evaluation order,
        the result last: what the kernels' CUDA is written from."""
        return nodes(derivative(self.expr) if slope else self.expr)


def trace(fn, kind: str, nbatch: int, name: Optional[str] = None, groups: Optional[int] = None) -> Traced:
    """The expression of score_mod (kind "score") or mask_mod ("mask") for nbatch batch axes. groups: packed
    sequences' (attention_varlen), whose batch axes are (s, hk, g) and whose mods see (s, h, i, j), the query head
    h = hk * groups + g."""
    name = name or f"{kind}_mod"
    if not callable(fn):
        raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
    seen = nbatch if groups is None else nbatch - 1  # the batch indices fn takes
    count = seen + 2 + (kind == "score")
    check_arity(fn, count, seen, kind, name, None if groups is None else ("s", "h"))
    capture = _Capture()
    target = capture.rebind(fn) if isinstance(fn, types.FunctionType) else fn
    args = [Expr("index", (), "int", axis) for axis in range(nbatch + 2)]
    if groups is not None:
        s, hk, g = args[:3]
        args = [s, hk if groups == 1 else hk * groups + g] + args[3:]
    if kind == "score":
        args = [Expr("score", (), "float")] + args
    try:
        result = target(*args)
    except TraceError as exc:
        raise TraceError(f"{name}: {exc}".replace(f"{name}: mods: ", f"{name}: ")) from None
    try:
        result = const(result)
    except TraceError:
        raise TraceError(f"{name} returned {type(result).__name__}, not an expression of its arguments; return a "
                         f"number, comparison or arithmetic of them") from None
    if kind == "mask" and result.kind != "bool":
        raise TraceError(f"mask_mod returned the {result.kind} expression {result.text}; it must return a bool (a "
                         f"comparison, or & | ~ of comparisons)")
    if kind == "score":
        result = cast(result, "float")
    axes = frozenset(a for a in _index_axes(result) if a < nbatch)
    return Traced(kind, result, tuple(t.array for t in capture.tables), axes, nbatch)


def cuda_source(score_mod=None, mask_mod=None, *, nbatch: int = 2, sinks: bool = False) -> str:
    """The CUDA the cupy and simt backends compile into their kernels for these mods, for reading.

    A struct of device functions (score, its derivative with respect to the score, mask) over nbatch batch axes,
    whose captured arrays arrive as tables.

    Parameters
    ----------
    score_mod, mask_mod : callable, optional
        Either may be None.
    nbatch : int, optional
        Batch axes (2 for ``(B, H, n, d)`` inputs).
    sinks : bool, optional
        Whether the forward's rows start from ``sinks=``.

    Returns
    -------
    str
        CUDA C++.

    Examples
    --------
    >>> from cuflash import mods
    >>> source = mods.cuda_source(mods.softcap(30.0))
    >>> print(source[source.index("// score_mod"):].splitlines()[0])
    // score_mod: multiply(0x1.e000000000000p+4, tanh(true_divide(score, 0x1.e000000000000p+4)))
    """
    from .kernels import mods as kernel_mods
    score = None if score_mod is None else trace(score_mod, "score", nbatch)
    mask = None if mask_mod is None else trace(mask_mod, "mask", nbatch)
    return kernel_mods.kernel_mods(score, mask, nbatch, sinks).source


def check_arity(fn, count: int, nbatch: int, kind: str, name: str, batch_names=None) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*range(count))
    except TypeError:
        names = list(batch_names or (f"b{a}" for a in range(nbatch)))
        shown = ", ".join(([] if kind == "mask" else ["score"]) + names + ["i", "j"])
        what = "the sequence and the query head" if batch_names else \
            f"one index per axis of the broadcast batch shape ({nbatch} here)"
        raise TypeError(f"{name} must take {count} arguments ({shown}): {what}, then the query row and the key; "
                        f"{fn.__name__}{signature} does not") from None


def _index_axes(expr: Expr, seen=None) -> set:
    seen = set() if seen is None else seen
    if id(expr) in seen:
        return set()
    seen.add(id(expr))
    axes = {expr.value} if expr.op == "index" else set()
    for a in expr.args:
        axes |= _index_axes(a, seen)
    return axes


def nodes(expr: Expr) -> List[Expr]:
    """Every node of the expression once, arguments before their users."""
    order: List[Expr] = []
    seen: set = set()

    def visit(x: Expr):
        if id(x) in seen:
            return
        seen.add(id(x))
        for a in x.args:
            visit(a)
        order.append(x)
    visit(expr)
    return order


# ----------------------------------------------------------------------------------------------------------------
# Evaluation with NumPy (or CuPy), on a tile's grids


_NP_BINARY = {"true_divide": "divide"}


def evaluate(expr: Expr, indices, tables, acc, score=None, xp=np, what: str = "mod", consume_score=False):
    """The expression on broadcastable grids: indices (one int64 array per index axis), tables (the arrays, in
    table order, floats already in acc), score (acc). An index outside its table is an IndexError. Float
    operations write into an argument that nothing else reads (a temporary of theirs, or the score itself with
    consume_score): a score_mod costs passes over the tile, not allocations."""
    acc = np.dtype(acc)
    order = nodes(expr)
    uses = collections.Counter(id(a) for x in order for a in x.args)
    owned: set = set()  # nodes whose value is an array this evaluation made (or the consumed score)
    values: Dict[int, Any] = {}
    for x in order:
        args = [values[id(a)] for a in x.args]
        out = _reusable(x, args, uses, owned, acc, xp)
        values[id(x)] = _evaluate_node(x, args, indices, tables, acc, score, xp, what, out)
        if x.op not in ("index", "const", "table", "score") or (x.op == "score" and consume_score):
            owned.add(id(x))
    return values[id(expr)]


IN_PLACE = {  # the operations one ufunc call computes, by kind of result (and of arguments)
    "float": (FLOAT_UNARY - {"reciprocal"}) | {"add", "subtract", "multiply", "true_divide", "minimum", "maximum",
                                               "power", "negative", "absolute", "square", "sign"},
    "int": {"add", "subtract", "multiply", "minimum", "maximum", "negative", "absolute", "square", "sign",
            "bitwise_and", "bitwise_or", "bitwise_xor", "invert"},
    "bool": {"bitwise_and", "bitwise_or", "bitwise_xor", "logical_not"},
}


def _reusable(x, args, uses, owned, acc, xp):
    """An argument of x its ufunc may write the result into (one of the result's dtype and shape that nothing
    else reads), or None."""
    if x.op not in IN_PLACE[x.kind]:
        return None
    dtype = {"float": acc, "int": np.dtype(np.int64), "bool": np.dtype(np.bool_)}[x.kind]
    shape = np.broadcast_shapes(*(np.shape(a) for a in args))
    for a, value in zip(x.args, args):
        if id(a) in owned and uses[id(a)] == 1 and isinstance(value, xp.ndarray) and value.dtype == dtype and \
                value.shape == shape:
            owned.discard(id(a))
            return value
    return None


def _evaluate_node(x, args, indices, tables, acc, score, xp, what, out=None):
    if x.op == "score":
        return score
    if x.op == "index":
        return indices[x.value]
    if x.op == "const":
        return xp.asarray(x.value, dtype={"bool": np.bool_, "int": np.int64, "float": acc}[x.kind])
    if x.op == "table":
        return read_table(tables[x.value], args, x.value, xp, what)
    if x.op == "cast":
        (a,) = args
        if x.kind == "bool":
            return a != 0
        if x.kind == "int" and a.dtype.kind == "f":
            with np.errstate(invalid="ignore"):
                return xp.trunc(a).astype(np.int64)
        return a.astype(np.int64 if x.kind == "int" else acc)
    if x.op == "where":
        return xp.where(*args)
    with np.errstate(all="ignore"):
        if x.op == "reciprocal":
            return acc.type(1) / args[0]
        if x.op in ("floor_divide", "remainder") and x.kind == "int":
            a, b = args  # Python's semantics; a zero divisor gives 0 (as the kernels do)
            zero = b == 0
            safe = xp.where(zero, 1, b)
            result = getattr(xp, x.op)(a, safe)
            return xp.where(zero, 0, result)
        if x.op == "power" and x.kind == "int":
            a, b = args
            return xp.where(b < 0, 0, xp.power(a, xp.maximum(b, 0)))
        result = getattr(xp, _NP_BINARY.get(x.op, x.op))(*args, **({} if out is None else {"out": out}))
    if x.kind == "float" and result.dtype != acc:
        result = result.astype(acc)
    return result


def read_table(array, index, number, xp, what):
    for axis, (k, size) in enumerate(zip(index, array.shape)):
        bad = (k < 0) | (k >= size)
        if bool(bad.any()):
            first = int(xp.asarray(k)[bad].ravel()[0])
            raise IndexError(f"{what}: index {first} is out of bounds for axis {axis} of table{number} (shape "
                             f"{tuple(array.shape)}); mods do not wrap negative indices")
    return array[tuple(index)] if index else array[()]


def prepared_tables(traced: Traced, xp, acc) -> Tuple[Any, ...]:
    """The traced mod's arrays as the numpy backend reads them: arrays of xp, floats in acc, integers in int64."""
    result = []
    for a in traced.arrays:
        a = as_module_array(a, xp)
        wanted = {"f": acc, "i": np.dtype(np.int64), "u": np.dtype(np.int64)}.get(a.dtype.kind, a.dtype)
        result.append(a if a.dtype == wanted else a.astype(wanted))
    return tuple(result)


def as_module_array(a, xp):
    """A captured NumPy, CuPy or torch array as an array of xp (torch by DLPack, no copy where it can)."""
    if isinstance(a, xp.ndarray):
        return a
    if type(a).__module__.startswith("torch"):
        a = a.detach()
        if xp is np:
            return a.cpu().numpy() if str(a.dtype) != "torch.bfloat16" else a.float().cpu().numpy()
        return xp.from_dlpack(a)
    if xp is np and type(a).__module__.split(".")[0] == "cupy":
        raise TypeError("mods: a mod closes over a CuPy array but runs on NumPy arrays; capture a NumPy array "
                        "(cupy.asnumpy)")
    return xp.asarray(a)


# ----------------------------------------------------------------------------------------------------------------
# The derivative with respect to the score (the backward through score_mod)


def derivative(expr: Expr, wrt: Optional[Expr] = None) -> Expr:
    """d expr / d score (wrt: d expr / d that node of it instead, such as one read of a table), an expression of
    the same leaves (0 where the expression does not depend on it)."""
    memo: Dict[int, Expr] = {}
    for x in nodes(expr):
        if wrt is not None and (x is wrt or x.op == "score"):
            memo[id(x)] = ONE if x is wrt else ZERO
        else:
            memo[id(x)] = _derivative_node(x, [memo[id(a)] for a in x.args])
    return memo[id(expr)]


def float_reads(expr: Expr, table: int) -> List[Expr]:
    """The nodes of the expression that read the float table numbered `table`, in evaluation order."""
    return [x for x in nodes(expr) if x.op == "table" and x.value == table and x.kind == "float"]


ZERO, ONE = Expr("const", (), "float", 0.0), Expr("const", (), "float", 1.0)


def _is(x: Expr, value: float) -> bool:
    return x.op == "const" and x.value == value


def _add(a, b):
    return b if _is(a, 0) else a if _is(b, 0) else binary("add", a, b)


def _mul(a, b):
    if _is(a, 0) or _is(b, 0):
        return ZERO
    return b if _is(a, 1) else a if _is(b, 1) else binary("multiply", a, b)


def _derivative_node(x: Expr, d: List[Expr]) -> Expr:
    if x.op == "score":
        return ONE
    if x.kind != "float" or all(_is(g, 0) for g in d):
        return ZERO
    a = x.args[0] if x.args else None
    op = x.op
    if op == "cast":
        return d[0]
    if op == "add":
        return _add(d[0], d[1])
    if op == "subtract":
        return _add(d[0], _mul(const(-1.0), d[1]))
    if op == "multiply":
        return _add(_mul(d[0], x.args[1]), _mul(a, d[1]))
    if op == "true_divide":
        b = x.args[1]
        return binary("true_divide", _add(_mul(d[0], b), _mul(const(-1.0), _mul(a, d[1]))), _mul(b, b))
    if op == "power":
        b = x.args[1]
        if _is(d[1], 0):
            return _mul(_mul(b, binary("power", a, binary("subtract", b, 1.0))), d[0])
        return _mul(x, _add(_mul(d[1], unary("log", a)), binary("true_divide", _mul(b, d[0]), a)))
    if op in ("minimum", "maximum"):
        test = binary("less_equal" if op == "minimum" else "greater_equal", a, x.args[1])
        return where(test, d[0], d[1])
    if op == "where":
        return where(x.args[0], d[1], d[2])
    if op == "remainder":
        return d[0] if _is(d[1], 0) else _add(d[0], _mul(const(-1.0), _mul(unary("floor", binary(
            "true_divide", a, x.args[1])), d[1])))
    chain = {
        "negative": lambda: const(-1.0),
        "absolute": lambda: unary("sign", a),
        "square": lambda: _mul(const(2.0), a),
        "exp": lambda: x,
        "exp2": lambda: _mul(x, const(math.log(2.0))),
        "expm1": lambda: unary("exp", a),
        "log": lambda: unary("reciprocal", a),
        "log2": lambda: unary("reciprocal", _mul(a, const(math.log(2.0)))),
        "log1p": lambda: unary("reciprocal", binary("add", a, 1.0)),
        "sqrt": lambda: binary("true_divide", 0.5, x),
        "tanh": lambda: binary("subtract", 1.0, _mul(x, x)),
        "sin": lambda: unary("cos", a),
        "cos": lambda: unary("negative", unary("sin", a)),
        "reciprocal": lambda: unary("negative", _mul(x, x)),
    }.get(op)
    if chain is None:  # floor, ceil, trunc, sign, floor_divide: piecewise constant
        return ZERO
    return _mul(chain(), d[0])


# ----------------------------------------------------------------------------------------------------------------
# A traced mod bound to one call's arrays (the numpy backend's evaluation)


class Bound:
    """A traced mod with its tables as arrays of xp (floats in acc), evaluated on a tile's grids; for score_mod
    also its derivative with respect to the score (traced once, when first asked)."""

    def __init__(self, traced: Traced, xp, acc):
        self.traced, self.xp, self.acc = traced, xp, np.dtype(acc)
        self.tables = prepared_tables(traced, xp, self.acc)
        self._derivative: Optional[Expr] = None
        self._reads: Dict[int, List[Tuple[Tuple[Expr, ...], Expr]]] = {}

    def __call__(self, grids, score=None, consume_score=False):
        return evaluate(self.traced.expr, grids, self.tables, self.acc, score, self.xp, f"{self.traced.kind}_mod",
                        consume_score)

    def derivative(self, grids, score):
        if self._derivative is None:
            self._derivative = derivative(self.traced.expr)
        return evaluate(self._derivative, grids, self.tables, self.acc, score, self.xp, "score_mod")

    def reads(self, table: int) -> List[Tuple[Tuple[Expr, ...], Expr]]:
        """For each read of float table `table`: (its index expressions, d score_mod / d the value read)."""
        if table not in self._reads:
            self._reads[table] = [(x.args, derivative(self.traced.expr, wrt=x))
                                  for x in float_reads(self.traced.expr, table)]
        return self._reads[table]

    def evaluate(self, expr: Expr, grids, score):
        """Another expression of the same leaves (an index, a derivative) on a tile's grids."""
        return evaluate(expr, grids, self.tables, self.acc, score, self.xp, "score_mod")


# ----------------------------------------------------------------------------------------------------------------
# Built-in patterns: ordinary mods, written as a user would write them. A per-head array (slopes, a bias table's
# rows) is indexed by the trailing batch axes, as NumPy broadcasting aligns it against (*batch,); a per-token
# array (document ids, prefix lengths) by the leading ones (for (B, H, n, d) inputs: by b).


def _split(idx):
    return idx[:-2], idx[-2], idx[-1]


def _trailing(array, batch):
    """array's index tuple from the trailing batch axes (its last axis excluded: extra, the caller's)."""
    return tuple(batch[len(batch) - (len(array.shape) - 1):]) if len(array.shape) > 1 else ()


def alibi(slopes, offset: int = 0):
    """ALiBi (Press et al.): ``score - slopes[h] * |i + offset - j|``, as a score_mod.

    Parameters
    ----------
    slopes : array_like
        ``(H,)`` or ``(B, H)`` (the trailing batch axes); `alibi_slopes` gives the paper's.
    offset : int, optional
        ``m - n`` aligns it bottom-right, as FlashAttention's alibi_slopes do; for causal attention it differs from
        ``slopes[h] * (j - i)`` by a constant per row, which the softmax cancels.

    Returns
    -------
    callable
        ``score_mod(score, *idx, i, j)``.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import mods
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 256, 32), dtype=np.float32) for _ in range(3))   # (B, H, n, d)
    >>> out = cuflash.attention(q, k, v, causal=True, score_mod=mods.alibi(mods.alibi_slopes(4)))
    """
    def alibi_mod(score, *idx):
        batch, i, j = _split(idx)
        distance = np.abs(i - j) if offset == 0 else np.abs(i + offset - j)
        return score - slopes[tuple(batch[len(batch) - len(slopes.shape):])] * distance
    return alibi_mod


def alibi_slopes(heads: int) -> np.ndarray:
    """The ALiBi paper's slopes for `heads` heads: ``2^(-8 h / heads)`` for h = 1 ... heads.

    For a power of two; other counts interleave the next power's, as the paper's code does.

    Parameters
    ----------
    heads : int

    Returns
    -------
    ndarray
        ``(heads,)`` float64.

    Examples
    --------
    >>> from cuflash import mods
    >>> mods.alibi_slopes(4)
    array([0.25      , 0.0625    , 0.015625  , 0.00390625])
    """
    def powers(count):
        start = 2.0 ** (-8.0 / count)
        return [start ** (h + 1) for h in range(count)]
    closest = 2 ** int(math.floor(math.log2(heads)))
    slopes = powers(closest) + powers(2 * closest)[0::2][:heads - closest]
    return np.array(slopes, dtype=np.float64)


def softcap(cap: float):
    """Logit soft-capping (Gemma 2, Grok): ``cap * tanh(score / cap)``, as a score_mod.

    Parameters
    ----------
    cap : float

    Returns
    -------
    callable
        ``score_mod(score, *idx, i, j)``.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import mods
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 256, 32), dtype=np.float32) for _ in range(3))   # (B, H, n, d)
    >>> out = cuflash.attention(q, k, v, score_mod=mods.softcap(30.0))
    """
    if not (isinstance(cap, numbers.Real) and cap > 0 and math.isfinite(cap)):
        raise ValueError(f"softcap: cap must be a positive finite number, got {cap!r}")

    def softcap_mod(score, *idx):
        return cap * np.tanh(score / cap)
    return softcap_mod


def documents(ids, kv_ids=None):
    """Packed sequences: query i sees key j only when both belong to the same document, as a mask_mod.

    Parameters
    ----------
    ids : array_like of int
        ``(*lead, n)`` document ids per query token (lead: leading batch axes, e.g. ``(B,)`` for ``(B, H, n, d)``
        inputs, or none).
    kv_ids : array_like of int, optional
        The keys' ``(*lead, m)``, by default ids (self-attention).

    Returns
    -------
    callable
        ``mask_mod(*idx, i, j)``.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import mods
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 256, 32), dtype=np.float32) for _ in range(3))   # (B, H, n, d)
    >>> ids = np.repeat(np.arange(4), 64)[None].repeat(2, 0)       # (B, n): 4 documents of 64 tokens
    >>> out = cuflash.attention(q, k, v, causal=True, mask_mod=mods.documents(ids))
    """
    kv = ids if kv_ids is None else kv_ids

    def documents_mask(*idx):
        batch, i, j = _split(idx)
        return ids[tuple(batch[:len(ids.shape) - 1]) + (i,)] == kv[tuple(batch[:len(kv.shape) - 1]) + (j,)]
    return documents_mask


def prefix_lm(prefix_length):
    """Prefix-LM: every query sees the first prefix_length keys, and the others causally (j <= i), as a mask_mod.

    Parameters
    ----------
    prefix_length : int or array_like of int
        An int, or one per leading batch item (``(B,)`` for ``(B, H, n, d)`` inputs).

    Returns
    -------
    callable
        ``mask_mod(*idx, i, j)``.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import mods
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 256, 32), dtype=np.float32) for _ in range(3))   # (B, H, n, d)
    >>> out = cuflash.attention(q, k, v, mask_mod=mods.prefix_lm(np.array([16, 100])))
    """
    def prefix_lm_mask(*idx):
        batch, i, j = _split(idx)
        if isinstance(prefix_length, Table) or is_array(prefix_length):
            return (j < prefix_length[tuple(batch[:len(prefix_length.shape)])]) | (j <= i)
        return (j < prefix_length) | (j <= i)
    return prefix_lm_mask


def relative_bias(table, buckets):
    """A learned relative-position bias (T5, Swin): ``score + table[..., bucket]``, as a score_mod.

    Parameters
    ----------
    table : array_like
        ``(buckets,)`` or ``(*trailing batch axes, buckets)``.
    buckets : callable or array_like of int
        A function ``bucket(i, j) -> integer expression`` (T5's log buckets are one), or an integer array of
        ``2 L - 1`` bucket numbers for relative distances ``j - i = -(L - 1) ... L - 1`` (farther ones clipped to the
        ends).

    Returns
    -------
    callable
        ``score_mod(score, *idx, i, j)``.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import mods
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 256, 32), dtype=np.float32) for _ in range(3))   # (B, H, n, d)
    >>> table = rng.standard_normal((4, 9))                          # per head, 9 buckets
    >>> buckets = np.clip(np.arange(-255, 256), -4, 4) + 4           # distances -255 ... 255 onto 0 ... 8
    >>> out = cuflash.attention(q, k, v, score_mod=mods.relative_bias(table, buckets))
    """
    def relative_bias_mod(score, *idx):
        batch, i, j = _split(idx)
        if isinstance(buckets, Table) or is_array(buckets):
            reach = (len(buckets) - 1) // 2
            bucket = buckets[np.clip(j - i, -reach, reach) + reach]
        else:
            bucket = buckets(i, j)
        return score + table[_trailing(table, batch) + (bucket,)]
    return relative_bias_mod


def and_masks(*masks):
    """A mask_mod that sees a key where every one of masks does.

    Parameters
    ----------
    *masks : callable
        mask_mods of the same indices.

    Returns
    -------
    callable
        ``mask_mod(*idx, i, j)``.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import mods
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 256, 32), dtype=np.float32) for _ in range(3))   # (B, H, n, d)
    >>> local = mods.and_masks(mods.causal, mods.sliding_window(64))
    >>> out = cuflash.attention(q, k, v, mask_mod=local)
    """
    if not masks:
        raise ValueError("and_masks: give at least one mask_mod")

    def all_of(*idx):
        result = masks[0](*idx)
        for mask in masks[1:]:
            result = result & mask(*idx)
        return result
    return all_of


def or_masks(*masks):
    """A mask_mod that sees a key where any one of masks does.

    Parameters
    ----------
    *masks : callable
        mask_mods of the same indices.

    Returns
    -------
    callable
        ``mask_mod(*idx, i, j)``.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import mods
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 256, 32), dtype=np.float32) for _ in range(3))   # (B, H, n, d)
    >>> def first_keys(b, h, i, j):                                   # global tokens: the first 4 keys
    ...     return j < 4
    >>> out = cuflash.attention(q, k, v, mask_mod=mods.or_masks(mods.sliding_window(32, 32), first_keys))
    """
    if not masks:
        raise ValueError("or_masks: give at least one mask_mod")

    def any_of(*idx):
        result = masks[0](*idx)
        for mask in masks[1:]:
            result = result | mask(*idx)
        return result
    return any_of


def causal(*idx):
    """The causal mask top-left aligned (j <= i), as a mask_mod (``causal=`` aligns it bottom-right).

    Parameters
    ----------
    *idx : int
        The batch indices, then i and j.

    Returns
    -------
    bool
        Whether query i sees key j.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import mods
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 256, 32), dtype=np.float32) for _ in range(3))   # (B, H, n, d)
    >>> out = cuflash.attention(q, k, v, mask_mod=mods.causal)
    >>> bool(np.allclose(out, cuflash.attention(q, k, v, causal=True), atol=1e-6))       # n == m: the same
    True
    """
    return idx[-1] <= idx[-2]


def sliding_window(left: int, right: int = 0):
    """A band ``i - left <= j <= i + right`` as a mask_mod (``window=`` is the same, with its tiles skipped).

    Parameters
    ----------
    left, right : int

    Returns
    -------
    callable
        ``mask_mod(*idx, i, j)``.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import mods
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 256, 32), dtype=np.float32) for _ in range(3))   # (B, H, n, d)
    >>> out = cuflash.attention(q, k, v, mask_mod=mods.sliding_window(32))
    >>> bool(np.allclose(out, cuflash.attention(q, k, v, window=(32, 0)), atol=1e-6))
    True
    """
    def window_mask(*idx):
        i, j = idx[-2], idx[-1]
        return (j >= i - left) & (j <= i + right)
    return window_mask
