"""How a backend says it cannot run a point (Skip), which errors mean that rather than a bug, and an exception
written as one line for a record."""

from __future__ import annotations


class Skip(Exception):
    """A backend cannot run a point; the message says why."""


def one_line(exc, limit=400) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split()) if not isinstance(exc, Skip) else str(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_cannot_run(exc) -> bool:
    """Errors that say "this backend cannot run this point" rather than "something broke"."""
    name = type(exc).__name__
    text = str(exc)
    return (isinstance(exc, Skip) or name in ("BackendUnavailableError", "OutOfMemoryError", "NotImplementedError")
            or "No available kernel" in text or "No viable backend" in text or "out of memory" in text.lower())
