"""Kernels for DFlash: block attention for the drafter, and the verification of a drafted block.

The Triton kernel lives in a Hub kernel repository (`kernels/dflash-kernels` in this source tree,
`dflash-hf/dflash-kernels` on the Hub) loaded with the `kernels` library; its PyTorch reference here
runs wherever the kernel cannot (CPU, no Triton, `DFLASH_KERNELS=torch`).

    from dflash_hf.kernels import use_dflash_attention
    use_dflash_attention(drafter)          # drafter attention through the block kernel
"""

from .attention import ATTENTION_NAME, dflash_block_attention_forward, register_dflash_attention, use_dflash_attention
from .loader import BACKENDS, ENV_VAR, HUB_REPO_ID, HUB_VERSION, load_kernels, local_kernel_repo, resolve_backend
from .ops import block_attention, verify_kernels
from .reference import block_attention_reference

__all__ = [
    "ATTENTION_NAME",
    "BACKENDS",
    "ENV_VAR",
    "HUB_REPO_ID",
    "HUB_VERSION",
    "block_attention",
    "block_attention_reference",
    "dflash_block_attention_forward",
    "load_kernels",
    "local_kernel_repo",
    "register_dflash_attention",
    "resolve_backend",
    "use_dflash_attention",
    "verify_kernels",
]
