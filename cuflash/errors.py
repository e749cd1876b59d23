"""The errors cuflash raises beyond Python's own, in a module that imports nothing of the package."""


class BackendUnavailableError(RuntimeError):
    """The chosen backend cannot run on this machine; the message says why.

    A ``RuntimeError``: no CUDA device, CuPy not installed, no C++ compiler for the emulator.

    Examples
    --------
    >>> import cuflash
    >>> try:
    ...     limits = cuflash.DeviceLimits.of()             # the current GPU's limits, through CuPy
    ... except cuflash.BackendUnavailableError:
    ...     limits = cuflash.DeviceLimits.known("H100")     # no usable GPU here: plan for one instead
    """
