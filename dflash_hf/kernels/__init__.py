"""Kernels for DFlash: block attention for the drafter and fused draft verification.

The Triton kernels live in a Hub kernel repository (`kernels/dflash-kernels` in this source tree,
`dflash-hf/dflash-kernels` on the Hub) loaded with the `kernels` library; each has a PyTorch
reference here that runs wherever the kernels cannot (CPU, no Triton, `DFLASH_KERNELS=torch`).

    from dflash_hf.kernels import use_dflash_attention
    use_dflash_attention(drafter)          # drafter attention through the block kernel
"""

from .attention import ATTENTION_NAME, dflash_block_attention_forward, register_dflash_attention, use_dflash_attention
from .loader import BACKENDS, ENV_VAR, HUB_REPO_ID, HUB_VERSION, load_kernels, local_kernel_repo, resolve_backend
from .ops import block_attention, greedy_verify, rejection_verify
from .reference import block_attention_reference, greedy_verify_reference, rejection_verify_reference

__all__ = [
    "ATTENTION_NAME",
    "BACKENDS",
    "ENV_VAR",
    "HUB_REPO_ID",
    "HUB_VERSION",
    "block_attention",
    "block_attention_reference",
    "dflash_block_attention_forward",
    "greedy_verify",
    "greedy_verify_reference",
    "load_kernels",
    "local_kernel_repo",
    "register_dflash_attention",
    "rejection_verify",
    "rejection_verify_reference",
    "resolve_backend",
    "use_dflash_attention",
]
