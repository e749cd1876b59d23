"""Scripts that measure and model cuflash, each run as a module from the repository root:

    python -m bench.attention ...       # timing beside naive attention and PyTorch's SDPA (the attention/ package)
    python -m bench.io_model ...        # the I/O and memory model's tables and plots
    python -m bench.compile_report ...  # registers and shared memory of every kernel variant, compiled by NVRTC

`python -m` puts the current folder first on the import path, so from the root a script imports this
checkout's cuflash whatever is installed; run by its file name it would see only an installed one.
"""
