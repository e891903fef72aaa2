"""Block attention for DFlash drafters: a small block of queries against `[context ; block]` keys.

Queries `q` are `[b, H, Lq, D]` (Lq = block size, 2..32), keys/values `[b, Hkv, Lk, D]`. Query i sits
at sequence index `Lk - Lq + i`, key j at index j. Full layers see every key (no causal mask: the
block is bidirectional); sliding layers see keys with `0 <= query - key < sliding_window`.

One program handles one KV head and a tile of the rows `(q head of that group, block slot)`, so
every GQA group reads each key/value once. Long contexts are split over the KV axis
(flash-decoding): each split writes a partial output and its log-sum-exp, a second small kernel
merges them. Accumulation is fp32 whatever the input dtype.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634


@triton.jit
def _block_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_ps, stride_pb, stride_ph, stride_pm, stride_pd,
    stride_ls, stride_lb, stride_lh, stride_lm,
    num_kv_heads, q_len, kv_len, head_dim, group, kv_start, split_len,
    qk_scale, window,
    SLIDING: tl.constexpr, SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # int64: batch * stride may pass 2**31 on long contexts
    pid_s = tl.program_id(2)
    batch = pid_bh // num_kv_heads
    kv_head = pid_bh % num_kv_heads

    # Row r of the tile is (head `r // q_len` of this KV head's group, block slot `r % q_len`).
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < group * q_len
    head = kv_head * group + rows // q_len
    slot = rows % q_len
    q_pos = kv_len - q_len + slot
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim

    q = tl.load(
        q_ptr + batch * stride_qb + head[:, None] * stride_qh + slot[:, None] * stride_qm + dims[None, :] * stride_qd,
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    start = kv_start + pid_s * split_len
    end = tl.minimum(start + split_len, kv_len)
    for block_start in range(start, end, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)
        key_valid = keys < end
        k_t = tl.load(
            k_base + keys[None, :] * stride_kn + dims[:, None] * stride_kd,
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        if FP32_DOT:
            # fp32 inputs would otherwise be rounded to tf32 on the tensor cores.
            qk = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
        else:
            qk = tl.dot(q, k_t)
        allowed = key_valid[None, :]
        if SLIDING:
            distance = q_pos[:, None] - keys[None, :]
            allowed = allowed & (distance >= 0) & (distance < window)
        qk = tl.where(allowed, qk * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row may see no key of this block (or split) yet: keep its statistics finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + keys[:, None] * stride_vn + dims[None, :] * stride_vd,
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if SPLIT:
        # Partial results in fp32 and the log2-sum-exp of each row, merged by `_merge_splits_kernel`.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        part = pid_s * stride_ps + batch * stride_pb + head * stride_ph + slot * stride_pm
        tl.store(out_ptr + part[:, None] + dims[None, :] * stride_pd, out, mask=store_mask)
        lse_offset = pid_s * stride_ls + batch * stride_lb + head * stride_lh + slot * stride_lm
        tl.store(lse_ptr + lse_offset, lse, mask=row_valid)
    else:
        o = out_ptr + batch * stride_ob + slot[:, None] * stride_om + head[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(o, out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_ps, stride_pb, stride_ph, stride_pm, stride_pd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lh, stride_lm,
    num_heads, q_len, head_dim, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # one (batch, head, slot) row per program
    batch = row // (num_heads * q_len)
    head = (row // q_len) % num_heads
    slot = row % q_len
    splits = tl.arange(0, BLOCK_S)
    split_valid = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim

    lse_offset = splits * stride_ls + batch * stride_lb + head * stride_lh + slot * stride_lm
    lse = tl.load(lse_ptr + lse_offset, mask=split_valid, other=float("-inf"))
    lse_max = tl.max(lse, 0)  # finite: every query sees at least itself
    weight = tl.math.exp2(lse - lse_max)
    part = tl.load(
        part_ptr + splits[:, None] * stride_ps + batch * stride_pb + head * stride_ph + slot * stride_pm
        + dims[None, :] * stride_pd,
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    o = out_ptr + batch * stride_ob + slot * stride_om + head * stride_oh + dims * stride_od
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=dim_valid)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors): TRITON_INTERPRET=1."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def check_block_attention_inputs(q, k, v, scale, sliding_window) -> None:
    """Raises ValueError for inputs outside what the kernel (and its reference) computes."""
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
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of {_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}.")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}.")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}.")


def _default_num_splits(programs: int, kv_range: int, block_n: int, device: torch.device) -> int:
    """Enough KV splits to give every SM about two programs, each split at least 4 key blocks long."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * sms, programs)
    return max(1, min(wanted, kv_range // (4 * block_n), 64))


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale [+ window mask]) v for a DFlash block; returns `[b, Lq, H, D]`.

    Args:
        q (`torch.Tensor` of shape `(b, H, Lq, D)`): the block's queries.
        k, v (`torch.Tensor` of shape `(b, Hkv, Lk, D)`): `[cached context ; new context ; block]`.
        scale (`float`): softmax scale (usually `D ** -0.5`).
        sliding_window (`int`, *optional*): keys with `0 <= (Lk - Lq + i) - j < sliding_window` only.
        num_splits (`int`, *optional*): KV splits (flash-decoding); picked from the SM count when None.
    """
    check_block_attention_inputs(q, k, v, scale, sliding_window)
    if q.device.type == "cpu" and not interpreting():
        raise ValueError("dflash_kernels runs Triton kernels on GPU tensors; CPU tensors need TRITON_INTERPRET=1.")
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    out = torch.empty(batch, q_len, heads, head_dim, dtype=q.dtype, device=q.device)

    # tl.dot needs every tile dimension >= 16.
    block_m = max(16, min(64, triton.next_power_of_2(group * q_len)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32
    # Sliding layers never look further back than the window from the first block slot.
    kv_start = 0 if sliding_window is None else max(0, kv_len - q_len - sliding_window + 1)
    kv_range = kv_len - kv_start
    m_tiles = triton.cdiv(group * q_len, block_m)
    if num_splits is None:
        num_splits = _default_num_splits(m_tiles * batch * kv_heads, kv_range, block_n, q.device)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}.")
    split_len = triton.cdiv(triton.cdiv(kv_range, num_splits), block_n) * block_n
    num_splits = triton.cdiv(kv_range, split_len)  # no empty trailing split

    # Triton's CPU interpreter multiplies bfloat16 tiles wrongly (3.9: numpy has no bfloat16), so
    # there they are upcast first; on GPUs bf16/fp16 tiles go to the tensor cores as they are.
    fp32_dot = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreting())
    if num_splits > 1:
        partial = torch.empty(num_splits, batch, heads, q_len, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_splits, batch, heads, q_len, dtype=torch.float32, device=q.device)
        target, target_strides = partial, partial.stride()
    else:
        partial = lse = out.new_empty(0, dtype=torch.float32)
        target, target_strides = out, (0,) * 5
    _block_attention_kernel[(m_tiles, batch * kv_heads, num_splits)](
        q, k, v, target, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *target_strides,
        *(lse.stride() if num_splits > 1 else (0,) * 4),
        kv_heads, q_len, kv_len, head_dim, group, kv_start, split_len,
        scale * _LOG2E, sliding_window or 0,
        SLIDING=sliding_window is not None, SPLIT=num_splits > 1, FP32_DOT=fp32_dot,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch * heads * q_len,)](
            partial, lse, out,
            *partial.stride(), *out.stride(), *lse.stride(),
            heads, q_len, head_dim, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out
