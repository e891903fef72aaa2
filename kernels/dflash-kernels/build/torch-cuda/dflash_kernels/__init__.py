"""DFlash kernels: Triton block attention for DFlash drafters and fused draft verification.

Loaded with the `kernels` library (`kernels.get_kernel("dflash-hf/dflash-kernels", version=1)`);
`dflash_hf.kernels` loads it for you and falls back to the PyTorch reference beside each kernel.
"""

from .block_attention import block_attention
from .verification import greedy_verify, rejection_verify

__all__ = ["block_attention", "greedy_verify", "rejection_verify"]
