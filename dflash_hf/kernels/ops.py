"""The public DFlash kernel ops: the Triton kernels where `loader` says so, else the PyTorch references.

The verification ops' references are the accept rules themselves (`dflash_hf.generation.verify`); on an
accelerator the kernel does a block's acceptance in one launch instead of the ~10 small ops (softmaxes,
gathers, cumprod, the residual race) each of which is a launch and an idle gap between the target's
forward and the next draft."""

import torch

from .loader import kernels_for
from .reference import block_attention_reference, check_block_attention_inputs


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """DFlash block attention: q `[b, H, Lq, D]` against k, v `[b, Hkv, Lk, D]`; returns `[b, Lq, H, D]`.

    Non-causal over every key, or with `sliding_window` only keys with
    `0 <= (Lk - Lq + i) - j < sliding_window`. `backend`: `auto`, `triton` or `torch` (see `load_kernels`).
    """
    check_block_attention_inputs(q, k, v, scale, sliding_window)
    kernels = kernels_for(q, backend)
    if kernels is None:
        return block_attention_reference(q, k, v, scale, sliding_window)
    return kernels.block_attention(q, k, v, scale, sliding_window)


def verify_kernels(tensor: torch.Tensor, backend: str | None = None):
    """The kernel module whose `greedy_verify` and `rejection_verify` run on `tensor`, or None for the
    PyTorch accept rules (CPU outside the Triton interpreter, no Triton, `DFLASH_KERNELS=torch`)."""
    return kernels_for(tensor, backend)
