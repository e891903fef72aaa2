"""Lossless verification of a drafted block: the accepted prefix and the token the target adds.

Pure PyTorch, batched, no host syncs. These are the reference semantics; a fused kernel may stand
behind the same signatures. Randomness comes in as tensors (`uniform`, `exponential`) so that a
kernel and this reference can be compared draw for draw.
"""

import torch


def greedy_verify(draft_ids: torch.LongTensor, target_logits: torch.Tensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Accept drafts while they equal the target's argmax; the target's argmax at the first
    mismatch (or after the last draft) is the extra token.

    Args:
        draft_ids (`torch.LongTensor` of shape `(batch, k)`): drafted tokens.
        target_logits (`torch.Tensor` of shape `(batch, k + 1, vocab)`): the target's (processed)
            scores at the anchor and at every draft.
    Returns:
        `accepted` (`(batch,)`, 0..k) and `next_token` (`(batch,)`).
    """
    target_ids = target_logits.argmax(dim=-1)
    accepted = (draft_ids == target_ids[:, :-1]).long().cumprod(dim=-1).sum(dim=-1)
    next_token = target_ids.gather(1, accepted[:, None]).squeeze(1)
    return accepted, next_token


def rejection_verify(
    draft_ids: torch.LongTensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    exponential: torch.Tensor,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023): the committed
    tokens are distributed exactly as if sampled from the target one by one.

    Rule: accept draft i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection j
    sample from normalize(max(p_j - q_j, 0)); if all k are accepted, sample from p_k.

    Args:
        draft_ids (`(batch, k)`): drafts, each drawn from `draft_probs` (a one-hot q is fine).
        draft_probs (`(batch, k, vocab)`): q, the distributions the drafts were drawn from.
        target_probs (`(batch, k + 1, vocab)`): p, the target's distributions after the same processing.
        uniform (`(batch, k)`): U[0, 1) draws for the accept tests.
        exponential (`(batch, vocab)`): Exp(1) draws; `argmax(r / exponential)` samples from r
            (the exponential race), so the residual needs no normalisation.
    Returns:
        `accepted` (`(batch,)`, 0..k) and `next_token` (`(batch,)`).
    """
    batch, k = draft_ids.shape
    p_draft = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
    # u < p/q, written without the division (q > 0 for a drawn draft; p = 0 always rejects)
    is_accepted = uniform * q_draft < p_draft
    accepted = is_accepted.long().cumprod(dim=-1).sum(dim=-1)

    index = accepted[:, None, None].expand(batch, 1, target_probs.shape[-1])
    p_next = target_probs.gather(1, index).squeeze(1)
    # Past the last draft there is no q: the residual is p itself.
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])], dim=1)
    residual = (p_next - q_padded.gather(1, index).squeeze(1)).clamp_min(0)
    # p == q to rounding leaves no residual; the rejection then had probability ~0, p is the limit.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_next)
    next_token = (residual / exponential).argmax(dim=-1)
    return accepted, next_token


def sampling_noise(batch: int, k: int, vocab: int, device=None, generator: torch.Generator | None = None):
    """The random draws `rejection_verify` consumes, from torch's RNG (seeded by torch.manual_seed)."""
    uniform = torch.rand(batch, k, device=device, generator=generator)
    exponential = torch.empty(batch, vocab, device=device).exponential_(generator=generator)
    return uniform, exponential
