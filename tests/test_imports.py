"""The package's import graph has no cycle: no module of cuflash/ imports one that imports it back, directly or
through others, counting imports inside functions (lazy ones) too. Read from the source, not by importing."""

import ast
from pathlib import Path

import cuflash

ROOT = Path(cuflash.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = ("cuflash",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path):
    """The cuflash modules a file imports anywhere in it: `from .x import y` names .x, or .x.y when y is a module."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("cuflash"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            elif (node.module or "").startswith("cuflash"):
                target = node.module
            else:
                continue
            for alias in node.names:
                yield f"{target}.{alias.name}" if is_module(f"{target}.{alias.name}") else target


def graph():
    return {module_name(p): {t for t in imports_of(p) if t != module_name(p)} for p in ROOT.rglob("*.py")}


def cycles(edges):
    """Every module that reaches itself, with the path that does."""
    found = []
    for start in edges:
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    found.append(" -> ".join(path + (start,)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + (nxt,)))
    return found


def test_the_import_graph_has_no_cycle():
    edges = graph()
    assert {"cuflash.tiling", "cuflash.kernels.forward_mma", "cuflash.launch"} <= set(edges)
    assert "cuflash.family" in edges["cuflash.kernels.forward_mma"]
    assert cycles(edges) == []


def test_the_cycle_check_sees_lazy_imports():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a", "b -> c -> a -> b",
                                                                         "c -> a -> b -> c"]
    lazy = ast.parse("def f():\n    from . import launch\n")
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(lazy))
    assert "cuflash.launch" in graph()["cuflash.backends.simt"]
