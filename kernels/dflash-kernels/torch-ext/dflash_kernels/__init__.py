"""DFlash kernels: Triton block attention for DFlash drafters.

Loaded with the `kernels` library (`kernels.get_kernel("dflash-hf/dflash-kernels", version=1)`);
`dflash_hf.kernels` loads it for you and falls back to the PyTorch reference beside the kernel.
"""

from .block_attention import block_attention

__all__ = ["block_attention"]
