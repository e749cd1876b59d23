"""The numpy backend: the blocked algorithm (cuflash/blocked.py) on NumPy arrays."""

from __future__ import annotations

from ..blocked import run, run_backward

ARRAYS = "numpy"
__all__ = ["ARRAYS", "run", "run_backward", "unavailable"]


def unavailable():
    return None
