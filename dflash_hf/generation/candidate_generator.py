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
  continuation found there (transformers' prompt lookup, run on the host copy of the ids: `lookup.py`) can
  be verified instead of the DFlash block, whichever the policy expects to commit more tokens per second;
- no host sync of its own: the step's decisions come from host statistics and that host copy
  (`policy.StepPlanner`), which the loop keeps up to date from the one read it makes per step.
"""

import functools
from typing import NamedTuple

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from ..hardware import cost_prior
from ..packed import PackedLinear, is_packed, pack_linears
from ..targets import logit_softcap
from .lookup import ContextLookup
from .policy import AdaptiveVerifyLength, CopyPolicy, Plan, StepCosts, StepPlanner

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


def host_reads_are_free(device: torch.device) -> bool:
    """Whether the host reads a tensor on `device` without waiting for it: on the CPU, where it already is. Elsewhere
    a read stops the host until the device has caught up (the step's one read is the committed tokens)."""
    return device.type == "cpu"


class Proposal(NamedTuple):
    """What the loop verifies in a step: `ids`, the sequence followed by the proposed tokens (`ids` unchanged for
    the prefill and plain steps); `scores`, the `(1, k, vocab)` scores q they were drawn from (None: greedy
    decoding needs none, or the "match" rule); `plan`, what they are (a copied run or `plan.num_drafts` drafts;
    None for the prefill, which proposes nothing and teaches the policy nothing);
    `model_kwargs_overrides`, what the target's forward must also return (the hidden states the drafter reads)."""

    ids: torch.LongTensor
    scores: torch.Tensor | None
    plan: Plan | None
    model_kwargs_overrides: dict

    @property
    def num_proposed(self) -> int:
        return 0 if self.plan is None else len(self.plan.copy) if self.plan.copy is not None else self.plan.num_drafts

    @property
    def copied(self) -> bool:
        return self.plan is not None and self.plan.copy is not None


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

    The loop's interface, for one sequence and for a batch alike: `start` takes the prompts (host ids) before the
    prefill; `propose` returns each step's `Proposal` before the target's forward; after it, `ingest` takes the
    forward's hidden states of the slots now committed and `observe` each row's committed tokens (host ids);
    `keep_rows` the rows that go on when others of a batch finish. (Upstream's `get_candidates` and
    `update_candidate_strategy` are not used: transformers calls them only on the candidate generators its own
    assisted loop builds, and DFlash runs its own loop.)

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
        if is_packed(target) and not is_packed(drafter):  # the drafter takes its target's CPU fast path too
            pack_linears(drafter, rows=drafter.config.block_size)
        self.draft_vocab, self.draft_head = self._draft_head(getattr(drafter.config, "draft_vocab", None))
        bounded = verify_length not in (None, ADAPTIVE)
        self.max_drafts = min(verify_length, self.block_size - 1) if bounded else self.block_size - 1
        self.policy = None
        if verify_length == ADAPTIVE and self.max_drafts:
            costs = StepCosts(self.max_drafts, **cost_prior(target))  # the verify forward's, where it runs
            self.policy = AdaptiveVerifyLength(self.max_drafts, costs)
        if generation_config.output_hidden_states:  # the caller asked for every layer
            self.model_kwargs_overrides = {"output_hidden_states": True}
        # Context features of committed tokens the drafter has not ingested (plain steps skip it).
        self.pending_context: list[torch.Tensor] = []
        self.block_in_cache = False  # the last drafter forward left its block's keys/values in the cache
        self.padded: bool | None = None  # whether the drafter takes the attention mask (`start`)
        self.committed: list[list[int]] = []  # the host copy of each row's ids (`start`, `observe`)
        self.noise_mask: torch.Tensor | None = None  # the block's mask tokens, made once on the ids' device
        self.max_copy = lookup or 0  # the longest copied run a step verifies
        # under sampling, transformers' prompt lookup also skips copies of tokens the processors forbid, reading
        # each copied token's processed score on the host; left to verification here (such a token has p = 0 and
        # is rejected, exactly), so that finding a copy reads nothing from the device
        self.lookup = ContextLookup(lookup) if lookup is not None else None
        self.copy_start = 0  # where this step's copy starts in the sequence
        # Copied runs accept very differently from drafts: their own statistics, and no drafter in their cost.
        copies = CopyPolicy(lookup, self.policy) if lookup is not None and verify_length == ADAPTIVE else None
        self.planner = StepPlanner(self.max_drafts, self.policy, copies)

    @property
    def longest_verify(self) -> int:
        """Tokens of the longest target forward after the prefill: the anchor and the longest proposal, drafted
        or copied. The target's cache records the states of linear-attention layers for this many positions,
        the ones a rejection can roll back to."""
        return 1 + max(self.max_drafts, self.max_copy)

    def start(self, prompts: list[list[int]], padded: bool) -> None:
        """Called once before the prefill with each row's prompt ids and whether the attention mask pads them, read
        on the host with the call's other setup reads (the loop reads each step's tokens after that, `observe`).
        A batch's drafter always takes the mask (its holes are padding to it), and its verified drafts are priced
        for every row (a verified draft adds a token per row to the target's forward)."""
        self.padded = padded or len(prompts) > 1
        if self.lookup is not None:
            self.lookup.extend(prompts[0])  # (copies: one sequence only)
        self.committed = [list(prompt) for prompt in prompts]
        if self.policy is not None:
            self.policy.costs.set_rows(len(prompts))

    def keep_rows(self, keep: list[int], index: torch.LongTensor) -> None:
        """The rows of the batch that go on (`keep`, indices into the current batch; `index`, the same on the loop's
        device) when others finished: the drafter's cache and pending context lose the others, and a verified draft
        is priced for the rows left."""
        index = index.to(self.device)
        self.cache.batch_select_indices(index)
        self.pending_context = [c.index_select(0, index) for c in self.pending_context]
        self.committed = [self.committed[i] for i in keep]
        if self.policy is not None:
            self.policy.costs.set_rows(len(keep))

    def ingest(self, model_outputs, kept: int | None = None) -> None:
        """After each target forward: the context features (the hidden states after `target_layer_ids`) of its first
        `kept` positions, the ones now committed (None: all, as after the prefill), for the drafter's next forward."""
        if self.max_drafts == 0:  # the drafter never runs
            return
        hidden_states = model_outputs.hidden_states
        self.pending_context.append(
            torch.cat([hidden_states[i + 1][:, :kept].to(self.device) for i in self.target_layer_ids], dim=-1)
        )

    def propose(self, input_ids: torch.LongTensor, model_kwargs: dict, first: bool = False,
                room: int | None = None) -> Proposal:
        """This step's proposal (see `Proposal`) for `input_ids` `(batch, n)`, each row ending with its anchor (the last
        committed token, not yet in the caches), `model_kwargs` covering them (attention mask, positions);
        nothing for the prefill (`first`); `room`: the tokens that may follow the anchor (default: to
        `max_length`). Reads nothing from the device: every decision comes from host statistics and the host copy
        of the committed ids (`start`, `observe`), except where `host_reads_are_free` (the CPU, one row)."""
        if first:  # the prefill forward comes first: its hidden states are the first context
            return Proposal(input_ids, None, None, self.model_kwargs_overrides)
        length = input_ids.shape[1]
        room = self.main_model_max_length - length - 1 if room is None else room
        copy = None
        if self.lookup is not None and room > 0:
            self.copy_start, copy = self.lookup.find(self.main_model_max_length)
            copy = copy[:room]
        plan = self.planner.before_draft(length, room, copy)
        if plan.num_drafts == 0:  # a copy, or a plain step: the target decodes one token, the drafter waits
            return self._proposal(input_ids, plan)
        hidden = self._draft_block(input_ids, model_kwargs)[:, 1 : 1 + plan.num_drafts]
        # The drafter's distributions q of every slot, from one forward: all that decides what is verified below
        # is fixed before any draft is drawn from them, which keeps rejection sampling exact.
        logits = self._draft_logits(hidden).to(input_ids.device)
        first_draft = confidences = None
        # On an accelerator these reads would stop the host between the drafter's forward and the target's (and a
        # verified draft costs almost nothing there anyway): the CPU only, and one sequence (a batch verifies as
        # many drafts in every row).
        if host_reads_are_free(logits.device) and input_ids.shape[0] == 1:
            if self.planner.pending is not None:
                top = logits[:, 0] if len(self.logits_processor) == 0 else self.logits_processor(input_ids, logits[:, 0].clone())
                first_draft = int(top.argmax(dim=-1)[0])  # the greedy draft, after the processors
            if self.policy is not None and plan.num_drafts > 1:
                # the probability of each slot's most likely token, before any processor (under greedy decoding
                # without processors, that of the draft itself)
                confidences = logits.softmax(dim=-1).amax(dim=-1)[0].tolist()
        plan = self.planner.after_draft(plan, first_draft, confidences)
        if plan.copy is not None:
            return self._proposal(input_ids, plan)
        drafts, scores = self._propose(input_ids, logits[:, : plan.num_drafts])
        return Proposal(torch.cat([input_ids, drafts], dim=-1), scores, plan, self.model_kwargs_overrides)

    def _proposal(self, input_ids: torch.LongTensor, plan: Plan) -> Proposal:
        """The proposal of a plain step, or of a copied run: the copy is sliced from the sequence on its device
        (where the host found it), so that no host data is uploaded; under sampling it is a deterministic
        proposal, q one-hot at the copy."""
        if plan.copy is None:
            return Proposal(input_ids, None, plan, self.model_kwargs_overrides)
        found = input_ids[:, self.copy_start : self.copy_start + len(plan.copy)]
        scores = None
        if self.do_sample and self.proposal != "match":
            vocab = self.main_model_output_embeddings.weight.shape[0]
            scores = torch.full((1, found.shape[1], vocab), float("-inf"), device=found.device)
            scores.scatter_(-1, found[..., None], 0.0)
        return Proposal(torch.cat([input_ids, found], dim=-1), scores, plan, self.model_kwargs_overrides)

    def _draft_head(self, vocab: list[int] | None):
        """`(ids, rows)`: the drafter's `draft_vocab` and a function computing the lm_head's rows of it (copied once per
        call; a drafter trained on those labels only never needs the other rows), or `(None, the lm_head)`. Only a
        plain or packed `nn.Linear` head is cut (a quantised one keeps its own forward); a packed head's rows are
        packed too."""
        head = self.main_model_output_embeddings
        if not vocab or type(head) not in (torch.nn.Linear, PackedLinear):
            return None, head
        if vocab[-1] >= head.out_features:
            raise ValueError(f"The drafter's draft_vocab has token id {vocab[-1]}, outside the target's vocabulary "
                             f"({head.out_features} tokens): this drafter was trained for another target.")
        ids = torch.tensor(vocab, device=head.weight.device)
        weight, bias = head.weight.detach()[ids], head.bias.detach()[ids] if head.bias is not None else None
        if isinstance(head, PackedLinear):
            return ids, PackedLinear(weight, bias, rows=head.rows)
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
        if self.padded:
            block = attention_mask.new_ones(attention_mask.shape[0], self.block_size)
            attention_mask = torch.cat([attention_mask[:, :-1], block], dim=-1).to(self.device)
        else:
            attention_mask = None
        if self.noise_mask is None:  # made where the ids are: a copy of a CPU tensor there would wait for the device
            self.noise_mask = torch.full((1, self.block_size - 1), self.mask_token_id, device=input_ids.device,
                                         dtype=input_ids.dtype)
        noise_ids = torch.cat([input_ids[:, -1:], self.noise_mask.expand(input_ids.shape[0], -1)], dim=-1)
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

    def observe(self, proposal: Proposal, tokens: list[list[int]], seconds: float = 0.0) -> None:
        """After each target forward: the step verified `proposal`, committed each row's `tokens` (host ids: its
        accepted proposed tokens and the target's own), and took `seconds` (drafting and verifying). A batch's rows
        are pooled into one set of statistics."""
        for committed, row_tokens in zip(self.committed, tokens):
            committed += row_tokens
        if self.lookup is not None:
            self.lookup.extend(tokens[0])
        if proposal.plan is not None:
            accepted = [len(row_tokens) - 1 for row_tokens in tokens]
            self.planner.observe(proposal.plan, accepted, seconds, self.committed[0])


__all__ = ["ADAPTIVE", "DEFAULT_LOOKUP", "DFlashCandidateGenerator", "PROPOSALS", "Proposal", "check_settings",
           "host_reads_are_free", "resolve_lookup"]
