"""What a GPU allows a thread block: DeviceLimits, read from a device through CuPy or taken from the table of
known GPUs (KNOWN), so that planning works for a device that is not present as well as for the one that is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from .errors import BackendUnavailableError

KiB = 1024


def fmt_bytes(nbytes: int) -> str:
    return f"{nbytes // KiB} KiB" if nbytes % KiB == 0 else f"{nbytes / KiB:.1f} KiB"


@dataclass(frozen=True)
class DeviceLimits:
    """What a GPU allows a thread block; read from the device, or one of the known GPUs for planning without it.

    The planner (``cuflash.tiling.plan``) reads these to choose a kernel and its tiles and to say why a forced
    configuration cannot run.

    Attributes
    ----------
    name : str
        The GPU's name.
    compute_capability : tuple of (int, int)
        For example (8, 0) for an A100.
    sm_count : int
        Streaming multiprocessors.
    smem_per_block, smem_per_sm : int
        The opt-in maximum of dynamic shared memory per block, and the shared memory of an SM, in bytes.
    regs_per_sm, regs_per_thread, max_threads_per_sm, max_blocks_per_sm, max_threads_per_block : int
        The SM's and a block's other limits.

    Examples
    --------
    >>> import cuflash
    >>> a100 = cuflash.DeviceLimits.known("A100")
    >>> a100.sm_count, a100.smem_per_block // 1024
    (108, 163)
    """

    name: str
    compute_capability: Tuple[int, int]
    sm_count: int
    smem_per_block: int  # opt-in maximum of dynamic shared memory per block
    smem_per_sm: int
    regs_per_sm: int = 65536
    regs_per_thread: int = 255
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    max_threads_per_block: int = 1024
    smem_default: int = 48 * KiB  # what a block gets without opting in
    smem_reserved_per_block: int = 1024  # the system's share of each block's shared memory (sm_80 and later)

    @property
    def fp64_tensor_cores(self) -> bool:
        """Whether float64 tensor cores (DMMA) run at full rate: the data-center GPUs of compute capability 8.0
        (A100), 9.0 (H100, H200) and 10.0. Others execute mma.m8n8k4.f64 too, but slowly."""
        return tuple(self.compute_capability) in ((8, 0), (9, 0), (10, 0))

    @property
    def arch(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"

    @classmethod
    def known(cls, name: str) -> "DeviceLimits":
        """A GPU of the table by a part of its name, case-insensitive: "A100", "h100", "RTX 4090".

        Known: T4, V100, A10, RTX 3090, A100, L4, RTX 4090, H100, H200; for planning for a GPU you do not have.

        Examples
        --------
        >>> import cuflash
        >>> h100 = cuflash.DeviceLimits.known("h100")
        >>> h100.name, h100.compute_capability, h100.smem_per_block // 1024
        ('H100', (9, 0), 227)
        """
        key = name.lower().replace("nvidia", "").strip()
        for exact in (True, False):  # "A10" is the A10, not the A100
            for limits in KNOWN:
                known = limits.name.lower()
                if key and (known == key or known.endswith(" " + key) if exact else key in known):
                    return limits
        names = ", ".join(limits.name for limits in KNOWN)
        raise ValueError(f"unknown GPU {name!r}; known: {names}")

    @classmethod
    def of(cls, device=None) -> "DeviceLimits":
        """The limits of a CUDA device (a cupy.cuda.Device, an id, or None for the current one), read through CuPy;
        BackendUnavailableError when CuPy is missing or finds no usable device (no driver, no GPU):
        DeviceLimits.known plans for a GPU without one."""
        try:
            import cupy
        except ImportError as exc:
            raise BackendUnavailableError(
                f"DeviceLimits.of: reading a GPU's limits needs CuPy ({exc}); pip install cupy-cuda12x, or plan "
                f"for a GPU you do not have with DeviceLimits.known(name)") from None
        try:
            if device is None:
                device = cupy.cuda.Device()
            index = device.id if hasattr(device, "id") else int(device)
            return _device_limits(index)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise BackendUnavailableError(
                f"DeviceLimits.of: CUDA is not usable here ({exc}); plan for a GPU you do not have with "
                f"DeviceLimits.known(name)") from None


def _device_limits(index: int) -> DeviceLimits:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    cc = (int(props["major"]), int(props["minor"]))
    return DeviceLimits(
        name=name, compute_capability=cc, sm_count=int(props["multiProcessorCount"]),
        smem_per_block=int(props.get("sharedMemPerBlockOptin", props.get("sharedMemPerBlock", 48 * KiB))),
        smem_per_sm=int(props["sharedMemPerMultiprocessor"]),
        regs_per_sm=int(props["regsPerMultiprocessor"]),
        max_threads_per_sm=int(props["maxThreadsPerMultiProcessor"]),
        max_blocks_per_sm=int(props.get("maxBlocksPerMultiProcessor", 16)),
        max_threads_per_block=int(props["maxThreadsPerBlock"]),
        smem_reserved_per_block=int(props.get("reservedSharedMemPerBlock", 1024 if cc >= (8, 0) else 0)),
    )


# Known GPUs (CUDA C Programming Guide, compute capabilities table; SM counts of the common SKUs).
KNOWN = (
    DeviceLimits("Tesla V100", (7, 0), 80, 98304, 98304, max_blocks_per_sm=32, smem_reserved_per_block=0),
    DeviceLimits("Tesla T4", (7, 5), 40, 65536, 65536, max_threads_per_sm=1024, max_blocks_per_sm=16,
                 smem_reserved_per_block=0),
    DeviceLimits("A100", (8, 0), 108, 166912, 167936),
    DeviceLimits("A10", (8, 6), 72, 101376, 102400, max_threads_per_sm=1536, max_blocks_per_sm=16),
    DeviceLimits("GeForce RTX 3090", (8, 6), 82, 101376, 102400, max_threads_per_sm=1536, max_blocks_per_sm=16),
    DeviceLimits("L4", (8, 9), 58, 101376, 102400, max_threads_per_sm=1536, max_blocks_per_sm=24),
    DeviceLimits("GeForce RTX 4090", (8, 9), 128, 101376, 102400, max_threads_per_sm=1536, max_blocks_per_sm=24),
    DeviceLimits("H100", (9, 0), 132, 232448, 233472),
    DeviceLimits("H200", (9, 0), 132, 232448, 233472),
)
