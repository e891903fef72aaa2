"""The public DFlash kernel ops: the Triton kernel where `loader` says so, else the PyTorch reference."""

import torch

from .loader import kernels_for
from .reference import (
    block_attention_reference,
    check_block_attention_inputs,
    check_rejection_inputs,
    check_verify_inputs,
    greedy_verify_reference,
    rejection_verify_reference,
)


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


def greedy_verify(
    draft_ids: torch.LongTensor, target_logits: torch.Tensor, backend: str | None = None
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`dflash_hf.generation.verification.greedy_verify`, fused into one launch where kernels run."""
    check_verify_inputs(draft_ids, target_logits, "target_logits")
    kernels = kernels_for(target_logits, backend)
    if kernels is None:
        return greedy_verify_reference(draft_ids, target_logits)
    return kernels.greedy_verify(draft_ids, target_logits)


def rejection_verify(
    draft_ids: torch.LongTensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    exponential: torch.Tensor,
    backend: str | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`dflash_hf.generation.verification.rejection_verify`, fused into one launch where kernels run;
    both give the same tokens for the same `uniform` / `exponential` draws."""
    check_rejection_inputs(draft_ids, draft_probs, target_probs, uniform, exponential)
    kernels = kernels_for(target_probs, backend)
    if kernels is None:
        return rejection_verify_reference(draft_ids, draft_probs, target_probs, uniform, exponential)
    return kernels.rejection_verify(draft_ids, draft_probs, target_probs, uniform, exponential)
