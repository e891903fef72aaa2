"""How many drafts the target verifies each step: the length that maximises expected tokens per second.

Verifying `n` drafts commits `E(n) = 1 + S_1 + ... + S_n` tokens on average, where `S_k` is the
chance that the first `k` drafts are all accepted, and costs a step of `seconds(n)` (for `n = 0` a
plain decoding step, no drafter). `S_k` is the product of per position acceptance rates, estimated
from this call's recent steps (exponentially forgotten, so a switch from code to prose shows within a
few steps) under a Beta prior. The step costs are learnt from this call's own steps (`StepCosts`): no
call measures anything before its first token. When no `n > 0` pays, the policy decodes plainly and
probes a drafted step again after 8, 16, 32, ... 128 plain steps (the statistics keep fading
meanwhile, so a probe on text that became easy resumes drafting at once), so a useless drafter costs
almost nothing and a drafter that becomes useful again is noticed.

The policy only changes how many drafts are verified, from the call's statistics and the drafter's
distributions, never from a drawn draft: the committed tokens are the target's own (greedy) or distributed
exactly as the target's (rejection sampling is exact for any proposal fixed before its tokens are drawn;
a length chosen by looking at the drawn drafts would bias it, tests/test_exact_sampling.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..hardware import DRAFT, PER_DRAFT


def matching_prefix(proposed: list[int], truth: list[int]) -> int:
    """How many leading tokens of `proposed` equal `truth` (at most the shorter length)."""
    return next((i for i, (a, b) in enumerate(zip(proposed, truth)) if a != b), min(len(proposed), len(truth)))


# The prior step costs, in plain steps (`StepCosts`), are the hardware's: `hardware.cost_prior` (calibrated per CPU).


class StepCosts:
    """Seconds of a decoding step by the number of drafts it verified, learnt online.

    Each observed length keeps a running mean (recent steps weigh most: costs grow with the context).
    A length not observed yet is priced by the shape `prior(n)` (a plain step 1, a drafted one
    `1 + draft + per_draft * n`: the drafter's forward plus a target forward that grows with the
    tokens verified) times the running mean of `seconds / prior(n)` over every step, so that each step
    calibrates all lengths and one slow step is soon forgotten.

    Args:
        max_drafts (`int`): the longest verify length.
        draft (`float`, defaults to 0.3): prior cost of the drafter's step, in plain steps.
        per_draft (`float`, defaults to 0.05): prior extra cost of each verified draft, in plain steps
            (measured on 2 CPU cores for SmolLM2-135M: 0.03 in bf16, 0.06 in fp32; on a GPU less).
        memory (`float`, defaults to 8): observations over which a mean forgets (by `1/e`).
        fallback (`StepCosts`, *optional*): another kind of step's costs (same seconds), whose scale
            prices this one's lengths until it has seen a step of its own.
    """

    def __init__(self, max_drafts: int, draft: float = DRAFT, per_draft: float = PER_DRAFT, memory: float = 8.0,
                 fallback: "StepCosts | None" = None):
        self.draft, self.per_draft, self.max_drafts = draft, per_draft, max_drafts
        self.set_rows(1)
        self.weight = 1.0 / memory
        self.mean: list[float | None] = [None] * (max_drafts + 1)
        self.scale: float | None = None  # seconds per prior unit, over all steps
        self.fallback = fallback  # priced by its scale until this one has seen a step (same units)

    def set_rows(self, rows: int) -> None:
        """Prices a step of a batch of `rows` sequences: each verified draft adds a token per row to the target's
        forward (`per_draft` is one row's). Steps seen so far keep their measured seconds."""
        self.prior = [1.0] + [1.0 + self.draft + self.per_draft * rows * n for n in range(1, self.max_drafts + 1)]

    def observe(self, num_drafts: int, seconds: float) -> None:
        self.mean[num_drafts] = self._update(self.mean[num_drafts], seconds)
        self.scale = self._update(self.scale, seconds / self.prior[num_drafts])

    def _update(self, mean: float | None, value: float) -> float:
        return value if mean is None else mean + self.weight * (value - mean)

    def seconds(self) -> list[float]:
        """Expected seconds of a step verifying n drafts, n = 0..max_drafts (prior units before any step)."""
        scale = self.scale
        if scale is None:
            scale = self.fallback.scale if self.fallback is not None and self.fallback.scale is not None else 1.0
        return [mean if mean is not None else scale * prior for mean, prior in zip(self.mean, self.prior)]


class AdaptiveVerifyLength:
    """Per-call state of the adaptive verify length (one instance per `generate` call).

    Args:
        max_drafts (`int`): drafts available per step (`block_size - 1`).
        costs (`StepCosts`, *optional*): step costs (default: learnt from this call's steps).
        memory (`float`, defaults to 16): steps over which acceptance statistics are forgotten (by `1/e`).
        prior (`tuple[float, float]`, defaults to `(0.75, 0.25)`): Beta pseudo-counts (accepted,
            rejected) of every position before any observation: optimistic, so that the first step drafts
            the whole block, and light, so that a few rejections are enough to stop drafting.
        min_probe_interval, max_probe_interval (`int`): plain steps between two probes while drafting
            does not pay (doubling from the min to the max after each failed probe).
    """

    def __init__(
        self,
        max_drafts: int,
        costs: StepCosts | None = None,
        memory: float = 16.0,
        prior: tuple[float, float] = (0.75, 0.25),
        min_probe_interval: int = 8,
        max_probe_interval: int = 128,
    ):
        if max_drafts < 0:
            raise ValueError(f"max_drafts must be >= 0, got {max_drafts}")
        self.max_drafts = max_drafts
        self.costs = costs if costs is not None else StepCosts(max_drafts)
        self.decay = 1.0 - 1.0 / memory
        self.prior = prior
        self.accepted = [0.0] * max_drafts  # forgotten counts, per draft position
        self.seen = [0.0] * max_drafts
        self.min_probe_interval, self.max_probe_interval = min_probe_interval, max_probe_interval
        self.probe_interval = min_probe_interval
        self.plain = False  # decoding plainly until a probe shows that drafting pays again
        self.plain_steps = 0  # since the switch to plain steps or the last probe
        self.probing = False
        # How much more often drafts are accepted than the drafter's probabilities say (forgotten like the
        # statistics), and the probabilities of the drafts `cut` chose to verify at this step.
        self.confidence_gap, self.confidence_weight = 0.0, 0.0
        self.verified_confidences: list[float] = []

    def acceptance_rates(self) -> list[float]:
        """P(draft k accepted | drafts 1..k-1 accepted), k = 1..max_drafts.

        The Beta prior of position k is centred on position k-1's estimate (position 1's on the prior's
        mean): a position rarely verified is priced like the ones before it. With a flat prior a policy
        that has verified only short runs would price every longer one at the prior's rate and never
        verify it to find out (copied runs, accepted whole or not at all, stayed at 5 of 10 tokens).
        """
        a, b = self.prior
        rate, rates = a / (a + b), []
        for acc, seen in zip(self.accepted, self.seen):
            rate = (acc + (a + b) * rate) / (seen + a + b)
            rates.append(rate)
        return rates

    def expected_tokens(self) -> list[float]:
        """E(n), n = 0..max_drafts: tokens committed by a step that verifies n drafts."""
        expected, survival = [1.0], 1.0
        for rate in self.acceptance_rates():
            survival *= rate
            expected.append(expected[-1] + survival)
        return expected

    def best(self, limit: int | None = None, lowest: int = 0) -> int:
        """The n in [lowest, limit] with the most expected tokens per second."""
        limit = self.max_drafts if limit is None else min(limit, self.max_drafts)
        if limit < lowest:
            return limit
        expected, seconds = self.expected_tokens(), self.costs.seconds()
        return max(range(lowest, limit + 1), key=lambda n: (expected[n] / seconds[n], -n))

    def cut(self, confidences: list[float]) -> int:
        """After the drafter's forward: how many of the drafts to verify, given its confidence in each slot
        (the probability of the slot's most likely token; greedy drafts are those tokens).

        A DFlash drafter's probability of its greedy draft is close to the chance that the target accepts it
        given the drafts before it (SmolLM2's shipped drafter on 20 prompts each of completion, editing and
        prose: first drafts at 0.2-0.4 accepted 21-26 %, at 0.8-0.95 72-78 %, later ones alike); a drafter
        that is right more (or less) often than it says, or drafts sampled rather than its argmax, are
        corrected by the gap measured on this call's verified drafts. Its forward is paid whatever is
        verified, so this is the n in 1..len(confidences) with the most expected tokens per second: where a
        verified draft costs something (a CPU) an unlikely tail is left out. Before any verified draft has
        shown how far to trust the confidences, every draft is verified (and shows it). The confidences
        are fixed before any draft is drawn, which keeps sampling exact.
        """
        confidences = confidences[: self.max_drafts]
        if not self.confidence_weight:
            self.verified_confidences = list(confidences)
            return len(confidences)
        gap = self.confidence_gap / self.confidence_weight
        seconds = self.costs.seconds()
        best, best_rate, expected, survival = 1, 0.0, 1.0, 1.0
        for n, confidence in enumerate(confidences, start=1):
            survival *= min(1.0, max(0.0, confidence + gap))
            expected += survival
            if expected / seconds[n] > best_rate:
                best, best_rate = n, expected / seconds[n]
        self.verified_confidences = list(confidences[:best])
        return best

    def rate(self, n: int) -> float:
        """Expected tokens per second of a step verifying n drafts (comparable across policies)."""
        return self.expected_tokens()[n] / self.costs.seconds()[n]

    def choose(self, limit: int | None = None) -> int:
        """Drafts to verify in the next step (0: a plain decoding step, the drafter is not run)."""
        if limit is not None and limit <= 0:
            return 0
        if not self.plain:
            n = self.best(limit)
            if n > 0:
                return n
            self.plain, self.plain_steps = True, 1
            return 0
        if self.plain_steps < self.probe_interval:
            self.plain_steps += 1
            return 0
        # Probe with the length drafting would use now (the statistics have faded towards the prior
        # meanwhile): the drafter's forward is most of a drafted step's cost, so a one-draft probe saves
        # little, and it tells nothing about positions 2.. nor about the cost of longer steps.
        # `observe` decides whether drafting resumes.
        self.plain_steps, self.probing = 0, True
        return self.best(limit, lowest=1)

    def fade(self) -> None:
        """A step of another kind (a copied run) took this one's place: statistics fade, and a probe that
        was due is postponed to the next step."""
        self.accepted = [x * self.decay for x in self.accepted]
        self.seen = [x * self.decay for x in self.seen]
        if self.probing:
            self.probing, self.plain_steps = False, self.probe_interval

    def observe(self, num_drafts: int, num_accepted: int | list[int], seconds: float | None = None) -> None:
        """A step verified `num_drafts` drafts, accepted the first `num_accepted` and took `seconds`
        (called for plain steps too: statistics fade with every step, drafted or not). A batch's step gives one
        `num_accepted` per row: the rows' outcomes are pooled into the same statistics."""
        if seconds:
            self.costs.observe(num_drafts, seconds)
        rows = num_accepted if isinstance(num_accepted, list) else [num_accepted]
        self.accepted = [x * self.decay for x in self.accepted]
        self.seen = [x * self.decay for x in self.seen]
        for accepted in rows:
            for k in range(min(accepted, num_drafts)):
                self.accepted[k] += 1.0
                self.seen[k] += 1.0
            if accepted < num_drafts:
                self.seen[accepted] += 1.0
        num_accepted = max(rows)
        # drafts chosen by `cut` (one row): how right were its probabilities
        if len(self.verified_confidences) == num_drafts and len(rows) == 1:
            self.confidence_gap *= self.decay
            self.confidence_weight *= self.decay
            for k, confidence in enumerate(self.verified_confidences[: num_accepted + 1]):  # up to the first rejection
                self.confidence_gap += float(k < num_accepted) - confidence
                self.confidence_weight += 1.0
        self.verified_confidences = []
        if self.probing:
            self.probing = False
            # resume only on evidence: a probe that accepted drafts and made drafting pay again
            if num_accepted > 0 and self.best() > 0:
                self.plain, self.probe_interval = False, self.min_probe_interval
            else:
                self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)


class CopyPolicy:
    """Whether a run copied from the context is verified instead of the DFlash block (or a plain step).

    Copied runs accept very differently from drafts (mostly whole or not at all), so they have their own
    statistics, and step costs without the drafter's forward (priced in the drafts' seconds until a copy
    has been verified). A copy is verified whole, as prompt lookup does, when its expected tokens per
    second beat those of the step the draft policy chose. A copy passed over is scored against the
    tokens the target commits next (`score_passed_over`): without that, statistics that learnt early
    that copies fail would never see a copy verified again, even where the text starts to repeat. The
    score is what verification would have given: under greedy decoding exactly; under sampling a copied
    token matches the target's sample with probability p(token), which is also the chance that rejection
    sampling accepts it (q one-hot).

    Args:
        max_copy (`int`): the longest copied run.
        drafts (`AdaptiveVerifyLength`, *optional*): the policy of the DFlash drafts that copies compete with
            (None: no drafts; a copy then always beats the plain step).
    """

    def __init__(self, max_copy: int, drafts: AdaptiveVerifyLength | None = None):
        self.drafts = drafts
        # a copied token costs the verify forward what a draft does (the hardware's price, `hardware.cost_prior`)
        per_draft = drafts.costs.per_draft if drafts is not None else PER_DRAFT
        self.stats = AdaptiveVerifyLength(
            max_copy, StepCosts(max_copy, draft=0.0, per_draft=per_draft,
                                fallback=drafts.costs if drafts is not None else None)
        )
        self.passed_over: list[tuple[int, list[int]]] = []  # (position of its first token, tokens)

    def pays(self, num_copied: int, num_drafts: int) -> bool:
        """Whether verifying `num_copied` copied tokens beats the step that verifies `num_drafts` drafts."""
        drafting = self.drafts.rate(num_drafts) if self.drafts is not None else 0.0
        return self.stats.rate(num_copied) >= drafting

    def pass_over(self, position: int, tokens: list[int]) -> None:
        """A copy found at `position` (the index its first token would have) was not verified."""
        self.passed_over.append((position, tokens))

    def observe(self, num_copied: int, num_accepted: int | list[int], seconds: float | None = None) -> None:
        """A step verified a copy of `num_copied` tokens and committed the first `num_accepted`."""
        self.stats.observe(num_copied, num_accepted, seconds)
        if self.drafts is not None:  # the drafts' statistics fade with every step
            self.drafts.fade()

    def score_passed_over(self, committed: list[int]) -> None:
        """Scores the copies passed over whose outcome is known, given the tokens committed from the first
        one's position on (`committed[0]` at `passed_over[0][0]`): its first mismatch, or all its length.
        No seconds are observed: nothing was run."""
        first = self.passed_over[0][0]
        pending = []
        for start, copy in self.passed_over:
            since = committed[start - first :][: len(copy)]
            matches = matching_prefix(copy, since)
            if matches < len(since) or len(since) == len(copy):
                self.stats.observe(len(copy), matches)
            else:
                pending.append((start, copy))
        self.passed_over = pending


class Plan(NamedTuple):
    """What a step verifies: a run copied from the context (`copy`, host ids), else `num_drafts` DFlash drafts
    (0: a plain step, the drafter does not run)."""

    copy: list[int] | None
    num_drafts: int


class StepPlanner:
    """The decisions of a decoding step, from host statistics only: `DFlashCandidateGenerator` takes them, and
    `benchmarks/policy_replay.py` replays them on recorded text.

    Before the drafter runs, `before_draft` picks the verify length (`drafts.choose`) and whether a copy found in
    the context beats it (`copies.pays`); after the drafter's forward, `after_draft` verifies a passed-over copy
    after all when the drafter's greedy first draft agrees with it, and cuts the drafts by the drafter's
    confidence per slot (`drafts.cut`). Both read only what is fixed before any draft is drawn, which keeps
    rejection sampling exact. `observe` feeds the step's outcome back.

    Args:
        max_drafts (`int`): drafts the drafter offers per step (at most `block_size - 1`).
        drafts (`AdaptiveVerifyLength`, *optional*): the adaptive verify length (None: always `max_drafts`).
        copies (`CopyPolicy`, *optional*): whether a copy is verified instead of the drafts (None: whenever one
            is found).
    """

    def __init__(self, max_drafts: int, drafts: AdaptiveVerifyLength | None = None, copies: CopyPolicy | None = None):
        self.max_drafts, self.drafts, self.copies = max_drafts, drafts, copies
        self.pending: tuple[int, list[int]] | None = None  # this step's copy, passed over unless the drafts agree

    def before_draft(self, position: int, room: int, copy: list[int] | None = None) -> Plan:
        """The plan before the drafter runs: `position` is the index the next token takes, `room` how many
        tokens can still follow it, `copy` the continuation found in the context (already at most `room`)."""
        self.pending = None
        limit = min(self.max_drafts, room)
        if self.drafts is not None and limit > 0:
            limit = self.drafts.choose(limit)
        if copy:
            if self.copies is None or self.copies.pays(len(copy), limit):
                return Plan(copy, 0)
            self.pending = (position, copy)
        if limit <= 0:
            self._pass_over()
            return Plan(None, 0)
        return Plan(None, limit)

    def after_draft(self, plan: Plan, first_draft: int | None = None, confidences: list[float] | None = None) -> Plan:
        """The plan once the drafter's distributions are known: `first_draft` its most likely first token after
        the logits processors, `confidences` the top probability of each of the `plan.num_drafts` slots (None
        where they are not read: on an accelerator that read would be a host sync).

        A passed-over copy is verified after all when the greedy first draft is its first token: where two
        independent proposals agree the copy is right far more often than the copy statistics say (they average
        over all copies), and it is longer than the drafts. Replayed on the same text (16 prompts per set, bf16
        costs) it took completion from 1.68x to 1.75x and editing from 2.26x to 2.36x, prose unchanged."""
        if self.pending is not None and first_draft is not None and self.pending[1][0] == first_draft:
            copy, self.pending = self.pending[1], None
            return Plan(copy, 0)
        self._pass_over()
        if self.drafts is not None and confidences is not None and plan.num_drafts > 1:
            return Plan(None, self.drafts.cut(confidences[: plan.num_drafts]))
        return plan

    def _pass_over(self) -> None:
        if self.pending is not None:
            self.copies.pass_over(*self.pending)
            self.pending = None

    def observe(self, plan: Plan, num_accepted: int | list[int], seconds: float, committed: list[int]) -> None:
        """The step verified `plan`, committed the first `num_accepted` proposed tokens (a batch: one count per row,
        pooled) and took `seconds`; `committed` is the whole sequence so far (prompt included), which scores the
        copies passed over."""
        if plan.copy is not None:
            if self.copies is not None:  # (and with it the draft policy, if any: both need "adaptive")
                self.copies.observe(len(plan.copy), num_accepted, seconds)
        elif self.drafts is not None:
            self.drafts.observe(plan.num_drafts, num_accepted, seconds)
        if self.copies is not None and self.copies.passed_over:
            self.copies.score_passed_over(committed[self.copies.passed_over[0][0] :])


__all__ = ["AdaptiveVerifyLength", "CopyPolicy", "Plan", "StepCosts", "StepPlanner", "matching_prefix"]
