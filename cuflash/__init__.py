"""cuflash: FlashAttention for the CuPy and NumPy world."""
