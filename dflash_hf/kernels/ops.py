"""The public DFlash kernel op: the Triton kernel where `loader` says so, else the PyTorch reference.

(Verification kernels were removed: verification is a few small tensor ops in the decoding loop,
`dflash_hf.generation.decoding` and `verify`, that never showed up in a profile.)"""

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
