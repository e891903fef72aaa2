"""Drafting a DFlash block: transformers' own `DFlashTokenCandidateGenerator` plus what it lacks.

Upstream's generator (transformers >= 5.24) already holds the protocol: a `DFlashCache` of committed
context, only the hidden states the drafter reads (`model_kwargs_overrides`), the block embedded with
the target's embeddings, the target's lm_head for the drafts. This subclass adds, per step:

- a verify length: how many of the `block_size - 1` drafts go to the target (`policy.py`); with 0
  the step is a plain decoding step and the drafter does not run (its context waits in a buffer);
  once drafted, an unlikely tail (by the drafter's confidence per slot) is left out on the CPU. Every
  such choice is taken from the call's statistics and the drafter's distributions q, before any draft
  is drawn from them: rejection sampling is exact for a proposal fixed before its draw, not for one
  chosen by looking at it;
- the way drafts are proposed under sampling (`PROPOSALS`), with the scores q they were drawn from;
- Gemma's final logit soft-capping on draft logits, as on the target's;
- the draft logits computed only for the slots that are verified, on the lm_head's device, and only
  over the drafter's `draft_vocab` (the tokens of its training labels) when its config has one;
- copies from the context (`lookup`): where the last tokens recur in the prompt or output so far, the
  continuation found there (transformers' `PromptLookupCandidateGenerator` finds it) can be verified
  instead of the DFlash block, whichever the policy expects to commit more tokens per second.
"""

import functools

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator, PromptLookupCandidateGenerator

from ..targets import logit_softcap
from .policy import AdaptiveVerifyLength, CopyPolicy

# How drafts are proposed under `do_sample=True` (all three are exact):
# - "sample": a draw from the drafter's q; rejection sampling accepts it with prob min(1, p(d) / q(d)).
# - "argmax": the drafter's most likely token, q one-hot; rejection sampling accepts it with prob p(d).
# - "match": argmax drafts kept only where they equal an independent sample of the target (the
#   reference implementation's rule; kept to measure the others against).
PROPOSALS = ("sample", "argmax", "match")
ADAPTIVE = "adaptive"


# Copied tokens per step of the default `lookup="adaptive"`, as transformers' prompt_lookup_num_tokens.
DEFAULT_LOOKUP = 10


def resolve_lookup(lookup, verify_length):
    """`"adaptive"` (the default): `DEFAULT_LOOKUP` where the adaptive policy decides between a copy and
    the block, off with a fixed verify length (which would verify every copy found instead of the block)."""
    if lookup == ADAPTIVE:
        return DEFAULT_LOOKUP if verify_length == ADAPTIVE else None
    return lookup


def check_settings(proposal: str, verify_length, lookup=None) -> None:
    """The DFlash options (`enable`, per call, `GenerationConfig`), checked where they come in."""
    if lookup is not None and lookup != ADAPTIVE and (isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 1):
        raise ValueError(f"lookup must be {ADAPTIVE!r} (copy where the adaptive verify length finds it pays), None "
                         f"(off) or the most tokens copied from the context per step (an int >= 1, e.g. 10), got {lookup!r}")
    if proposal not in PROPOSALS:
        raise ValueError(f"dflash proposal must be one of {PROPOSALS}, got {proposal!r}")
    fixed = isinstance(verify_length, int) and not isinstance(verify_length, bool) and verify_length >= 0
    if not (verify_length is None or verify_length == ADAPTIVE or fixed):
        raise ValueError(
            f"verify_length must be {ADAPTIVE!r} (choose per step), None (every draft) or an int >= 0 (at most that "
            f"many drafts; 0 never drafts), got {verify_length!r}"
        )


class DFlashCandidateGenerator(DFlashTokenCandidateGenerator):
    """Drafts up to `block_size - 1` tokens per step from the target's hidden states.

    `get_candidates` has upstream's signature and contract: it is called before each target forward
    with that forward's predecessor's outputs and `n_last_matches` (drafts it accepted), and returns
    `(input_ids + drafts, (1, k, vocab) scores)`, or no candidates for the prefill and plain steps.

    Args:
        target (`PreTrainedModel`): the model being decoded; its embeddings and lm_head are used.
        drafter (`DFlashDraftModel`): the DFlash drafter (or any model with its config and forward).
        generation_config (`GenerationConfig`): the call's config (`max_length`, `do_sample`).
        logits_processor (`LogitsProcessorList`, *optional*): applied to draft logits exactly as the
            loop applies it to the target's, so that q and p see the same processing.
        proposal (`str`, defaults to `"sample"`): see `PROPOSALS`.
        verify_length (`str` or `int`, *optional*, defaults to `"adaptive"`): drafts verified per step:
            `"adaptive"` (chosen each step, `policy.AdaptiveVerifyLength`), `None` (all), or at most an int.
            The drafter always drafts its whole trained block: shortening its input hurts acceptance.
        lookup (`int` or `str`, *optional*): copy up to this many tokens from the context where its last tokens
            recur (None: never copy; `"adaptive"`: `DEFAULT_LOOKUP` with the adaptive verify length, none
            with a fixed one). A copied run is verified instead of the block when the policy expects it to
            pay more (with a fixed verify length: whenever one is found); the drafter does not run in that
            step. Copies are a deterministic proposal (q one-hot) under sampling.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
        proposal: str = "sample",
        verify_length: int | str | None = ADAPTIVE,
        lookup: int | None = None,
    ):
        check_settings(proposal, verify_length, lookup)
        lookup = resolve_lookup(lookup, verify_length)
        super().__init__(
            drafter, target.get_input_embeddings(), target.get_output_embeddings(), generation_config,
            logits_processor if logits_processor is not None else LogitsProcessorList(),
        )
        self.softcap = logit_softcap(target)
        self.proposal = proposal
        self.draft_vocab, self.draft_head = self._draft_head(getattr(drafter.config, "draft_vocab", None))
        bounded = verify_length not in (None, ADAPTIVE)
        self.max_drafts = min(verify_length, self.block_size - 1) if bounded else self.block_size - 1
        self.policy = AdaptiveVerifyLength(self.max_drafts) if verify_length == ADAPTIVE and self.max_drafts else None
        if generation_config.output_hidden_states:  # the caller asked for every layer
            self.model_kwargs_overrides = {"output_hidden_states": True}
        # Context features of committed tokens the drafter has not ingested (plain steps skip it).
        self.pending_context: list[torch.Tensor] = []
        self.block_in_cache = False  # the last drafter forward left its block's keys/values in the cache
        self.padded: bool | None = None  # whether the prompt has padding; decided at the first draft
        self.num_drafts = 0  # drafts handed to the target at the current step
        self.copied = False  # whether they were copied from the context rather than drafted
        self.lookup = None
        self.max_copy = lookup or 0  # the longest copied run a step verifies
        if lookup is not None:
            self.lookup = PromptLookupCandidateGenerator(
                eos_token_id=None, num_output_tokens=lookup, max_matching_ngram_size=2,
                max_length=self.main_model_max_length,
                # under sampling, skip copies of tokens the processors forbid (as prompt lookup does)
                logits_processor=self.logits_processor if self.do_sample and len(self.logits_processor) else None,
                vocab_size=self.main_model_output_embeddings.weight.shape[0],
            )
        # Copied runs accept very differently from drafts: their own statistics, and no drafter in their cost.
        self.copy_policy = CopyPolicy(lookup, self.policy) if lookup is not None and verify_length == ADAPTIVE else None

    @property
    def longest_verify(self) -> int:
        """Tokens of the longest target forward after the prefill: the anchor and the longest proposal, drafted
        or copied. The target's cache records the states of linear-attention layers for this many positions,
        the ones a rejection can roll back to."""
        return 1 + max(self.max_drafts, self.max_copy)

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """`(1, n + k)` ids and `(1, k, vocab)` scores q of the drafts (None: no drafts, or "match")."""
        self.num_drafts, self.copied = 0, False
        if is_first_iteration:  # the prefill forward comes first: its hidden states are the first context
            return input_ids, None
        hidden_states = model_outputs.hidden_states
        # The prefill forward covered the whole prompt (maybe given as embeddings); a later one covered
        # [anchor, drafts], of which the anchor and the accepted drafts are now committed context.
        num_new = hidden_states[self.target_layer_ids[0] + 1].shape[1] if self.is_main_model_prefill else n_last_matches + 1
        self.is_main_model_prefill = False
        self.pending_context.append(
            torch.cat([hidden_states[i + 1][:, :num_new].to(self.device) for i in self.target_layer_ids], dim=-1)
        )
        room = self.main_model_max_length - input_ids.shape[1] - 1
        limit = min(self.max_drafts, room)
        if self.policy is not None and limit > 0:
            limit = self.policy.choose(limit)
        if self.lookup is not None and room > 0:
            copy = self._copy(input_ids, limit, room)
            if copy is not None:
                return copy
        if limit <= 0:  # a plain step: the target decodes one token, the drafter waits
            return input_ids, None
        hidden = self._draft_block(input_ids, model_kwargs)[:, 1 : 1 + limit]
        # The drafter's distributions q of every slot, from one forward: all that decides what is verified below
        # is fixed before any draft is drawn from them, which keeps rejection sampling exact.
        logits = self._draft_logits(hidden).to(input_ids.device)
        agreed = self._agreeing_copy(input_ids, logits)
        if agreed is not None:
            return agreed
        # The drafter's confidence says how far its drafts will be accepted: verify only the part that pays. Read
        # on the CPU only: on an accelerator it is a host sync between the drafter's forward and the target's,
        # and a verified draft costs almost nothing there anyway.
        if self.policy is not None and limit > 1 and logits.device.type == "cpu":
            # the probability of each slot's most likely token, before any processor (under greedy decoding
            # without processors, that of the draft itself)
            limit = self.policy.cut(logits.softmax(dim=-1).amax(dim=-1)[0].tolist())
        self.num_drafts = limit
        drafts, scores = self._propose(input_ids, logits[:, :limit])
        return torch.cat([input_ids, drafts], dim=-1), scores

    def _draft_head(self, vocab: list[int] | None):
        """`(ids, rows)`: the drafter's `draft_vocab` and a function computing the lm_head's rows of it (copied once per
        call; a drafter trained on those labels only never needs the other rows), or `(None, the lm_head)`. Only a
        plain `nn.Linear` head is cut (a quantised one keeps its own forward)."""
        head = self.main_model_output_embeddings
        if not vocab or type(head) is not torch.nn.Linear:
            return None, head
        if vocab[-1] >= head.out_features:
            raise ValueError(f"The drafter's draft_vocab has token id {vocab[-1]}, outside the target's vocabulary "
                             f"({head.out_features} tokens): this drafter was trained for another target.")
        ids = torch.tensor(vocab, device=head.weight.device)
        weight, bias = head.weight.detach()[ids], head.bias.detach()[ids] if head.bias is not None else None
        return ids, functools.partial(torch.nn.functional.linear, weight=weight, bias=bias)

    def _draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`(1, k, vocab)` float logits of the drafts from the drafter's `(1, k, hidden)` output (-inf outside the
        draft vocabulary)."""
        weight = self.main_model_output_embeddings.weight
        # As a 2-D matrix: the (1, k) slots of a longer block keep the block's batch stride, with which a bf16
        # matmul on the CPU takes a path ~25x slower (SmolLM2's lm_head: 74 ms instead of 3).
        rows = hidden.reshape(-1, hidden.shape[-1]).to(weight.device, weight.dtype)
        logits = self.draft_head(rows).float().view(*hidden.shape[:-1], -1)
        if self.softcap is not None:  # Gemma caps its logits; the drafts' must match to sample alike
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.draft_vocab is None:
            return logits
        vocab_size = self.main_model_output_embeddings.out_features
        return logits.new_full((*logits.shape[:-1], vocab_size), float("-inf")).index_copy_(-1, self.draft_vocab, logits)

    def _agreeing_copy(self, input_ids: torch.LongTensor, logits: torch.Tensor):
        """The copy passed over at this step, verified after all when the drafter's most likely first token (after
        the logits processors: the greedy draft) is its first token: where two independent proposals agree the
        copy is right far more often than the copy statistics say (they average over all copies), and it is
        longer than the drafts. Replayed on the same text (benchmarks/policy_replay.py, 16 prompts per set, bf16
        costs) it took completion from 1.68x to 1.75x and editing from 2.26x to 2.36x, prose unchanged. Under
        sampling that argmax is fixed before any draft is drawn, so verifying the copy (q one-hot) or the drafts
        stays exact; a rule that looked at a drawn draft would not be."""
        if self.copy_policy is None or not self.copy_policy.passed_over:
            return None
        position, copy = self.copy_policy.passed_over[-1]
        if position != input_ids.shape[1]:
            return None
        first = logits[:, 0] if len(self.logits_processor) == 0 else self.logits_processor(input_ids, logits[:, 0].clone())
        if copy[0] != int(first.argmax(dim=-1)[0]):
            return None
        self.copy_policy.passed_over.pop()  # verified now: not scored as passed over
        return self._copied(input_ids, torch.tensor([copy], dtype=input_ids.dtype, device=input_ids.device))

    def _copy(self, input_ids: torch.LongTensor, drafted: int, room: int):
        """`(ids + copied run, scores)` when the context offers a continuation worth verifying, else None."""
        found = self.lookup.get_candidates(input_ids)[0][:, input_ids.shape[1] : input_ids.shape[1] + room]
        available = found.shape[1]
        if available == 0:
            return None
        # A copied run is verified whole, as prompt lookup does: a copy is mostly accepted entirely or
        # not at all, and each extra verified token costs little, so the policy only decides whether
        # the copy beats the DFlash block (or a plain step). Cutting copies to the length with the best
        # estimated rate cost 4-8 more forwards per 128 tokens on edits (fp32, same output).
        if self.copy_policy is not None and not self.copy_policy.pays(available, drafted):
            self.copy_policy.pass_over(input_ids.shape[1], found[0].tolist())
            return None
        return self._copied(input_ids, found)

    def _copied(self, input_ids: torch.LongTensor, found: torch.LongTensor):
        """`(ids + copied run, scores)`: the copy is this step's proposal."""
        self.num_drafts, self.copied = found.shape[1], True
        scores = None
        if self.do_sample and self.proposal != "match":  # a deterministic proposal: q one-hot at the copy
            vocab = self.main_model_output_embeddings.weight.shape[0]
            scores = torch.full((1, found.shape[1], vocab), float("-inf"), device=found.device)
            scores.scatter_(-1, found[..., None], 0.0)
        return torch.cat([input_ids, found], dim=-1), scores

    def _draft_block(self, input_ids: torch.LongTensor, model_kwargs: dict) -> torch.Tensor:
        """One drafter forward over [pending context ; anchor, mask x (B - 1)]: the `(1, B, hidden)` block output."""
        if self.block_in_cache:  # keep committed context only: the block's keys/values change every step
            self.cache.crop(-self.block_size)
        context = torch.cat(self.pending_context, dim=1) if len(self.pending_context) > 1 else self.pending_context[0]
        self.pending_context = []
        num_context = context.shape[1]
        # model_kwargs cover the whole sequence, the anchor (last token, not yet context) included
        positions = model_kwargs.get("position_ids")
        if positions is None:
            total = model_kwargs["cache"].get_seq_length() + 1 if "cache" in model_kwargs else input_ids.shape[1]
            positions = torch.arange(total, device=input_ids.device)[None]
        anchor = positions[..., -1:]
        position_ids = torch.cat(
            [positions[..., -1 - num_context : -1], anchor + torch.arange(self.block_size, device=anchor.device)], dim=-1
        )
        attention_mask = model_kwargs.get("attention_mask")
        if self.padded is None:
            self.padded = attention_mask is not None and not bool(attention_mask.all())
        if self.padded:
            block = attention_mask.new_ones(attention_mask.shape[0], self.block_size)
            attention_mask = torch.cat([attention_mask[:, :-1], block], dim=-1).to(self.device)
        else:
            attention_mask = None
        noise_ids = torch.cat([input_ids[:, -1:], self.noise_ids_mask.to(input_ids.device)], dim=-1)
        noise_embeds = self._get_noise_embeds(noise_ids.to(self.main_model_input_embeddings.weight.device))
        self.cache.set_previous_accepted_tokens(num_context)
        output = self.assistant_model(
            noise_embeds=noise_embeds.to(self.device),
            context_hidden_states=context,
            position_ids=position_ids.to(self.device),
            attention_mask=attention_mask,
            cache=self.cache,
        )
        self.block_in_cache = True
        return output.last_hidden_state

    def _propose(self, input_ids: torch.LongTensor, logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft tokens from `(1, k, vocab)` logits and the scores q they were drawn from.

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
                    if self.draft_vocab is not None:  # processors may forbid every draft token: q uniform then
                        scores[:, i] = scores[:, i].masked_fill(scores[:, i].isneginf().all(-1, keepdim=True), 0.0)
                    token = torch.multinomial(scores[:, i].softmax(dim=-1), num_samples=1)
                else:
                    token = scores[:, i].argmax(dim=-1, keepdim=True)
                ids = torch.cat([ids, token], dim=-1)
            drafts = ids[:, input_ids.shape[1] :]
        if self.do_sample and self.proposal == "argmax":
            # A deterministic proposal: q is one-hot at the draft (still lossless under rejection sampling).
            scores = torch.full_like(scores, float("-inf")).scatter_(-1, drafts[..., None], 0.0)
        if self.do_sample and self.proposal == "match":
            scores = None  # verified by the reference rule: keep drafts equal to a sample of the target
        return drafts, scores

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores, num_matches: int, seconds: float = 0.0):
        """After each target forward but the prefill: `num_matches` drafts were committed, the step
        (drafting and verifying) took `seconds`."""
        if self.copied:
            if self.copy_policy is not None:  # (and with it the draft policy, if any: both need "adaptive")
                self.copy_policy.observe(self.num_drafts, int(num_matches), seconds)
        elif self.policy is not None:
            self.policy.observe(self.num_drafts, int(num_matches), seconds)
        if self.copy_policy is not None and self.copy_policy.passed_over:
            first = self.copy_policy.passed_over[0][0]
            self.copy_policy.score_passed_over(input_ids[0, first:].tolist())  # one host sync for all of them


__all__ = ["ADAPTIVE", "DEFAULT_LOOKUP", "DFlashCandidateGenerator", "PROPOSALS", "check_settings", "resolve_lookup"]
