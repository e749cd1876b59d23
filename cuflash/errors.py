"""The errors cuflash raises beyond Python's own, in a module that imports nothing of the package."""


class BackendUnavailableError(RuntimeError):
    """The chosen backend cannot run on this machine; the message says why."""
