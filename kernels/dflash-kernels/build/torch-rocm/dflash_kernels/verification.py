"""Lossless verification of a drafted block, one Triton launch each, no host syncs.

Same signatures and results as the pure-PyTorch reference (`dflash_hf.generation.verification`):

- `greedy_verify(draft_ids, target_logits)`: accept drafts while they equal the target's argmax.
- `rejection_verify(draft_ids, draft_probs, target_probs, uniform, exponential)`: speculative
  rejection sampling; the random draws come in as tensors so kernel and reference agree draw for draw.

Both return `accepted` (`(batch,)`, 0..k) and `next_token` (`(batch,)`), int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_attention import interpreting

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_V = 1024
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _row_argmax(row_ptr, stride_v, vocab, BLOCK_V: tl.constexpr):
    """First index of the row's maximum, like torch.argmax (ties go to the lowest index)."""
    best_value = float("-inf")
    best_index = 0
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols * stride_v, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        value, index = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        # Strictly greater: an equal maximum in a later chunk has a higher index.
        better = value > best_value
        best_index = tl.where(better, start + index, best_index)
        best_value = tl.where(better, value, best_value)
    return best_index


@triton.jit
def _greedy_verify_kernel(
    draft_ptr, logits_ptr, target_ids_ptr, counter_ptr, accepted_ptr, next_ptr,
    stride_db, stride_dk, stride_lb, stride_lk, stride_lv,
    num_drafts, vocab,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # One program per (batch row, block position): the k + 1 argmaxes run in parallel; the last
    # program of a batch row to finish (atomic counter) turns them into `accepted` / `next_token`.
    batch = tl.program_id(0).to(tl.int64)
    position = tl.program_id(1)
    row_ptr = logits_ptr + batch * stride_lb + position * stride_lk
    tl.store(target_ids_ptr + batch * (num_drafts + 1) + position, _row_argmax(row_ptr, stride_lv, vocab, BLOCK_V))

    # acq_rel: this program's argmax is visible before the count, the last one sees them all.
    finished = tl.atomic_add(counter_ptr + batch, 1, sem="acq_rel")
    if finished == num_drafts:
        offsets = tl.arange(0, BLOCK_K)
        valid = offsets < num_drafts
        # .cg reads from L2: other SMs wrote these ids, this SM's L1 may not have seen them.
        target_ids = tl.load(target_ids_ptr + batch * (num_drafts + 1) + offsets, mask=valid, other=0,
                             cache_modifier=".cg")
        drafts = tl.load(draft_ptr + batch * stride_db + offsets * stride_dk, mask=valid, other=0)
        mismatch = valid & (drafts != target_ids)
        accepted = tl.min(tl.where(mismatch, offsets, num_drafts), 0)
        next_token = tl.load(target_ids_ptr + batch * (num_drafts + 1) + accepted, cache_modifier=".cg")
        tl.store(accepted_ptr + batch, accepted.to(tl.int64))
        tl.store(next_ptr + batch, next_token.to(tl.int64))


def _check_drafts(draft_ids: torch.Tensor, scores: torch.Tensor, name: str) -> tuple[int, int, int]:
    if not isinstance(draft_ids, torch.Tensor) or draft_ids.ndim != 2 or draft_ids.dtype != torch.long:
        raise ValueError(f"draft_ids must be a (batch, k) LongTensor, got {getattr(draft_ids, 'shape', draft_ids)!r}.")
    batch, k = draft_ids.shape
    if not isinstance(scores, torch.Tensor) or scores.ndim != 3 or tuple(scores.shape[:2]) != (batch, k + 1):
        raise ValueError(
            f"{name} must be (batch, k + 1, vocab) = ({batch}, {k + 1}, vocab), got {tuple(getattr(scores, 'shape', ()))}."
        )
    if scores.dtype not in _FLOATS:
        raise ValueError(f"{name} must be one of {_FLOATS}, got {scores.dtype}.")
    if scores.shape[2] == 0:
        raise ValueError(f"{name} has an empty vocabulary.")
    if draft_ids.device != scores.device:
        raise ValueError(f"draft_ids ({draft_ids.device}) and {name} ({scores.device}) must be on one device.")
    if scores.device.type == "cpu" and not interpreting():
        raise ValueError("dflash_kernels runs Triton kernels on GPU tensors; CPU tensors need TRITON_INTERPRET=1.")
    return batch, k, scores.shape[2]


def greedy_verify(draft_ids: torch.LongTensor, target_logits: torch.Tensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Accepts drafts while they equal the target's argmax; the argmax at the first mismatch (or
    after the last draft) is the extra token. `draft_ids` `(batch, k)`, `target_logits` `(batch, k + 1, vocab)`."""
    batch, k, vocab = _check_drafts(draft_ids, target_logits, "target_logits")
    device = target_logits.device
    accepted = torch.empty(batch, dtype=torch.long, device=device)
    next_token = torch.empty(batch, dtype=torch.long, device=device)
    if batch == 0:
        return accepted, next_token
    target_ids = torch.empty(batch, k + 1, dtype=torch.int32, device=device)
    counter = torch.zeros(batch, dtype=torch.int32, device=device)
    _greedy_verify_kernel[(batch, k + 1)](
        draft_ids, target_logits, target_ids, counter, accepted, next_token,
        *draft_ids.stride(), *target_logits.stride(),
        k, vocab,
        BLOCK_K=triton.next_power_of_2(max(k, 1)), BLOCK_V=_BLOCK_V,
    )
    return accepted, next_token


@triton.jit
def _rejection_verify_kernel(
    draft_ptr, q_ptr, p_ptr, uniform_ptr, exp_ptr, accepted_ptr, next_ptr,
    stride_db, stride_dk, stride_qb, stride_qk, stride_qv, stride_pb, stride_pk, stride_pv,
    stride_ub, stride_uk, stride_eb, stride_ev,
    num_drafts, vocab,
    ACCEPT_DTYPE: tl.constexpr, RESIDUAL_DTYPE: tl.constexpr, RATIO_DTYPE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)

    # Accept test of every draft at once: u * q(d) < p(d), the product rounded to torch's promoted dtype.
    offsets = tl.arange(0, BLOCK_K)
    valid = offsets < num_drafts
    drafts = tl.load(draft_ptr + batch * stride_db + offsets * stride_dk, mask=valid, other=0)
    q_draft = tl.load(q_ptr + batch * stride_qb + offsets * stride_qk + drafts * stride_qv, mask=valid, other=0.0)
    p_draft = tl.load(p_ptr + batch * stride_pb + offsets * stride_pk + drafts * stride_pv, mask=valid, other=0.0)
    uniform = tl.load(uniform_ptr + batch * stride_ub + offsets * stride_uk, mask=valid, other=0.0)
    u_times_q = (uniform.to(tl.float32) * q_draft.to(tl.float32)).to(ACCEPT_DTYPE).to(tl.float32)
    rejected = valid & ~(u_times_q < p_draft.to(tl.float32))
    accepted = tl.min(tl.where(rejected, offsets, num_drafts), 0)

    # One pass over the vocabulary: the exponential race over the residual max(p - q, 0) and, in
    # case the residual is all zero (p == q to rounding), over p itself.
    p_row = p_ptr + batch * stride_pb + accepted * stride_pk
    q_row = q_ptr + batch * stride_qb + accepted * stride_qk
    q_vocab = tl.where(accepted < num_drafts, vocab, 0)  # past the last draft there is no q: the residual is p
    e_row = exp_ptr + batch * stride_eb
    any_residual = False
    best_residual = float("-inf")
    best_residual_index = 0
    best_p = float("-inf")
    best_p_index = 0
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_vocab = cols < vocab
        p = tl.load(p_row + cols * stride_pv, mask=in_vocab, other=0.0).to(tl.float32)
        q = tl.load(q_row + cols * stride_qv, mask=cols < q_vocab, other=0.0).to(tl.float32)
        e = tl.load(e_row + cols * stride_ev, mask=in_vocab, other=1.0).to(tl.float32)
        # Round where torch rounds: the difference in the probs' dtype, the ratio in the promoted one.
        residual = tl.maximum((p - q).to(RESIDUAL_DTYPE).to(tl.float32), 0.0)
        any_residual = any_residual | (tl.max(tl.where(in_vocab, residual, 0.0), 0) > 0.0)
        # div_rn: IEEE-rounded division, as torch computes it (plain `/` is approximate on GPUs).
        ratio = tl.where(in_vocab, tl.math.div_rn(residual, e).to(RATIO_DTYPE).to(tl.float32), float("-inf"))
        value, index = tl.max(ratio, 0, return_indices=True, return_indices_tie_break_left=True)
        better = value > best_residual
        best_residual_index = tl.where(better, start + index, best_residual_index)
        best_residual = tl.where(better, value, best_residual)
        p_ratio = tl.where(
            in_vocab, tl.math.div_rn(p.to(RESIDUAL_DTYPE).to(tl.float32), e).to(RATIO_DTYPE).to(tl.float32),
            float("-inf"),
        )
        value, index = tl.max(p_ratio, 0, return_indices=True, return_indices_tie_break_left=True)
        better = value > best_p
        best_p_index = tl.where(better, start + index, best_p_index)
        best_p = tl.where(better, value, best_p)

    next_token = tl.where(any_residual, best_residual_index, best_p_index)
    tl.store(accepted_ptr + batch, accepted.to(tl.int64))
    tl.store(next_ptr + batch, next_token.to(tl.int64))


def rejection_verify(
    draft_ids: torch.LongTensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    exponential: torch.Tensor,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Speculative rejection sampling: accept draft i with probability min(1, p_i(d_i) / q_i(d_i));
    at the first rejection j sample from normalize(max(p_j - q_j, 0)); if all k are accepted, sample
    from p_k. Sampling is `argmax(r / exponential)` (the exponential race).

    Shapes: `draft_ids` `(batch, k)`, `draft_probs` `(batch, k, vocab)`, `target_probs`
    `(batch, k + 1, vocab)`, `uniform` `(batch, k)`, `exponential` `(batch, vocab)`.
    """
    batch, k, vocab = _check_drafts(draft_ids, target_probs, "target_probs")
    expected = {"draft_probs": (batch, k, vocab), "uniform": (batch, k), "exponential": (batch, vocab)}
    for name, tensor in (("draft_probs", draft_probs), ("uniform", uniform), ("exponential", exponential)):
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{name} must be {expected[name]}, got {tuple(getattr(tensor, 'shape', ()))}.")
        if tensor.dtype not in _FLOATS:
            raise ValueError(f"{name} must be one of {_FLOATS}, got {tensor.dtype}.")
        if tensor.device != target_probs.device:
            raise ValueError(f"{name} ({tensor.device}) and target_probs ({target_probs.device}) must be on one device.")
    device = target_probs.device
    accepted = torch.empty(batch, dtype=torch.long, device=device)
    next_token = torch.empty(batch, dtype=torch.long, device=device)
    if batch == 0:
        return accepted, next_token
    # The dtypes torch's type promotion gives each step of the reference, so that results match bit for bit.
    accept_dtype = torch.promote_types(uniform.dtype, draft_probs.dtype)
    residual_dtype = torch.promote_types(target_probs.dtype, draft_probs.dtype)
    ratio_dtype = torch.promote_types(residual_dtype, exponential.dtype)
    if k == 0:
        draft_probs = target_probs.new_zeros(batch, 1, vocab)  # never read, but needs a valid pointer
    _rejection_verify_kernel[(batch,)](
        draft_ids, draft_probs, target_probs, uniform, exponential, accepted, next_token,
        *draft_ids.stride(), *draft_probs.stride(), *target_probs.stride(), *uniform.stride(), *exponential.stride(),
        k, vocab,
        ACCEPT_DTYPE=_TL_DTYPES[accept_dtype], RESIDUAL_DTYPE=_TL_DTYPES[residual_dtype], RATIO_DTYPE=_TL_DTYPES[ratio_dtype],
        BLOCK_K=triton.next_power_of_2(max(k, 1)), BLOCK_V=_BLOCK_V,
    )
    return accepted, next_token
