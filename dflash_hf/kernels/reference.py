"""The pure-PyTorch reference of the DFlash block-attention kernel, and the input checks both share.

`block_attention_reference` is the semantics `dflash_kernels.block_attention` implements.
"""

import math

import torch

ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_block_attention_inputs(q, k, v, scale, sliding_window) -> None:
    """Raises ValueError for inputs outside what the kernel and the reference compute (same rules
    as the kernel's own check, which cannot import this package)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise ValueError("block_attention takes tensors q, k and v.")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"block_attention expects q [b, H, Lq, D] and k, v [b, Hkv, Lk, D], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    (batch, heads, q_len, head_dim), (kv_batch, kv_heads, kv_len, kv_dim) = q.shape, k.shape
    if kv_batch != batch or kv_dim != head_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim.")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"The {heads} query heads must be a multiple of the {kv_heads} key/value heads (GQA).")
    if q_len == 0 or q_len > kv_len:
        raise ValueError(f"Need 1 <= Lq <= Lk (the block is part of the keys), got Lq={q_len}, Lk={kv_len}.")
    if q.dtype not in ATTENTION_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of {ATTENTION_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}.")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}.")
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}.")


def block_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale [+ window mask]) v in fp32; returns `[b, Lq, H, D]` in q's dtype.

    Query i sits at sequence index `Lk - Lq + i`, key j at j. Without a window every key is visible
    (DFlash's full layers); with one, keys with `0 <= query - key < sliding_window` (its sliding layers).
    """
    check_block_attention_inputs(q, k, v, scale, sliding_window)
    q_len, kv_len = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)
    values = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * scale
    if sliding_window is not None:
        query_index = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        distance = query_index - torch.arange(kv_len, device=q.device)[None, :]
        scores = scores.masked_fill(~((distance >= 0) & (distance < sliding_window)), float("-inf"))
    output = torch.matmul(scores.softmax(dim=-1), values)
    return output.transpose(1, 2).contiguous().to(q.dtype)


__all__ = ["block_attention_reference", "check_block_attention_inputs"]
