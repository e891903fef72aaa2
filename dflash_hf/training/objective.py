"""The DFlash training objective: anchors, the block attention mask, and the weighted block loss.

For one sequence of `L` tokens with a loss mask (1 on response tokens):
- anchors are positions `i` with `loss_mask[i]` and `loss_mask[i + 1]` (up to `max_anchors`,
  sampled afresh at every step);
- each anchor gets a block `[token i, MASK x (B - 1)]` at positions `i .. i + B - 1`, embedded with the
  target's frozen input embeddings; slot `k` predicts token `i + k` (slot 0 has no loss);
- every block's queries see the target-context features of positions `< i` and their own block
  (bidirectionally on full-attention layers, causally on sliding-window layers, whose context is also
  windowed), never other blocks;
- the loss is cross-entropy weighted by `exp(-(k - 1) / gamma)`, normalised by the sum of the weights
  of the slots that have a label.

All blocks of a batch go through the drafter in one forward: queries `[b, A * B]`, keys
`[context (L) ; blocks (A * B)]`: the drafter's own forward under the mask `block_attention_allowed` builds.
"""

from __future__ import annotations

import math

import torch
from torch import nn

IGNORE = -100


def default_gamma(block_size: int) -> float:
    """gamma of the loss decay: 7 for block 16, 4 for block 8 (published recipes), linear in between."""
    if block_size >= 16:
        return 7.0
    if block_size <= 8:
        return 4.0
    return 4.0 + 3.0 * (block_size - 8) / 8


def slot_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """`[B]` weights: 0 for the anchor slot, `exp(-(k - 1) / gamma)` for slot k >= 1."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions `i` whose token and next token are both in the loss mask (1-D mask in, 1-D ids out)."""
    mask = loss_mask.bool()
    valid = mask[:-1] & mask[1:]
    return valid.nonzero().flatten()


def sample_anchors(
    loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Up to `max_anchors` valid anchor positions, drawn without replacement, sorted."""
    positions = valid_anchor_positions(loss_mask)
    if positions.numel() > max_anchors:
        keep = torch.randperm(positions.numel(), generator=generator)[:max_anchors]
        positions = positions[keep].sort().values
    return positions


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    max_anchors: int,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Anchors and block tensors for a right-padded batch.

    Returns `anchors [b, A]` (-1 for padding blocks), `block_ids [b, A * B]`, `block_positions [b, A * B]`,
    `labels [b, A * B]` (IGNORE where there is no loss), with `A` the most anchors of any sequence.
    """
    batch = input_ids.shape[0]
    per_seq = []
    for row in range(batch):
        length = int(lengths[row])
        per_seq.append(sample_anchors(loss_mask[row, :length], max_anchors, generator))
    num_anchors = max(1, max(int(a.numel()) for a in per_seq))
    anchors = torch.full((batch, num_anchors), -1, dtype=torch.long)
    for row, positions in enumerate(per_seq):
        anchors[row, : positions.numel()] = positions

    offsets = torch.arange(block_size)
    real = anchors >= 0
    base = anchors.clamp(min=0)
    positions = base[:, :, None] + offsets  # [b, A, B]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, base)
    gathered = torch.gather(input_ids, 1, positions.clamp(max=input_ids.shape[1] - 1).flatten(1)).view_as(positions)
    in_loss = torch.gather(loss_mask.long(), 1, positions.clamp(max=input_ids.shape[1] - 1).flatten(1)).view_as(positions)
    labeled = (positions < lengths[:, None, None]) & in_loss.bool() & real[:, :, None]
    labeled[:, :, 0] = False
    labels = torch.where(labeled, gathered, torch.full_like(gathered, IGNORE))
    return {
        "anchors": anchors,
        "block_ids": block_ids.flatten(1),
        "block_positions": positions.flatten(1),
        "labels": labels.flatten(1),
    }


def block_attention_allowed(
    anchors: torch.Tensor, context_len: int, block_size: int, sliding_window: int | None = None
) -> torch.Tensor:
    """Boolean `[b, 1, A * B, context_len + A * B]`: may query (block a, slot k) see the key?

    Context key `t`: `t < anchor` (and, on sliding layers, `anchor + k - t < sliding_window`).
    Block key (block a', slot s): `a' == a` (and, on sliding layers, `s <= k`).
    Padding blocks (anchor -1) see only themselves.
    """
    batch, num_anchors = anchors.shape
    device = anchors.device
    query_slot = torch.arange(block_size, device=device).repeat(num_anchors)  # [Q]
    query_block = torch.arange(num_anchors, device=device).repeat_interleave(block_size)  # [Q]
    context = context_allowed(anchors, context_len, block_size, sliding_window)[:, 0]  # [b, Q, Lc]
    same_block = query_block[:, None] == query_block[None, :]  # [Q, Q]
    if sliding_window is not None:
        same_block &= query_slot[None, :] <= query_slot[:, None]
    in_block = same_block[None].expand(batch, -1, -1)
    return torch.cat([context, in_block], dim=-1)[:, None]


def context_allowed(anchors: torch.Tensor, context_len: int, block_size: int, sliding_window: int | None = None):
    """The context columns of `block_attention_allowed`: `[b, 1, A * B, context_len]`."""
    batch, num_anchors = anchors.shape
    slots = torch.arange(block_size, device=anchors.device)
    query_anchor = anchors[:, :, None].expand(batch, num_anchors, block_size).reshape(batch, -1)
    t = torch.arange(context_len, device=anchors.device)
    allowed = t[None, None, :] < query_anchor[:, :, None]
    if sliding_window is not None:
        query_position = query_anchor + slots.repeat(num_anchors)[None]
        allowed &= (query_position[:, :, None] - t[None, None, :]) < sliding_window
    return allowed[:, None]


def drafter_block_forward(
    drafter, block_embeds: torch.Tensor, target_hidden: torch.Tensor, anchors: torch.Tensor, block_positions: torch.Tensor
) -> torch.Tensor:
    """The drafter's own forward over all blocks at once, under the training block mask.

    Keys are `[context (L) ; blocks (A * B)]` at rotary positions `[0..L-1 ; block positions]`; each
    block's queries see the context before its anchor and their own block (`block_attention_allowed`),
    as if each block were drafted alone after its anchor.
    """
    model = _unwrap(drafter)
    config = model.config
    batch, context_len = target_hidden.shape[:2]
    anchors = anchors.to(target_hidden.device)
    context_positions = torch.arange(context_len, device=target_hidden.device)[None].expand(batch, -1)
    position_ids = torch.cat([context_positions, block_positions.to(target_hidden.device)], dim=1)
    masks = {"full_attention": block_attention_allowed(anchors, context_len, config.block_size)}
    if "sliding_attention" in config.layer_types:
        masks["sliding_attention"] = block_attention_allowed(anchors, context_len, config.block_size, config.sliding_window)
    output = model(noise_embeds=block_embeds, context_hidden_states=target_hidden, position_ids=position_ids,
                   attention_mask=masks)
    return output.last_hidden_state


class BlockTrainingModule(nn.Module):
    """Wraps the drafter so that the block forward goes through `__call__` (what DDP and other
    accelerate wrappers need to synchronise gradients)."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    @property
    def config(self):
        return self.drafter.config

    def forward(self, block_embeds, target_hidden, anchors, block_positions):
        return drafter_block_forward(self.drafter, block_embeds, target_hidden, anchors, block_positions)


def _unwrap(model):
    model = getattr(model, "module", model)
    return model.drafter if isinstance(model, BlockTrainingModule) else model


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ W.T, label_i), computed chunk by chunk so that the full
    `[N, vocab]` logits never exist; the gradient w.r.t. `hidden` is computed in the same pass
    (W is frozen: no gradient for it). Also returns how many argmaxes hit their label."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_size, softcap):
        total = hidden.new_zeros((), dtype=torch.float32)
        grad = torch.empty_like(hidden) if hidden.requires_grad else None
        correct = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            logits = (hidden[start:end].to(weight.dtype) @ weight.T).float()  # the frozen head's dtype (bf16 target: bf16 matmul)
            if softcap is not None:
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            log_probs = logits.log_softmax(dim=-1)
            label = labels[start:end]
            w = weights[start:end].float()
            total = total - (log_probs.gather(1, label[:, None]).squeeze(1) * w).sum()
            correct[start:end] = logits.argmax(dim=-1) == label
            if grad is not None:
                dlogits = log_probs.exp_()
                dlogits[torch.arange(end - start, device=hidden.device), label] -= 1.0
                dlogits *= w[:, None]
                if softcap is not None:
                    dlogits *= 1.0 - capped.square()
                grad[start:end] = (dlogits.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad if grad is not None else hidden.new_empty(0))
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, grad_correct):
        (grad,) = ctx.saved_tensors
        if grad.numel() == 0:
            return None, None, None, None, None, None
        return grad * grad_total.to(grad.dtype), None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int = 2048,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sum of weighted CE, per-row correct)` of `hidden [N, h]` through the frozen `weight [V, h]`."""
    return _ChunkedLinearCrossEntropy.apply(hidden, weight.detach(), labels, weights, chunk_size, softcap)


def dflash_loss(
    drafter,
    embed_tokens: nn.Module,
    lm_head_weight: torch.Tensor,
    target_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    max_anchors: int = 512,
    gamma: float | None = None,
    generator: torch.Generator | None = None,
    chunk_size: int = 2048,
    softcap: float | None = None,
    label_map: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The weighted DFlash block loss of one right-padded batch.

    `label_map [vocab]`: when `lm_head_weight` holds only some rows of the lm_head, the row of each
    token id (-1 for tokens that are never labels); the softmax then runs over those rows only.

    `target_hidden [b, L, n * h]`: the target's features at `target_layer_ids` for every position.
    Only slots with a label go through the lm_head (the frozen full-vocab matmul dominates the cost).
    Returns `loss` (normalised by the weight sum), `weight_sum`, `correct [B]` and `count [B]` per slot.
    """
    config = _unwrap(drafter).config
    block_size = config.block_size
    blocks = build_blocks(
        input_ids.cpu(), loss_mask.cpu(), lengths.cpu(), block_size, config.mask_token_id, max_anchors, generator
    )
    device = target_hidden.device
    with torch.no_grad():
        block_embeds = embed_tokens(blocks["block_ids"].to(embed_tokens.weight.device)).to(device)
    forward = drafter if isinstance(getattr(drafter, "module", drafter), BlockTrainingModule) else (
        lambda *args: drafter_block_forward(drafter, *args)
    )
    hidden = forward(
        block_embeds, target_hidden, blocks["anchors"].to(device), blocks["block_positions"].to(device)
    )
    labels = blocks["labels"].to(device)
    slot = torch.arange(block_size, device=device).repeat(labels.shape[1] // block_size)[None].expand_as(labels)
    keep = labels != IGNORE
    w = slot_weights(block_size, gamma).to(device)[slot[keep]]
    selected = hidden[keep]
    targets = labels[keep] if label_map is None else label_map[labels[keep]]
    if bool((targets < 0).any()):
        raise ValueError("A label is missing from `label_map`: build it from the same examples.")
    total, correct = chunked_linear_cross_entropy(
        selected, lm_head_weight.to(device), targets, w, chunk_size, softcap
    )
    weight_sum = w.sum()
    loss = total / weight_sum.clamp(min=1e-6)
    slot_kept = slot[keep]
    return {
        "loss": loss,
        "weight_sum": weight_sum.detach(),
        "correct": torch.bincount(slot_kept[correct], minlength=block_size),
        "count": torch.bincount(slot_kept, minlength=block_size),
        "num_anchors": (blocks["anchors"] >= 0).sum(),
    }


def reference_block_mask(anchors: list[int], context_len: int, block_size: int, sliding_window: int | None = None):
    """The block mask written out element by element (used by the tests as the definition)."""
    queries = len(anchors) * block_size
    allowed = [[False] * (context_len + queries) for _ in range(queries)]
    for a, anchor in enumerate(anchors):
        for k in range(block_size):
            q = a * block_size + k
            for t in range(context_len):
                ok = anchor >= 0 and t < anchor
                if sliding_window is not None:
                    ok = ok and (anchor + k - t) < sliding_window
                allowed[q][t] = ok
            for s in range(block_size):
                ok = sliding_window is None or s <= k
                allowed[q][context_len + a * block_size + s] = ok
    return allowed


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
