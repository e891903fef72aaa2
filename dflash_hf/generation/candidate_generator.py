"""Drafting a DFlash block for transformers' assisted-generation loop."""

import time

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from ..modeling_dflash import DFlashDraftModel
from ..targets import apply_softcap, logit_softcap
from .policy import AdaptiveVerifyLength
from .profile import CostProfile, load_profile
from .rollback import RollbackCache, replay
from .stats import DFlashStats

# How drafts are proposed and verified under `do_sample=True` (all three are lossless):
# - "argmax": the drafter's most likely token, q one-hot; rejection sampling accepts it with prob p(d).
# - "sample": a draw from the drafter's q; rejection sampling accepts with prob min(1, p(d) / q(d)).
# - "match": argmax drafts kept only where they equal an independent sample of the target (the
#   reference implementation's rule; kept to measure the others against).
PROPOSALS = ("argmax", "sample", "match")


ADAPTIVE = "adaptive"


def check_settings(proposal: str, verify_length, cost_profile=None) -> None:
    """The options `enable` stores and the generator takes, checked once for both."""
    if proposal not in PROPOSALS:
        raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
    fixed = isinstance(verify_length, int) and not isinstance(verify_length, bool) and verify_length >= 0
    if not (verify_length is None or verify_length == ADAPTIVE or fixed):
        raise ValueError(
            f"verify_length must be {ADAPTIVE!r} (choose per step), None (every draft) or an int >= 0 (at most that "
            f"many drafts; 0 never drafts), got {verify_length!r}"
        )
    if cost_profile is not None and not isinstance(cost_profile, CostProfile):
        raise TypeError(f"cost_profile must be a dflash_hf CostProfile, got {type(cost_profile).__name__}")


class DFlashCandidateGenerator(CandidateGenerator):
    """Drafts `block_size - 1` tokens per step from the target's hidden states.

    transformers' loop calls `get_candidates` before each target forward and hands it the outputs of
    the previous one. The drafter's cache holds the context of every committed token but the
    anchor (the last one), so each step feeds only the newly committed tokens' hidden states plus the
    block: O(block) work, the prefix is never re-encoded.

    Args:
        target (`PreTrainedModel`): the model being decoded; its embeddings and lm_head are used.
        drafter (`DFlashDraftModel`): the DFlash drafter.
        generation_config (`GenerationConfig`): the call's config (`max_length`, `do_sample`).
        logits_processor (`LogitsProcessorList`, *optional*): applied to draft logits exactly as the
            loop applies it to the target's, so that q and p see the same processing.
        proposal (`str`, defaults to `"sample"`): see `PROPOSALS`; `benchmarks/sampling.py` measured
            it best (its acceptance is 1 - TV(p, q) where argmax's is p(argmax q), as low as "match").
        verify_length (`str` or `int`, *optional*, defaults to `"adaptive"`): how many drafts the
            target verifies per step. `"adaptive"`: chosen each step from running acceptance statistics
            and the hardware profile (`policy.py`; 0 drafts, a plain step, when drafting does not pay);
            `None`: all `block_size - 1`; an int: at most that many. The drafter still drafts its whole
            trained block (shortening its input hurts acceptance).
        cost_profile (`CostProfile`, *optional*): step costs for the adaptive policy; default: the cached
            profile of this pair on this hardware (`profile.load_profile`, measured on first use).
    """

    requires_model_outputs = True

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DFlashDraftModel,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
        proposal: str = "sample",
        verify_length: int | str | None = ADAPTIVE,
        cost_profile: CostProfile | None = None,
    ):
        check_settings(proposal, verify_length, cost_profile)
        self.target = target
        self.drafter = drafter
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.softcap = logit_softcap(target)
        self.block_size = drafter.config.block_size
        fixed = verify_length is None or verify_length == ADAPTIVE
        self.max_drafts = self.block_size - 1 if fixed else min(verify_length, self.block_size - 1)
        self.policy = None
        if verify_length == ADAPTIVE and self.max_drafts > 0:
            profile = cost_profile if cost_profile is not None else load_profile(target, drafter)
            self.policy = AdaptiveVerifyLength(self.max_drafts, profile)
        self.layer_ids = drafter.config.target_layer_ids
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
        self.proposal = proposal
        # Only the hidden states the drafter reads (hidden_states[i + 1]), unless the user asked for all.
        wanted = True if generation_config.output_hidden_states else sorted({i + 1 for i in self.layer_ids})
        self.model_kwargs_overrides = {"output_hidden_states": wanted}
        self.mask_ids = torch.full((1, self.block_size - 1), drafter.config.mask_token_id, dtype=torch.long)
        self.cache = DynamicCache()
        self.padded = None  # whether the prompt has padding; decided once, at the first draft
        # Context features of committed tokens the drafter has not ingested yet (plain steps skip it).
        self.pending_context: list[torch.Tensor] = []
        self.pending_length = 0
        self.stats = DFlashStats()
        drafter.last_stats = self.stats
        self._pending_drafts = None  # None until the prefill forward has been seen
        self._clock = time.perf_counter()

    @property
    def num_drafting_tokens(self) -> int:
        """Drafts per step at most; transformers keeps that many recurrent states for rollbacks."""
        return self.block_size - 1

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Returns `(input_ids + drafts, draft scores)`: `(1, n + k)` ids and `(1, k, vocab)` scores.

        The first call precedes the prefill, whose hidden states the drafter needs: it returns no
        candidates, so the loop's first forward is a plain prefill.
        """
        start = time.perf_counter()
        self._clock = start
        target_cache = model_kwargs.get("cache") if model_kwargs else None
        rollback = isinstance(target_cache, RollbackCache)
        if rollback:
            model_outputs = self._sync_target_state(input_ids, target_cache, model_outputs, model_kwargs)
        if is_first_iteration:
            self._pending_drafts = 0 if self._pending_drafts is not None else None
            return input_ids, None

        positions = model_kwargs.get("position_ids") if model_kwargs else None
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        self._collect_context(positions, model_outputs)
        limit = min(self.max_drafts, self.max_length - input_ids.shape[1] - 1)
        if self.policy is not None and limit > 0:
            limit = self.policy.choose(positions.shape[-1], limit)
        num_drafts = max(0, limit)
        self._pending_drafts = num_drafts
        self.stats.verify_lengths.append(num_drafts)
        if num_drafts == 0:  # a plain step: the target decodes one token, the drafter waits
            return input_ids, None

        block_hidden = self._draft_block(input_ids, positions, model_kwargs)
        logits = self.lm_head(block_hidden[:, 1 : 1 + num_drafts].to(self.lm_head.weight.dtype))
        drafts, scores = self._propose(input_ids, apply_softcap(logits, self.softcap).float())

        self._clock = time.perf_counter()
        self.stats.draft_seconds += self._clock - start
        if self.do_sample and self.proposal == "match":
            scores = None  # transformers then samples the target per position and keeps equal drafts
        if rollback:
            target_cache.snapshot()
        return torch.cat([input_ids, drafts], dim=-1), scores

    def _sync_target_state(self, input_ids, cache: RollbackCache, model_outputs, model_kwargs=None):
        """Hybrid targets: after a rejection the cache was rolled back to before the verification;
        replay the committed tokens so that every layer's state covers exactly `input_ids[:, :-1]`."""
        if cache.replay_from is None:
            return model_outputs
        model_kwargs = model_kwargs or {}
        return replay(self.target, cache, input_ids, self.model_kwargs_overrides, self.stats,
                      attention_mask=model_kwargs.get("attention_mask"), position_ids=model_kwargs.get("position_ids"))

    def _collect_context(self, positions, model_outputs) -> None:
        """Keeps the context features of the tokens the last target forward committed.

        That forward started at the first token the drafter has not seen; its first
        `anchor_index - known` positions are the newly committed tokens (the rest were rejected drafts
        or the new anchor)."""
        anchor_index = positions.shape[-1] - 1
        num_new = anchor_index - (self.cache.get_seq_length() + self.pending_length)
        if num_new <= 0:
            return
        hidden_states = model_outputs.hidden_states
        # per-layer hidden states may sit on different GPUs (device_map): gather them on the drafter's
        device = self.drafter.device
        self.pending_context.append(
            torch.cat([hidden_states[i + 1][:, :num_new].to(device) for i in self.layer_ids], dim=-1)
        )
        self.pending_length += num_new

    def _draft_block(self, input_ids, positions, model_kwargs) -> torch.Tensor:
        """One drafter forward over [pending context ; anchor, mask x (B-1)]; returns the block's
        (1, B, hidden) output."""
        device = self.drafter.device
        # A prompt given as inputs_embeds is in the positions (and the target's cache) but not in input_ids.
        anchor_index = positions.shape[-1] - 1
        cached = self.cache.get_seq_length()
        target_hidden = torch.cat(self.pending_context, dim=1)
        self.pending_context, self.pending_length = [], 0

        block_positions = positions[:, -1:] + torch.arange(self.block_size, device=positions.device)
        position_ids = torch.cat([positions[:, cached:anchor_index], block_positions], dim=-1)

        attention_mask = model_kwargs.get("attention_mask") if model_kwargs else None
        if self.padded is None:
            self.padded = attention_mask is not None and not bool(attention_mask.all())
        if self.padded:
            block_ones = attention_mask.new_ones(attention_mask.shape[0], self.block_size)
            attention_mask = torch.cat([attention_mask[:, :anchor_index], block_ones], dim=-1).to(device)
        else:
            attention_mask = None

        block_ids = torch.cat([input_ids[:, -1:], self.mask_ids.to(input_ids.device)], dim=-1)
        block_embeds = self.embed_tokens(block_ids.to(self.embed_tokens.weight.device))
        output = self.drafter(
            block_embeds=block_embeds.to(device),
            target_hidden=target_hidden,
            position_ids=position_ids.to(device),
            cache=self.cache,
            attention_mask=attention_mask,
        )
        # Keep committed context only: the block's keys/values change with every step.
        self.cache.crop(-self.block_size)
        return output.last_hidden_state

    def _propose(self, input_ids: torch.LongTensor, logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
        """Turns (1, k, vocab) draft logits into k draft tokens and the scores q they were drawn from.

        Processors see the same prefixes (prompt + earlier drafts) as the loop gives them for the
        target's logits, so that the drafter's q and the target's p are processed alike.
        """
        sample = self.do_sample and self.proposal == "sample"
        if len(self.logits_processor) == 0 and not sample:
            scores, drafts = logits, logits.argmax(dim=-1)
        else:
            scores = torch.empty_like(logits)
            ids = input_ids
            for i in range(logits.shape[1]):
                scores[:, i] = self.logits_processor(ids, logits[:, i])
                if sample:
                    token = torch.multinomial(scores[:, i].softmax(dim=-1), num_samples=1)
                else:
                    token = scores[:, i].argmax(dim=-1, keepdim=True)
                ids = torch.cat([ids, token], dim=-1)
            drafts = ids[:, input_ids.shape[1] :]
        if self.do_sample and self.proposal == "argmax":
            # The proposal is deterministic: q is one-hot at the draft (still lossless under rejection sampling).
            scores = torch.full_like(scores, float("-inf")).scatter_(-1, drafts[..., None], 0.0)
        return drafts, scores

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Called by the loop after each target forward with the number of drafts it committed."""
        now = time.perf_counter()
        self.stats.verify_seconds += now - self._clock
        self._clock = now
        if self._pending_drafts is None:  # the prefill forward
            self._pending_drafts = 0
            return
        accepted = int(num_matches)
        if self.policy is not None:
            self.policy.observe(self._pending_drafts, accepted)
        self.stats.acceptance_lengths.append(accepted + 1)
        self.stats.drafted_tokens += self._pending_drafts
        self.stats.accepted_tokens += accepted
