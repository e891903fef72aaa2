"""Accept rules: which proposed tokens the target commits, and the one token it adds of its own.

Greedy decoding keeps the longest prefix of the proposal that equals the target's argmax. Sampling keeps
the output distributed exactly as the target's own sampling by speculative rejection sampling, which
holds for any proposal distribution q *fixed before its tokens are drawn*: how many tokens are proposed,
and from which q, may depend on anything known before the draw (the drafter's distributions, the call's
statistics), never on the drawn tokens themselves.

These functions are the PyTorch reference of the verification kernel (`dflash_kernels.greedy_verify`,
`rejection_verify`) and its fallback; `verify` runs the kernel where it loads on an accelerator (on CPU
tensors, in Triton's interpreter, only with `DFLASH_KERNELS=triton`). Every tensor has a leading batch dimension.
"""

from __future__ import annotations

import torch

# Absolute and guarded: this module is also part of the exported custom_generate file (transformers refuses
# relative imports there and skips guarded ones), which then uses the kernels only where dflash-hf is installed.
try:
    from dflash_hf.kernels.loader import resolve_backend
    from dflash_hf.kernels.ops import verify_kernels
except ImportError:
    resolve_backend = verify_kernels = None


# The smallest normal float32: exponential draws are raised to it, so that a token of residual 0 never wins the race.
TINY = torch.finfo(torch.float32).tiny


def greedy_verify(draft_ids: torch.LongTensor, target_logits: torch.Tensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Accept drafts while they equal the target's argmax; the target's argmax at the first mismatch
    (or after the last draft) is the extra token.

    Args:
        draft_ids (`torch.LongTensor` of shape `(batch, k)`): proposed tokens.
        target_logits (`torch.Tensor` of shape `(batch, k + 1, vocab)`): the target's (processed) scores at
            the anchor and at every draft.
    Returns:
        `accepted` (`(batch,)`, 0..k) and `next_token` (`(batch,)`).
    """
    target_ids = target_logits.argmax(dim=-1)
    accepted = (draft_ids == target_ids[:, :-1]).long().cumprod(dim=-1).sum(dim=-1)
    next_token = target_ids.gather(1, accepted[:, None]).squeeze(1)
    return accepted, next_token


def rejection_terms(
    draft_ids: torch.LongTensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two distributions rejection sampling draws from: the chance that each draft is accepted,
    min(1, p_j(d_j) / q_j(d_j)), and where the committed token comes from if slot j is the first one not
    accepted, max(p_j - q_j, 0) (past the last draft, p itself; unnormalised).

    Args:
        draft_ids (`(batch, k)`), draft_probs (`(batch, k, vocab)`), target_probs (`(batch, k + 1, vocab)`):
            see `rejection_verify`.
    Returns:
        `accept_probs` (`(batch, k)`) and `residuals` (`(batch, k + 1, vocab)`).
    """
    p_draft = target_probs[:, :-1].gather(-1, draft_ids[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
    # a drawn draft has q > 0; a draft of q 0 was not drawn from q and is never accepted
    accept_probs = torch.where(q_draft > 0, p_draft / q_draft, 0.0).clamp(max=1.0)
    residuals = torch.cat([(target_probs[:, :-1] - draft_probs).clamp_min(0), target_probs[:, -1:]], dim=1)
    # p == q to rounding leaves no residual; that rejection had probability ~0, and p is its limit
    return accept_probs, torch.where(residuals.sum(dim=-1, keepdim=True) > 0, residuals, target_probs)


def rejection_verify(
    draft_ids: torch.LongTensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    exponential: torch.Tensor,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023): the committed tokens are
    distributed exactly as if sampled from the target one by one.

    Rule: accept draft j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection j sample from
    normalize(max(p_j - q_j, 0)); if all k are accepted, sample from p_k.

    Args:
        draft_ids (`(batch, k)`): drafts, each drawn from `draft_probs` (a one-hot q is fine).
        draft_probs (`(batch, k, vocab)`): q, the distributions the drafts were drawn from.
        target_probs (`(batch, k + 1, vocab)`): p, the target's distributions after the same processing.
        uniform (`(batch, k)`): U[0, 1) draws for the accept tests.
        exponential (`(batch, vocab)`): Exp(1) draws; `argmax(r / exponential)` samples from r (the
            exponential race), so the residual needs no normalisation. Draws below `TINY` count as `TINY`.
    Returns:
        `accepted` (`(batch,)`, 0..k) and `next_token` (`(batch,)`).
    """
    accept_probs, residuals = rejection_terms(draft_ids, draft_probs, target_probs)
    accepted = (uniform < accept_probs).long().cumprod(dim=-1).sum(dim=-1)
    index = accepted[:, None, None].expand(-1, 1, residuals.shape[-1])
    # a draw of exactly 0 (exponential_ returns one now and then) would make 0 / 0 = NaN, which argmax picks
    next_token = (residuals.gather(1, index).squeeze(1) / exponential.clamp_min(TINY)).argmax(dim=-1)
    return accepted, next_token


def sampling_noise(batch: int, k: int, vocab: int, device=None, generator: torch.Generator | None = None):
    """The random draws `rejection_verify` consumes, from torch's RNG (seeded by torch.manual_seed)."""
    uniform = torch.rand(batch, k, device=device, generator=generator)
    exponential = torch.empty(batch, vocab, device=device).exponential_(generator=generator)
    return uniform, exponential


def match_verify(draft_ids: torch.LongTensor, target_probs: torch.Tensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The reference implementation's rule: sample the target at every slot independently and keep the drafts
    while they equal those samples (exact for any proposal fixed before the samples; accepts less)."""
    sampled = torch.multinomial(target_probs.flatten(0, 1), num_samples=1).view(target_probs.shape[:2])
    accepted = (draft_ids == sampled[:, :-1]).long().cumprod(dim=-1).sum(dim=-1)
    return accepted, sampled.gather(1, accepted[:, None]).squeeze(1)


def verify(draft_ids: torch.LongTensor, draft_scores: torch.Tensor | None, target_scores: torch.Tensor,
           do_sample: bool) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`(accepted, next_token)`, each `(batch,)`: the greedy prefix match, or exact sampling from the processed
    `target_scores` (`(batch, k + 1, vocab)`) given the scores q the drafts were drawn from (`None`: the "match"
    rule; no drafts: a plain sample, as plain `generate` draws it)."""
    # CPU tensors ask for the kernels only when told to: under `auto` the loader would warn every CPU user that
    # no GPU is there, and the interpreter is for tests of the kernel, not for decoding.
    on_cpu = target_scores.device.type == "cpu"
    wanted = verify_kernels is not None and (not on_cpu or resolve_backend() == "triton")
    kernels = verify_kernels(target_scores) if wanted else None
    if not do_sample:
        if kernels is not None:
            return kernels.greedy_verify(draft_ids, target_scores)
        return greedy_verify(draft_ids, target_scores)
    if draft_ids.shape[1] == 0:
        probs = target_scores.softmax(dim=-1)
        return draft_ids.new_zeros(draft_ids.shape[0]), torch.multinomial(probs[:, 0], num_samples=1)[:, 0]
    if draft_scores is None:
        return match_verify(draft_ids, target_scores.softmax(dim=-1))
    batch, k, vocab = draft_scores.shape
    uniform, exponential = sampling_noise(batch, k, vocab, device=target_scores.device)
    if kernels is not None:  # the same draws: kernel and reference sample the same tokens
        return kernels.rejection_verify(draft_ids, draft_scores, target_scores, uniform, exponential)
    return rejection_verify(draft_ids, draft_scores.softmax(dim=-1), target_scores.softmax(dim=-1), uniform, exponential)


__all__ = ["TINY", "greedy_verify", "match_verify", "rejection_terms", "rejection_verify", "sampling_noise", "verify"]
