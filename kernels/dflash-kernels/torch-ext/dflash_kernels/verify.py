"""Verification of a drafted block in one launch: which drafts the target accepts, and its own next token.

One program per batch row walks the block's slots in order over the vocabulary in tiles, so the
target's `(k + 1, vocab)` scores are read once and no softmax or probability tensor is written:

- `greedy_verify`: the argmax of the target at each slot (first index on ties, as `torch.argmax`),
  drafts accepted while they equal it; the argmax at the first mismatch (or after the last draft) is
  the next token. Slots after the first mismatch are not read.
- `rejection_verify`: speculative rejection sampling from the target's and the drafter's *scores*
  (softmax inside): draft j accepted when `u_j < min(1, p_j(d_j) / q_j(d_j))`; at the first rejection
  the next token is drawn from `max(p_j - q_j, 0)` (past the last draft from `p_k`) by the exponential
  race `argmax(r / e)`, with `u` and `e` drawn by the caller from torch's RNG, so that the kernel and
  its PyTorch reference (`dflash_hf.generation.verify`) consume the same randomness.

Accumulation is fp32 whatever the scores' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_V = 1024


# The smallest normal float32: exponential draws are raised to it (a draw of 0 would let a token of residual 0 win).
_TINY = 1.1754943508222875e-38


@triton.jit
def _argmax_merge(values, index, vocab, best, best_index):
    """`(best, best_index)` after one tile, as `torch.argmax` ranks: NaN above everything (the first NaN wins), else
    the tile's max and its first index (`vocab` where none), taken only if strictly greater, so an earlier tile
    keeps a tie."""
    nan = values != values
    tile_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    tile_best = tl.max(tl.where(nan, float("-inf"), values), axis=0)
    tile_index = tl.min(tl.where(tl.where(tile_nan, nan, values == tile_best), index, vocab), axis=0).to(tl.int64)
    better = (best == best) & (tile_nan | (tile_best > best))  # a NaN best is never replaced
    tile_best = tl.where(tile_nan, float("nan"), tile_best)
    return tl.where(better, tile_best, best), tl.where(better, tile_index, best_index)


@triton.jit
def _greedy_verify_kernel(
    draft_ptr, logits_ptr, accepted_ptr, next_ptr,
    stride_db, stride_dk, stride_lb, stride_lk, stride_lv,
    num_drafts, vocab,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_V)
    accepted = tl.zeros((), dtype=tl.int64)
    next_token = tl.zeros((), dtype=tl.int64)
    for slot in range(0, num_drafts + 1):
        live = accepted == slot  # every earlier draft accepted: this slot's argmax matters
        best = tl.full((), float("-inf"), dtype=tl.float32)
        best_index = tl.zeros((), dtype=tl.int64)
        base = logits_ptr + row * stride_lb + slot * stride_lk
        limit = tl.where(live, vocab, 0)  # a dead slot loads nothing
        for start in range(0, vocab, BLOCK_V):
            index = start + offsets
            values = tl.load(base + index * stride_lv, mask=index < limit, other=float("-inf")).to(tl.float32)
            best, best_index = _argmax_merge(values, index, vocab, best, best_index)
        next_token = tl.where(live, best_index, next_token)
        if slot < num_drafts:
            draft = tl.load(draft_ptr + row * stride_db + slot * stride_dk)
            accepted += (live & (draft == best_index)).to(tl.int64)
    tl.store(accepted_ptr + row, accepted)
    tl.store(next_ptr + row, next_token)


@triton.jit
def _row_softmax_stats(base, stride_v, vocab, offsets, BLOCK_V: tl.constexpr):
    """(max, sum of exp(x - max)) of one row, online over the vocabulary tiles."""
    running_max = tl.full((), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((), dtype=tl.float32)
    for start in range(0, vocab, BLOCK_V):
        index = start + offsets
        values = tl.load(base + index * stride_v, mask=index < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(values, axis=0))
        # while every score so far is -inf (a one-hot q, a top-k target) the sum stays 0, not exp(-inf + inf)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(values - shift), axis=0)
        running_max = new_max
    return running_max, running_sum


@triton.jit
def _rejection_verify_kernel(
    draft_ptr, draft_scores_ptr, target_scores_ptr, uniform_ptr, exponential_ptr, accepted_ptr, next_ptr,
    stride_db, stride_dk, stride_qb, stride_qk, stride_qv, stride_pb, stride_pk, stride_pv,
    stride_ub, stride_uk, stride_eb, stride_ev,
    num_drafts, vocab,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_V)
    accepted = tl.zeros((), dtype=tl.int64)
    for slot in range(0, num_drafts):
        p_base = target_scores_ptr + row * stride_pb + slot * stride_pk
        q_base = draft_scores_ptr + row * stride_qb + slot * stride_qk
        p_max, p_sum = _row_softmax_stats(p_base, stride_pv, vocab, offsets, BLOCK_V)
        q_max, q_sum = _row_softmax_stats(q_base, stride_qv, vocab, offsets, BLOCK_V)
        draft = tl.load(draft_ptr + row * stride_db + slot * stride_dk)
        p_draft = tl.exp(tl.load(p_base + draft * stride_pv).to(tl.float32) - p_max) / p_sum
        q_draft = tl.exp(tl.load(q_base + draft * stride_qv).to(tl.float32) - q_max) / q_sum
        # a drawn draft has q > 0; a draft of q 0 was not drawn from q and is never accepted
        ratio = tl.where(q_draft > 0, p_draft / tl.where(q_draft > 0, q_draft, 1.0), 0.0)
        ratio = tl.where(ratio > 1.0, 1.0, ratio)  # min(ratio, 1) keeping a NaN (never accepted), as torch's clamp
        uniform = tl.load(uniform_ptr + row * stride_ub + slot * stride_uk)
        accepted += ((accepted == slot) & (uniform < ratio)).to(tl.int64)

    # The next token, from the residual at the first rejected slot (or from p past the last draft).
    slot = accepted
    has_draft = slot < num_drafts
    p_base = target_scores_ptr + row * stride_pb + slot * stride_pk
    q_base = draft_scores_ptr + row * stride_qb + tl.minimum(slot, tl.maximum(num_drafts - 1, 0)) * stride_qk
    p_max, p_sum = _row_softmax_stats(p_base, stride_pv, vocab, offsets, BLOCK_V)
    q_max, q_sum = _row_softmax_stats(q_base, stride_qv, vocab, offsets, BLOCK_V)
    q_limit = tl.where(has_draft, vocab, 0)
    residual_sum = tl.zeros((), dtype=tl.float32)
    best_residual = tl.full((), -1.0, dtype=tl.float32)
    best_residual_index = tl.zeros((), dtype=tl.int64)
    best_p = tl.full((), -1.0, dtype=tl.float32)
    best_p_index = tl.zeros((), dtype=tl.int64)
    e_base = exponential_ptr + row * stride_eb
    for start in range(0, vocab, BLOCK_V):
        index = start + offsets
        valid = index < vocab
        p = tl.exp(tl.load(p_base + index * stride_pv, mask=valid, other=float("-inf")).to(tl.float32) - p_max) / p_sum
        q = tl.exp(tl.load(q_base + index * stride_qv, mask=index < q_limit, other=float("-inf")).to(tl.float32)
                   - q_max) / q_sum
        residual = tl.where(has_draft, tl.maximum(p - q, 0.0), p)
        residual_sum += tl.sum(tl.where(valid, residual, 0.0), axis=0)
        exponential = tl.maximum(tl.load(e_base + index * stride_ev, mask=valid, other=1.0), _TINY)
        # the exponential race argmax(r / e) over the residual, and over p for the case of no residual
        best_residual, best_residual_index = _argmax_merge(tl.where(valid, residual / exponential, -1.0), index, vocab,
                                                           best_residual, best_residual_index)
        best_p, best_p_index = _argmax_merge(tl.where(valid, p / exponential, -1.0), index, vocab, best_p, best_p_index)
    # p == q to rounding leaves no residual; that rejection had probability ~0, and p is its limit
    next_token = tl.where(residual_sum > 0, best_residual_index, best_p_index)
    tl.store(accepted_ptr + row, accepted)
    tl.store(next_ptr + row, next_token)


def _check(draft_ids: torch.Tensor, target_scores: torch.Tensor, name: str) -> None:
    if draft_ids.dim() != 2 or target_scores.dim() != 3:
        raise ValueError(f"{name}: draft_ids must be (batch, k) and target scores (batch, k + 1, vocab), "
                         f"got {tuple(draft_ids.shape)} and {tuple(target_scores.shape)}.")
    if target_scores.shape[:2] != (draft_ids.shape[0], draft_ids.shape[1] + 1):
        raise ValueError(f"{name}: target scores {tuple(target_scores.shape)} do not cover the "
                         f"{draft_ids.shape[1]} drafts of {draft_ids.shape[0]} rows plus one slot.")


def greedy_verify(draft_ids: torch.LongTensor, target_logits: torch.Tensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`(accepted, next_token)`, each `(batch,)`: drafts `(batch, k)` accepted while they equal the argmax of
    `target_logits` `(batch, k + 1, vocab)`, and the argmax at the first mismatch or after the last draft."""
    _check(draft_ids, target_logits, "greedy_verify")
    batch, num_drafts = draft_ids.shape
    accepted = torch.empty(batch, dtype=torch.long, device=draft_ids.device)
    next_token = torch.empty_like(accepted)
    _greedy_verify_kernel[(batch,)](
        draft_ids, target_logits, accepted, next_token,
        *draft_ids.stride(), *target_logits.stride(),
        num_drafts, target_logits.shape[-1],
        BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(target_logits.shape[-1])),
    )
    return accepted, next_token


def rejection_verify(
    draft_ids: torch.LongTensor,
    draft_scores: torch.Tensor,
    target_scores: torch.Tensor,
    uniform: torch.Tensor,
    exponential: torch.Tensor,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`(accepted, next_token)`, each `(batch,)`, by speculative rejection sampling.

    Args:
        draft_ids (`(batch, k)`, k >= 1): drafts drawn from softmax(`draft_scores`).
        draft_scores (`(batch, k, vocab)`): the drafter's processed scores.
        target_scores (`(batch, k + 1, vocab)`): the target's processed scores.
        uniform (`(batch, k)`): U[0, 1) draws for the accept tests.
        exponential (`(batch, vocab)`): Exp(1) draws for the residual sample.
    """
    _check(draft_ids, target_scores, "rejection_verify")
    batch, num_drafts = draft_ids.shape
    if num_drafts == 0 or draft_scores.shape != (batch, num_drafts, target_scores.shape[-1]):
        raise ValueError(f"rejection_verify: draft scores must be (batch, k >= 1, vocab) = "
                         f"{(batch, num_drafts, target_scores.shape[-1])}, got {tuple(draft_scores.shape)}.")
    if uniform.shape != (batch, num_drafts) or exponential.shape != (batch, target_scores.shape[-1]):
        raise ValueError(f"rejection_verify: uniform must be {(batch, num_drafts)} and exponential "
                         f"{(batch, target_scores.shape[-1])}, got {tuple(uniform.shape)} and {tuple(exponential.shape)}.")
    accepted = torch.empty(batch, dtype=torch.long, device=draft_ids.device)
    next_token = torch.empty_like(accepted)
    _rejection_verify_kernel[(batch,)](
        draft_ids, draft_scores, target_scores, uniform, exponential, accepted, next_token,
        *draft_ids.stride(), *draft_scores.stride(), *target_scores.stride(), *uniform.stride(), *exponential.stride(),
        num_drafts, target_scores.shape[-1],
        BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(target_scores.shape[-1])),
    )
    return accepted, next_token


__all__ = ["greedy_verify", "rejection_verify"]
