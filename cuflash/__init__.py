"""cuflash: FlashAttention for the CuPy and NumPy world.

cuflash.attention(q, k, v) computes exact attention tile by tile with an online softmax, so the n x m score
matrix never exists in memory.
"""

from . import mods
from .api import attention, attention_backward
from .blockmask import BlockMask, block_mask
from .errors import BackendUnavailableError
from .dtypes import bfloat16
from .devices import DeviceLimits
from .dropout import dropout_mask, last_seed
from .family import BlockConfig
from .merging import merge
from .paged import attention_paged
from .varlen import attention_varlen, attention_varlen_backward

__all__ = ["attention", "attention_backward", "attention_paged", "attention_varlen", "attention_varlen_backward",
           "BackendUnavailableError", "bfloat16", "BlockConfig", "BlockMask", "block_mask", "DeviceLimits",
           "dropout_mask", "last_seed", "merge", "mods"]
__version__ = "0.1.0"
