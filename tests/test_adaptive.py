"""The adaptive verify length: step costs learnt online, the policy, and exactness with it on."""

import pytest
import torch
from transformers import GenerationConfig

import dflash_hf
from dflash_hf.generation import candidate_generator
from dflash_hf.generation.api import dflash_settings
from dflash_hf.generation.policy import AdaptiveVerifyLength, StepCosts
from tiny import MASK_ID, ForwardCounter, OracleDrafter, drafter, gemma4_target, qwen3_target


class FixedCosts(StepCosts):
    """Step costs that ignore the timings: a plain step 1, a drafted one `1 + draft + per_token * n`."""

    def __init__(self, max_drafts, per_token=0.1, draft=0.2):
        super().__init__(max_drafts, draft=draft, per_draft=per_token)

    def observe(self, num_drafts, seconds):
        pass


@pytest.fixture
def fixed_costs(monkeypatch):
    """Generate calls made after `fixed_costs(per_token=...)` price their steps with `FixedCosts`."""

    def use(**kwargs):
        monkeypatch.setattr(candidate_generator, "AdaptiveVerifyLength",
                            lambda max_drafts, costs=None: AdaptiveVerifyLength(max_drafts, FixedCosts(max_drafts, **kwargs)))

    return use


def with_rates(policy, rate, weight=1000.0):
    """Acceptance statistics as if each position had been accepted with `rate` many times."""
    policy.seen = [weight] * policy.max_drafts
    policy.accepted = [weight * rate] * policy.max_drafts
    return policy


def brute_force_best(rate, max_drafts, per_token, draft):
    def throughput(n):
        expected = 1 + sum(rate**k for k in range(1, n + 1))
        seconds = 1.0 if n == 0 else 1.0 + draft + per_token * n
        return expected / seconds

    return max(range(max_drafts + 1), key=lambda n: (throughput(n), -n))


# --- the step costs ------------------------------------------------------------------------------


def test_one_observation_calibrates_every_length():
    costs = StepCosts(3, draft=0.5, per_draft=0.25)
    costs.observe(2, 0.2)  # a 2-draft step took 0.2 s: 0.1 s per prior unit
    assert costs.seconds() == pytest.approx([0.1, 0.175, 0.2, 0.225])


def test_observed_lengths_keep_their_own_running_mean():
    costs = StepCosts(3, draft=0.5, per_draft=0.25, memory=4)
    costs.observe(0, 0.1)
    costs.observe(3, 0.9)  # drafting is dearer than the prior says
    costs.observe(3, 0.5)
    seconds = costs.seconds()
    assert seconds[0] == pytest.approx(0.1)
    assert seconds[3] == pytest.approx(0.9 + (0.5 - 0.9) / 4)
    # unobserved lengths: the prior shape times the mean seconds per prior unit of every step
    scale = 0.1
    for value in (0.9 / 2.25, 0.5 / 2.25):
        scale += (value - scale) / 4
    assert seconds[1] == pytest.approx(scale * 1.75) and seconds[2] == pytest.approx(scale * 2.0)


def test_a_slow_step_is_forgotten():
    costs = StepCosts(1, memory=4)
    costs.observe(0, 1.0)
    costs.observe(0, 10.0)  # e.g. the machine was busy once
    for _ in range(20):
        costs.observe(0, 1.0)
    assert costs.seconds()[0] == pytest.approx(1.0, rel=0.01)


# --- the policy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", (0.3, 0.6, 0.9))
@pytest.mark.parametrize("per_token", (0.0, 0.02, 0.1, 0.3))
def test_policy_maximises_expected_tokens_per_second(rate, per_token):
    policy = with_rates(AdaptiveVerifyLength(15, FixedCosts(15, per_token=per_token)), rate)
    a, b = policy.prior
    effective = (1000 * rate + a) / (1000 + a + b)
    assert policy.best() == brute_force_best(effective, 15, per_token, 0.2)


def test_chosen_length_moves_with_cost_and_acceptance():
    def chosen(rate, per_token, draft=0.2):
        return with_rates(AdaptiveVerifyLength(15, FixedCosts(15, per_token=per_token, draft=draft)), rate).best()

    # flat cost (a GPU with room): verify everything; steeper (a CPU): fewer; far too steep: plain steps
    by_cost = [chosen(0.8, per_token) for per_token in (0.0, 0.02, 0.05, 0.1, 0.3, 3.0)]
    assert by_cost[0] == 15 and by_cost[-1] == 0
    assert by_cost == sorted(by_cost, reverse=True) and len(set(by_cost)) >= 4
    by_rate = [chosen(rate, 0.05) for rate in (0.05, 0.3, 0.6, 0.8, 0.95)]
    assert by_rate[0] == 0 and by_rate == sorted(by_rate) and by_rate[-1] > by_rate[1]
    # a dearer drafter has to be amortised over more drafts, until plain steps win
    assert 0 < chosen(0.5, 0.05, draft=0.0) <= chosen(0.5, 0.05, draft=0.3)
    assert chosen(0.5, 0.05, draft=2.0) == 0


def test_costs_seen_in_the_call_move_the_choice():
    # the prior says a 7-draft step costs 2x a plain one; this call's steps say 8x: fewer drafts pay
    policy = with_rates(AdaptiveVerifyLength(7, StepCosts(7, draft=0.3, per_draft=0.1)), 0.7)
    by_prior = policy.best()
    assert by_prior >= 4
    for _ in range(30):
        policy.observe(0, 0, seconds=0.01)
        policy.observe(7, 7, seconds=0.08)
    assert with_rates(policy, 0.7).best() < by_prior


def test_starts_optimistic_then_stops_drafting_a_useless_drafter_and_probes_with_backoff():
    policy = AdaptiveVerifyLength(7, FixedCosts(7, per_token=0.02))
    assert policy.choose() == 7  # the prior: draft the whole block first
    policy.observe(7, 0)
    choices = []
    for _ in range(400):
        n = policy.choose()
        choices.append(n)
        policy.observe(n, 0)  # every draft rejected
    drafted = [i for i, n in enumerate(choices) if n > 0]
    assert len(drafted) < 15  # a few steps to learn, then only probes
    gaps = [b - a for a, b in zip(drafted, drafted[1:])][-4:]
    assert gaps == sorted(gaps) and gaps[-1] == 129  # probe interval doubled up to its maximum
    first_plain = choices.index(0)
    probes = [choices[i] for i in drafted if i > first_plain]
    # a probe verifies what drafting would verify now, not one draft: after 128 plain steps the faded
    # statistics are back near the prior, and the probe checks the whole block
    assert all(n >= 2 for n in probes) and probes[-3:] == [7, 7, 7]
    assert choices[-1] == 0


def test_drafting_resumes_when_probes_succeed():
    policy = AdaptiveVerifyLength(7, FixedCosts(7, per_token=0.05))
    for _ in range(20):
        policy.observe(policy.choose(), 0)
    assert policy.plain
    choices = []
    for _ in range(80):
        n = policy.choose()
        choices.append(n)
        policy.observe(n, n)  # the text became easy: every draft accepted
    first_probe = next(i for i, n in enumerate(choices) if n > 0)
    assert all(n > 0 for n in choices[first_probe:])  # one good probe is enough to resume
    assert choices[-10:] == [7] * 10
    assert policy.probe_interval == policy.min_probe_interval


def test_observations_are_censored_at_the_verified_length():
    policy = AdaptiveVerifyLength(7, FixedCosts(7))
    policy.observe(3, 1)  # draft 1 accepted, draft 2 rejected, 3..7 not seen
    assert policy.seen == [1.0, 1.0, 0, 0, 0, 0, 0] and policy.accepted == [1.0, 0, 0, 0, 0, 0, 0]
    policy.observe(2, 2)
    decay = policy.decay
    assert policy.seen[:3] == pytest.approx([decay + 1, decay + 1, 0])
    policy.observe(0, 0)  # a plain step tells nothing about the drafter; old evidence fades
    assert policy.seen[:3] == pytest.approx([decay * (decay + 1), decay * (decay + 1), 0])


def test_a_position_never_verified_is_priced_like_the_ones_before_it():
    # Only 3-draft steps so far, all accepted: positions 4..15 were never verified. Priced at the flat
    # prior (0.75) they would keep the policy at short lengths forever; priced like position 3, the
    # policy verifies longer runs and finds out.
    policy = AdaptiveVerifyLength(15, FixedCosts(15, per_token=0.05))
    for _ in range(50):
        policy.observe(3, 3)
    rates = policy.acceptance_rates()
    assert min(rates[:3]) > 0.95 and min(rates[3:]) > 0.95
    assert policy.best() == 15
    # evidence still wins over the extrapolation: position 4 always rejected stops the run there
    for _ in range(50):
        policy.observe(6, 3)
    assert policy.acceptance_rates()[3] < 0.1 and policy.best() == 3


def calibrated(policy):
    """`policy` after one verified draft whose probability (1) was right: its probabilities are trusted as they are."""
    policy.observe(policy.cut([1.0]), 1)
    return policy


@pytest.mark.parametrize("per_token", (0.0, 0.05, 0.3))
def test_cut_keeps_the_drafts_whose_expected_tokens_pay_for_their_verification(per_token):
    policy = calibrated(AdaptiveVerifyLength(7, FixedCosts(7, per_token=per_token)))
    confidences = [0.95, 0.9, 0.2, 0.9, 0.9, 0.05, 0.99]

    def throughput(n):  # drafter paid whatever is verified: 1 + draft + per_token * n
        expected = 1 + sum(torch.tensor(confidences[:k]).prod().item() for k in range(1, n + 1))
        return expected / (1.2 + per_token * n)

    best = max(range(1, 8), key=lambda n: (throughput(n), -n))
    assert policy.cut(confidences) == best
    assert best == {0.0: 7, 0.05: 5, 0.3: 2}[per_token]  # free verification keeps every draft
    assert policy.cut([0.01] * 7) == (7 if per_token == 0.0 else 1)  # at least one: the drafter already ran


def test_cut_learns_how_far_the_drafters_probabilities_are_off():
    # always right but sure of nothing (uniform over 64 tokens): before any evidence every draft is verified,
    # and then still, because it was right
    policy = AdaptiveVerifyLength(7, FixedCosts(7, per_token=0.1))
    unsure = [1 / 64] * 7
    assert policy.cut(unsure) == 7
    policy.observe(7, 7)
    assert policy.cut(unsure) == 7
    assert calibrated(AdaptiveVerifyLength(7, FixedCosts(7, per_token=0.1))).cut(unsure) == 1  # taken at its word
    # sure of everything but right only about its first draft: the tail is cut after a few steps
    sure = calibrated(AdaptiveVerifyLength(7, FixedCosts(7, per_token=0.1)))
    assert sure.cut([0.99] * 7) == 7
    for _ in range(5):
        sure.observe(sure.cut([0.99] * 7), 1)
    assert sure.cut([0.99] * 7) < 4
    # a length `cut` did not choose teaches nothing about the probabilities
    fresh = calibrated(AdaptiveVerifyLength(7, FixedCosts(7, per_token=0.1)))
    fresh.cut(unsure)
    fresh.observe(3, 3)
    assert fresh.cut(unsure) == 1


def test_unlikely_drafts_are_not_verified_and_output_is_unchanged(fixed_costs):
    fixed_costs(per_token=0.1)
    target = dflash_hf.enable(qwen3_target(), lookup=None)
    ids = prompt(4)
    expected = target.generate(ids, max_new_tokens=40, do_sample=False)
    oracle = drafter(0, cls=OracleDrafter, block_size=8, target_layer_ids=(0, 3))
    oracle.arm(expected, target.get_output_embeddings())
    oracle.slot_scales = {4: 0.5}  # its fourth draft right but barely more likely than any other token
    assert torch.equal(target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=oracle), expected)
    lengths = oracle.last_stats.verify_lengths
    # the first block as the policy chose it (nothing yet says how far to trust the probabilities; the unsure draft is right
    # too), then the first three (the last step: what room is left)
    assert lengths[0] > 3 and set(lengths[1:-1]) == {3} and lengths[-1] <= 3
    assert oracle.last_stats.drafted_tokens == oracle.last_stats.accepted_tokens
    oracle.arm(expected, target.get_output_embeddings())
    out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=oracle, dflash_verify_length=None)
    assert torch.equal(out, expected) and max(oracle.last_stats.verify_lengths) == 7  # a fixed length is kept


def test_limit_is_respected():
    policy = AdaptiveVerifyLength(7, FixedCosts(7, per_token=0.0))
    assert policy.choose(limit=3) == 3


# --- generation with the policy on ---------------------------------------------------------------


def prompt(seed, length=6):
    return torch.randint(0, MASK_ID, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make_target", (qwen3_target, gemma4_target))
@pytest.mark.parametrize("per_token", (0.0, 0.08, 0.4))
@pytest.mark.parametrize("wrong_every", (0, 2, 1))
def test_greedy_equality_with_adaptation(make_target, per_token, wrong_every, fixed_costs):
    fixed_costs(per_token=per_token)
    target = dflash_hf.enable(make_target(), lookup=None)  # the drafts' policy alone
    ids = prompt(3)
    expected = target.generate(ids, max_new_tokens=48, do_sample=False)
    oracle = drafter(0, cls=OracleDrafter, block_size=8, target_layer_ids=(0, 3))
    oracle.arm(expected, target.get_output_embeddings(), wrong_every=wrong_every, wrong_slot=1)
    with ForwardCounter(target) as forwards:
        assert torch.equal(target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=oracle), expected)
    stats = oracle.last_stats
    assert forwards.count == len(stats.acceptance_lengths) + 1  # one entry per verify forward, the prefill apart
    assert all(a <= n + 1 for a, n in zip(stats.acceptance_lengths, stats.verify_lengths))
    assert stats.committed_tokens == 47
    if wrong_every == 0 and per_token == 0.0:
        assert stats.verify_lengths[0] == 7 and stats.plain_steps == 0
    if wrong_every == 1 and per_token > 0:
        # slot 1 wrong at every step: nothing is ever accepted, the policy falls back to plain steps
        assert stats.plain_steps > len(stats.verify_lengths) // 2


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_random_drafter_greedy_equality_with_costs_learnt_online(seed):
    target = dflash_hf.enable(qwen3_target())  # the default: adaptive, step costs timed in the call
    model = drafter(seed, block_size=4)
    for length in (1, 7):
        ids = prompt(seed * 10 + length, length)
        expected = target.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.equal(target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=model), expected)


def test_per_call_verify_length():
    target = dflash_hf.enable(qwen3_target())
    model = drafter(0, block_size=8)
    ids = prompt(5)
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=model, dflash_verify_length=2)
    assert torch.equal(out, expected) and max(model.last_stats.verify_lengths) == 2
    config = GenerationConfig(max_new_tokens=20, do_sample=False, dflash_verify_length=0)
    out = target.generate(ids, generation_config=config, assistant_model=model)
    assert torch.equal(out, expected) and set(model.last_stats.verify_lengths) == {0}
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=model, dflash_verify_length=None)
    assert torch.equal(out, expected) and max(model.last_stats.verify_lengths) == 7
    assert dflash_settings(target)["verify_length"] == "adaptive"  # nothing sticks


def test_bad_verify_length_settings():
    target = qwen3_target()
    with pytest.raises(ValueError, match="verify_length must be 'adaptive'"):
        dflash_hf.enable(target, verify_length="auto")
    dflash_hf.enable(target)
    ids = prompt(0)
    with pytest.raises(ValueError, match="verify_length must be"):
        target.generate(ids, max_new_tokens=4, assistant_model=drafter(0), dflash_verify_length=-1)
    with pytest.raises(ValueError, match="applies to DFlash calls only"):
        target.generate(ids, max_new_tokens=4, dflash_verify_length=2)


def test_sampling_with_plain_steps_runs_and_counts(fixed_costs):
    fixed_costs(per_token=5.0)  # drafting never pays
    target = dflash_hf.enable(qwen3_target(), lookup=None)  # (a copied step runs no drafter either)
    model = drafter(0, block_size=8)
    torch.manual_seed(0)
    with ForwardCounter(model) as drafter_forwards:
        out = target.generate(prompt(1), max_new_tokens=16, do_sample=True, assistant_model=model)
    stats = model.last_stats
    assert out.shape[1] == 6 + 16
    # a plain step does not run the drafter
    assert stats.plain_steps >= 10 and drafter_forwards.count == len(stats.verify_lengths) - stats.plain_steps


@pytest.mark.parametrize("wrong_every", (2, 1))
def test_hybrid_target_with_plain_steps_and_rollbacks(wrong_every, fixed_costs):
    from test_hybrid import hybrid_target

    fixed_costs(per_token=0.08)
    target = dflash_hf.enable(hybrid_target(), lookup=None)  # the drafts' policy alone
    ids = prompt(9)
    expected = target.generate(ids, max_new_tokens=40, do_sample=False)
    oracle = drafter(0, cls=OracleDrafter, block_size=8, target_layer_ids=(0, 3))
    oracle.arm(expected, target.get_output_embeddings(), wrong_every=wrong_every, wrong_slot=1)
    out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=oracle, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    stats = oracle.last_stats
    assert stats.drafted_tokens > stats.accepted_tokens  # rejections were rolled back
    if wrong_every == 1:
        assert stats.plain_steps > 0  # and plain steps mixed in
    assert out.cache.get_seq_length() == expected.shape[1] - 1


# SmolLM2-135M's bfloat16 forward over 1/2/4/8/16 tokens on the AVX2-only AMD EPYC of earlier sessions (README), ms
EPYC_FORWARD_MS = {1: 37.0, 2: 49.0, 4: 77.0, 8: 134.0, 16: 253.0}


def _epyc_step_ms(num_drafts: int, drafter_ms: float) -> float:
    """A step verifying `num_drafts` drafts on that EPYC: the target's forward over `num_drafts + 1` tokens
    (interpolated between the measured widths) plus the drafter's forward when it runs."""
    width, widths = num_drafts + 1, sorted(EPYC_FORWARD_MS)
    low = max(w for w in widths if w <= width)
    high = min(w for w in widths if w >= width)
    forward = EPYC_FORWARD_MS[low] + (EPYC_FORWARD_MS[high] - EPYC_FORWARD_MS[low]) * (width - low) / max(high - low, 1)
    return forward + (drafter_ms if num_drafts else 0.0)


def _epyc_rates(costs, rate, drafter_ms, steps=400):
    """(the adaptive policy's tokens per ms, the best fixed verify length's) on a simulated EPYC where each draft is
    accepted with `rate` after the ones before it; the best is found by trying every length against those costs."""
    import random

    draws, policy = random.Random(0), AdaptiveVerifyLength(15, costs)
    tokens = ms = 0.0
    for _ in range(steps):
        n = policy.choose()
        accepted = next((k for k in range(n) if draws.random() > rate), n)
        step = _epyc_step_ms(n, drafter_ms)
        policy.observe(n, accepted, seconds=step / 1000)
        tokens, ms = tokens + accepted + 1, ms + step
    best = max(sum(rate**k for k in range(n + 1)) / _epyc_step_ms(n, drafter_ms) for n in range(16))
    return tokens / ms, best


# (acceptance rate, the drafter's forward in ms: not measured on that EPYC, so from 0.3 to 1.6 of a token's step)
EPYC_CASES = [(0.55, 30.0), (0.55, 60.0), (0.7, 10.0), (0.7, 30.0), (0.85, 10.0), (0.85, 30.0)]


@pytest.mark.parametrize("rate, drafter_ms", EPYC_CASES)
def test_on_a_cpu_that_emulates_bfloat16_the_policy_reaches_the_best_rate(rate, drafter_ms):
    """With the hardware's prior (every verified row priced near a token), the policy gets within 10 % of the best
    verify length's tokens per second on the EPYC's measured forward costs: plain steps where no length pays
    (tau ~2.2 there), a few drafts where some do; so it is never far below plain decoding's rate either."""
    from dflash_hf import hardware

    emulated = StepCosts(15, draft=hardware.EMULATED_DRAFT, per_draft=hardware.EMULATED_PER_DRAFT)
    policy_rate, best = _epyc_rates(emulated, rate, drafter_ms)
    plain = 1.0 / EPYC_FORWARD_MS[1]
    assert policy_rate >= 0.9 * best and best >= plain
    assert policy_rate >= 0.9 * plain


def test_on_a_cpu_that_emulates_bfloat16_a_native_prior_falls_short():
    """The same simulation with the prior of a native device: a drafted step's seconds price a plain step at 2-3
    times its cost, the policy keeps drafting, and it stays far below the best rate (which is plain decoding's)."""
    policy_rate, best = _epyc_rates(StepCosts(15, draft=0.3, per_draft=0.05), rate=0.55, drafter_ms=60.0)
    assert best == 1.0 / EPYC_FORWARD_MS[1]
    assert policy_rate < 0.75 * best
