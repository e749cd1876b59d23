"""The small registry that picks a backend: from the arrays' module, or forced by name.

A backend is a module with `ARRAYS` ("numpy" or "cupy": the arrays it runs on), `unavailable()` (a sentence
saying why it cannot run here, or None) and `run(problem, out, lse, block=None)`, which writes the result into
out ((*batch, n, e) of problem.dtype, possibly strided) and, when lse is not None, the row log-sum-exp into lse;
and `run_backward(problem, dout, out, lse, grads, block=None)`, which writes the gradients into grads = (dq, dk, dv,
dbias or None), zeroed arrays over the whole batch in the accumulator type.
"""

from __future__ import annotations

import importlib

from ..errors import BackendUnavailableError

__all__ = ["BackendUnavailableError", "NAMES", "get", "unavailable"]

NAMES = ("numpy", "cupy", "simt")


def get(name, xp):
    """The backend module for `name` (None: the one for xp's arrays), checked against the arrays it will get."""
    arrays = "cupy" if xp.__name__ == "cupy" else "numpy"
    if name is None:
        name = arrays
    module = _module(name)
    if module.ARRAYS != arrays:
        hint = "cupy.asarray" if module.ARRAYS == "cupy" else "cupy.asnumpy"
        raise TypeError(f"attention: backend {name!r} runs on {module.ARRAYS} arrays, got {arrays} arrays; convert "
                        f"them with {hint}")
    reason = module.unavailable()
    if reason:
        raise BackendUnavailableError(f"attention: backend {name!r} is unavailable: {reason}")
    return module


def unavailable(name):
    """Why backend `name` cannot run on this machine (a sentence), or None when it can."""
    reason = _module(name).unavailable()
    return f"backend {name!r} is unavailable: {reason}" if reason else None


def _module(name):
    if name not in NAMES:
        raise ValueError(f"attention: unknown backend {name!r}; choose one of {', '.join(map(repr, NAMES))} or None")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise BackendUnavailableError(f"attention: backend {name!r} is not part of this version of cuflash "
                                      f"yet") from None
