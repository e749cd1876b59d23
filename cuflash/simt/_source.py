"""From CUDA C++ source to the translation unit g++ compiles.

The kernel source stays exactly what NVRTC compiles; only two kinds of declaration are rewritten, on the same
lines so that g++'s messages and AddressSanitizer's reports name the kernel's own line numbers:

* ``__shared__ T name[N];`` inside a function becomes a per-block static (``static thread_local``, or plain
  ``static`` in the sanitizer builds, which run one block at a time) followed by a call that fills it with
  0xff bytes (NaN for floating types) the first time a block reaches it.
* ``extern __shared__ T name[];`` inside a function becomes ``T* const name = <this block's dynamic shared
  memory>``: a heap buffer of exactly the launch's ``shared_mem`` bytes, so overruns are visible.

Both must be declared inside a function (the kernel or a device helper); a namespace-scope ``extern
__shared__`` is refused with a message saying so.
"""

from __future__ import annotations

import re

_WORD_SHARED = re.compile(r"(?<![\w$])__shared__(?![\w$])")
_WORD_GLOBAL = re.compile(r"(?<![\w$])__global__(?![\w$])")
_ATTRS = re.compile(r"__align__\s*\([^()]*\)|alignas\s*\([^()]*\)|__attribute__\s*\(\(.*?\)\)|\[\[.*?\]\]")
_IDENT = re.compile(r"[A-Za-z_]\w*")


class SourceError(ValueError):
    """A construct the emulator cannot take, with the line it is on."""


def mask(src: str) -> str:
    """The source with comments and the insides of string and character literals blanked (same length, same
    newlines), so that searches only ever see code."""
    out = list(src)
    i, n = 0, len(src)

    def blank(a: int, b: int) -> None:
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        elif c == '"' and i > 0 and src[i - 1] == "R" and (i < 2 or not (src[i - 2].isalnum() or src[i - 2] == "_")):
            k = src.find("(", i)
            end = ")" + src[i + 1:k] + '"'
            j = src.find(end, k)
            j = n if j < 0 else j + len(end)
            blank(i + 1, j - 1)
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and src[i - 1].isalnum() and i + 1 < n and src[i + 1].isalnum():
                i += 1  # a digit separator (1'000), not a character literal
                continue
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            blank(i + 1, min(j, n))
            i = j + 1
        else:
            i += 1
    return "".join(out)


_LINE_DIRECTIVE = re.compile(r'^[ \t]*#[ \t]*line[ \t]+(\d+)(?:[ \t]+"([^"]*)")?', re.M)


def _location(src: str, pos: int, filename: str) -> tuple[str, int]:
    """(file, line) of pos as the compiler sees it: the source's own #line directives (the project's assembled
    kernel source has them) name the true file and line."""
    line = src.count("\n", 0, pos) + 1
    last = None
    for m in _LINE_DIRECTIVE.finditer(src, 0, pos):
        if src.count("\n", 0, m.start()) + 1 < line:
            last = m
    if last is None:
        return filename, line
    after = src.count("\n", 0, last.start()) + 2  # the line the directive numbers
    return last.group(2) or filename, int(last.group(1)) + line - after


def _on_directive_line(masked: str, pos: int) -> bool:
    """Whether pos sits in a preprocessor directive (continuation lines included)."""
    start = masked.rfind("\n", 0, pos) + 1
    while True:
        if masked[start:pos].lstrip().startswith("#"):
            return True
        if start < 2 or masked[start - 2] != "\\":
            return False
        start = masked.rfind("\n", 0, start - 1) + 1


def _brace_scopes(masked: str):
    """For each '{' and '}', whether it opens/closes a function body or other code ('code'), a namespace or
    class ('scope') or an extern "C" block ('externc'). Returns a sorted list of (position, stack after)."""
    events = []
    stack: list[str] = []
    last = 0  # start of the current statement header
    for m in re.finditer(r"[{};]", masked):
        ch, pos = m.group(), m.start()
        if ch == "{":
            header = masked[last:pos]
            header = "\n".join(ln for ln in header.split("\n") if not ln.lstrip().startswith("#"))
            header = " ".join(header.split())
            if re.match(r"^(inline\s+)?namespace\b", header):
                kind = "scope"
            elif re.match(r'^extern\s+"\s*"$', header):
                kind = "externc"
            elif re.search(r"\b(struct|class|union|enum)\b", header) and not re.search(
                    r"\)\s*(const|noexcept|override|final|volatile|&|\s)*$", header) and "=" not in header:
                kind = "scope"
            else:
                kind = "code"
            stack.append(kind)
        elif ch == "}" and stack:
            stack.pop()
        last = pos + 1
        events.append((pos, tuple(stack)))
    return events


def _stack_at(events, pos: int):
    lo, hi = 0, len(events)
    while lo < hi:  # last event before pos
        mid = (lo + hi) // 2
        if events[mid][0] < pos:
            lo = mid + 1
        else:
            hi = mid
    return events[lo - 1][1] if lo else ()


def _statement_end(masked: str, pos: int) -> int:
    """Index of the ';' ending the declaration that starts at pos (brackets balanced), or -1."""
    depth = 0
    for k in range(pos, len(masked)):
        ch = masked[k]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return -1
            depth -= 1
        elif ch == ";" and depth == 0:
            return k
    return -1


def _split_top(text: str, sep: str = ","):
    parts, depth, start = [], 0, 0
    for k, ch in enumerate(text):
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:k])
            start = k + 1
    parts.append(text[start:])
    return parts


def _declarator_name(piece: str):
    piece = _ATTRS.sub(" ", piece)
    head = re.split(r"[\[=]", piece, maxsplit=1)[0]
    names = _IDENT.findall(head)
    return names[-1] if names else None


def rewrite(src: str, filename: str = "kernel.cu") -> tuple[str, list[str]]:
    """Rewrite the __shared__ declarations (see the module docstring). Returns the new source, which has the
    same lines as src, and the names of the extern "C" __global__ kernels it defines."""
    masked = mask(src)
    events = _brace_scopes(masked)
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement), non-overlapping
    for m in _WORD_SHARED.finditer(masked):
        pos = m.start()
        if _on_directive_line(masked, pos):
            continue  # a macro that merely names __shared__: the header's fallback macro serves it
        in_function = "code" in _stack_at(events, pos)
        before = masked[:pos]
        ext = re.search(r"\bextern\s+$", before)
        stat = re.search(r"\bstatic\s+$", before)
        end = _statement_end(masked, m.end())
        file, line = _location(src, pos, filename)
        where = f"{file}:{line}"
        if end < 0:
            raise SourceError(f"{where}: cannot find the end of this __shared__ declaration")
        decl = src[m.end():end]
        if ext:
            if not in_function:
                raise SourceError(
                    f"{where}: extern __shared__ at namespace scope; the emulator needs it declared inside "
                    f"the kernel (or the device function) that uses it, e.g. `extern __shared__ char smem[];`")
            d = re.match(r"^\s*(?P<type>.*?)\s*\b(?P<name>[A-Za-z_]\w*)\s*\[\s*\]\s*$", _ATTRS.sub(" ", decl),
                         re.S)
            if not d:
                raise SourceError(f"{where}: cannot read this extern __shared__ declaration; write it as "
                                  f"`extern __shared__ T name[];`")
            ty, name = " ".join(d.group("type").split()), d.group("name")
            span = src[ext.start():end + 1]
            text = f"{ty}* const {name} = reinterpret_cast<{ty}*>(::cuflash_simt::dynamic_shared());"
            edits.append((ext.start(), end + 1, text + "\n" * span.count("\n")))
        elif in_function:
            start = stat.start() if stat else pos
            edits.append((start, m.end(), "CUFLASH_SIMT_SHARED"))
            calls = []
            for piece in _split_top(decl):
                name = _declarator_name(piece)
                if name:
                    # __FILE__ is the file the source's #line directives name, as the runtime's messages give it
                    calls.append(f" ::cuflash_simt::shared_fresh(&{name}, sizeof({name}), __FILE__, {line});")
            edits.append((end + 1, end + 1, "".join(calls)))
    out, at = [], 0
    for start, stop, text in sorted(edits):
        out.append(src[at:start])
        out.append(text)
        at = stop
    out.append(src[at:])
    return "".join(out), extern_c_kernels(masked, events)


def extern_c_kernels(masked: str, events=None) -> list[str]:
    """Names of non-template extern "C" __global__ functions (what get_function finds without name
    expressions, as in CuPy)."""
    events = _brace_scopes(masked) if events is None else events
    names = []
    for m in _WORD_GLOBAL.finditer(masked):
        start = max(masked.rfind(ch, 0, m.start()) for ch in ";{}") + 1
        header = masked[start:m.start()]
        if re.search(r"\btemplate\b", header) or _on_directive_line(masked, m.start()):
            continue
        externc = re.search(r'\bextern\s+"\s*"', header) or "externc" in _stack_at(events, m.start())
        tail = re.match(r"\s*(?:__launch_bounds__\s*\([^()]*\)\s*)?void\s+(?:__launch_bounds__\s*\([^()]*\)\s*)?"
                        r"([A-Za-z_]\w*)\s*\(", masked[m.end():])
        if externc and tail:
            names.append(tail.group(1))
    return names


def translation_unit(src: str, kernels: list[str], filename: str = "kernel.cu") -> str:
    """The whole file g++ compiles: the runtime header, the rewritten kernel source under #line so messages
    name its lines, and one entry per kernel (a name expression or an extern "C" name)."""
    body, _ = rewrite(src, filename)
    entries = []
    for i, expr in enumerate(kernels):
        lit = expr.replace("\\", "\\\\").replace('"', '\\"')
        entries.append(f'#line {i + 1} "<name expression {i}>"\n'
                       f'  {{"{lit}", [](void** a) {{ ::cuflash_simt::invoke(&{expr}, a); }},\n'
                       f'   [] {{ return ::cuflash_simt::signature_of(&{expr}); }}}},\n')
    return (
        '#include "cuflash_simt.h"\n'
        f'#line 1 "{filename}"\n'
        f"{body}\n"
        '#line 1 "<cuflash.simt entries>"\n'
        "namespace cuflash_simt_generated {\n"
        "static const ::cuflash_simt::KernelEntry table[] = {\n"
        + "".join(entries)
        + "};\n}\n"
        "CUFLASH_SIMT_EXPORT_TABLE(cuflash_simt_generated::table)\n"
    )
