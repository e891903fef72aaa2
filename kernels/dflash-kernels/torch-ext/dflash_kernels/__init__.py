"""DFlash kernels: Triton block attention for DFlash drafters and the verification of a drafted block.

Loaded with the `kernels` library (`kernels.get_kernel("dflash-hf/dflash-kernels", version=2)`);
`dflash_hf.kernels` loads it for you and falls back to the PyTorch references beside the kernels.
"""

from .block_attention import block_attention
from .verify import greedy_verify, rejection_verify

__all__ = ["block_attention", "greedy_verify", "rejection_verify"]
