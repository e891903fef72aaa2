"""The adaptive verify length: its cost profile, its policy, and exactness with it on."""

import json

import pytest
import torch
from transformers import GenerationConfig

import dflash_hf
from dflash_hf.generation import profile as profiles
from dflash_hf.generation.enable import dflash_settings
from dflash_hf.generation.policy import AdaptiveVerifyLength
from dflash_hf.generation.profile import CostProfile
from tiny import MASK_ID, OracleDrafter, drafter, gemma4_target, qwen3_target


def linear_profile(block_size=8, base=1.0, per_token=0.1, draft=0.2, contexts=(128, 1024)):
    """Injected timings: a target forward costs `base + per_token * (q - 1)`, a drafting step `draft`."""
    queries = list(range(1, block_size + 1))
    row = [base + per_token * (q - 1) for q in queries]
    return CostProfile(queries, list(contexts), [row for _ in contexts], [draft for _ in contexts])


def with_rates(policy, rate, weight=1000.0):
    """Acceptance statistics as if each position had been accepted with `rate` many times."""
    policy.seen = [weight] * policy.max_drafts
    policy.accepted = [weight * rate] * policy.max_drafts
    return policy


def brute_force_best(rate, max_drafts, base, per_token, draft):
    def throughput(n):
        expected = 1 + sum(rate**k for k in range(1, n + 1))
        seconds = base if n == 0 else draft + base + per_token * n
        return expected / seconds

    return max(range(max_drafts + 1), key=lambda n: (throughput(n), -n))


# --- the profile ---------------------------------------------------------------------------------


def test_profile_interpolates_between_measurements():
    profile = CostProfile([1, 4, 16], [100, 1000], [[1.0, 2.0, 5.0], [2.0, 3.0, 8.0]], [0.5, 1.5])
    assert profile.target_time(1, 100) == 1.0
    assert profile.target_time(16, 1000) == 8.0
    assert profile.target_time(10, 100) == pytest.approx(3.5)  # halfway between 4 (2.0) and 16 (5.0)
    assert profile.target_time(4, 550) == pytest.approx(2.5)
    assert profile.target_time(1, 1900) == pytest.approx(3.0)  # extended linearly past the last context
    assert profile.target_time(1, 0) == pytest.approx(1.0)  # never below the smallest measurement
    assert profile.draft_time(550) == pytest.approx(1.0)
    assert CostProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_profile_shape_is_checked():
    with pytest.raises(ValueError, match="one target time per query length"):
        CostProfile([1, 2], [10], [[1.0]], [0.1])
    with pytest.raises(ValueError, match="one target row"):
        CostProfile([1], [10, 20], [[1.0]], [0.1, 0.2])


def test_measured_profile_covers_the_block(monkeypatch, tmp_path):
    target, model = qwen3_target(), drafter(block_size=8)
    profile = profiles.measure_profile(target, model, context_lengths=(8, 32), repeats=1)
    assert profile.query_lengths == [1, 2, 3, 4, 8]
    assert profile.context_lengths == [8, 32]
    for row in profile.target_seconds:
        assert all(t > 0 for t in row) and row == sorted(row)  # more query tokens never cost less
    assert all(t > 0 for t in profile.drafter_seconds)


def test_profile_is_measured_once_and_cached_per_model_device_and_dtype(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_HF_PROFILE_DIR", str(tmp_path))
    monkeypatch.setattr(profiles, "_MEMORY", {})
    calls = []
    fake = linear_profile()

    def measure(target, model, **kwargs):
        calls.append(next(target.parameters()).dtype)
        return CostProfile(**{k: v for k, v in fake.to_dict().items() if k != "version"})

    monkeypatch.setattr(profiles, "measure_profile", measure)
    target, model = qwen3_target(), drafter(block_size=8)
    first = profiles.load_profile(target, model)
    assert len(calls) == 1 and first.key
    assert json.loads((tmp_path / f"{first.key}.json").read_text())["target_seconds"] == fake.target_seconds

    monkeypatch.setattr(profiles, "_MEMORY", {})  # a new process: read from disk, no measurement
    assert profiles.load_profile(target, model) == first and len(calls) == 1

    target.to(torch.float64)  # another dtype is another profile
    second = profiles.load_profile(target, model)
    assert len(calls) == 2 and second.key != first.key

    monkeypatch.setattr(profiles, "_MEMORY", {})
    (tmp_path / f"{second.key}.json").write_text("{not json")  # unreadable: measured again
    profiles.load_profile(target, model)
    assert len(calls) == 3


def test_profile_key_follows_the_drafter():
    target = qwen3_target()
    assert profiles.profile_key(target, drafter(block_size=4)) != profiles.profile_key(target, drafter(block_size=8))
    assert profiles.profile_key(target, drafter(0, block_size=4)) == profiles.profile_key(target, drafter(1, block_size=4))


# --- the policy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", (0.3, 0.6, 0.9))
@pytest.mark.parametrize("per_token", (0.0, 0.02, 0.1, 0.3))
def test_policy_maximises_expected_tokens_per_second(rate, per_token):
    policy = with_rates(AdaptiveVerifyLength(15, linear_profile(16, per_token=per_token)), rate)
    a, b = policy.prior
    effective = (1000 * rate + a) / (1000 + a + b)
    assert policy.best(500) == brute_force_best(effective, 15, 1.0, per_token, 0.2)


def test_chosen_length_moves_with_cost_and_acceptance():
    def chosen(rate, per_token, draft=0.2):
        return with_rates(AdaptiveVerifyLength(15, linear_profile(16, per_token=per_token, draft=draft)), rate).best(500)

    # flat cost (a GPU with room): verify everything; steeper (a CPU): fewer; far too steep: plain steps
    by_cost = [chosen(0.8, per_token) for per_token in (0.0, 0.02, 0.05, 0.1, 0.3, 3.0)]
    assert by_cost[0] == 15 and by_cost[-1] == 0
    assert by_cost == sorted(by_cost, reverse=True) and len(set(by_cost)) >= 4
    by_rate = [chosen(rate, 0.05) for rate in (0.05, 0.3, 0.6, 0.8, 0.95)]
    assert by_rate[0] == 0 and by_rate == sorted(by_rate) and by_rate[-1] > by_rate[1]
    # a dearer drafter has to be amortised over more drafts, until plain steps win
    assert 0 < chosen(0.5, 0.05, draft=0.0) <= chosen(0.5, 0.05, draft=0.3)
    assert chosen(0.5, 0.05, draft=2.0) == 0


def test_context_length_selects_the_profile_row():
    # short contexts: long forwards cheap; long contexts: expensive
    profile = CostProfile([1, 8], [100, 2000], [[1.0, 1.1], [1.0, 8.0]], [0.1, 0.1])
    policy = with_rates(AdaptiveVerifyLength(7, profile), 0.7)
    assert policy.best(100) == 7
    assert policy.best(2000) < policy.best(100)


def test_starts_optimistic_then_stops_drafting_a_useless_drafter_and_probes_with_backoff():
    policy = AdaptiveVerifyLength(7, linear_profile(8, per_token=0.02))
    assert policy.choose(100) == 7  # the prior: draft the whole block first
    policy.observe(7, 0)
    choices = []
    for _ in range(400):
        n = policy.choose(100)
        choices.append(n)
        policy.observe(n, 0)  # every draft rejected
    drafted = [i for i, n in enumerate(choices) if n > 0]
    assert len(drafted) < 15  # a few steps to learn, then only probes
    gaps = [b - a for a, b in zip(drafted, drafted[1:])][-4:]
    assert gaps == sorted(gaps) and gaps[-1] == 129  # probe interval doubled up to its maximum
    first_plain = choices.index(0)
    assert all(choices[i] == 1 for i in drafted if i > first_plain)  # probes verify a single draft
    assert choices[-1] == 0


def test_drafting_resumes_when_probes_succeed():
    policy = AdaptiveVerifyLength(7, linear_profile(8, per_token=0.05))
    for _ in range(20):
        policy.observe(policy.choose(100), 0)
    assert policy.plain
    choices = []
    for _ in range(80):
        n = policy.choose(100)
        choices.append(n)
        policy.observe(n, n)  # the text became easy: every draft accepted
    first_probe = next(i for i, n in enumerate(choices) if n > 0)
    assert all(n > 0 for n in choices[first_probe:])  # one good probe is enough to resume
    assert choices[-10:] == [7] * 10
    assert policy.probe_interval == policy.min_probe_interval


def test_observations_are_censored_at_the_verified_length():
    policy = AdaptiveVerifyLength(7, linear_profile())
    policy.observe(3, 1)  # draft 1 accepted, draft 2 rejected, 3..7 not seen
    assert policy.seen == [1.0, 1.0, 0, 0, 0, 0, 0] and policy.accepted == [1.0, 0, 0, 0, 0, 0, 0]
    policy.observe(2, 2)
    decay = policy.decay
    assert policy.seen[:3] == pytest.approx([decay + 1, decay + 1, 0])
    policy.observe(0, 0)  # a plain step tells nothing about the drafter; old evidence fades
    assert policy.seen[:3] == pytest.approx([decay * (decay + 1), decay * (decay + 1), 0])


def test_limit_is_respected():
    policy = AdaptiveVerifyLength(7, linear_profile(per_token=0.0))
    assert policy.choose(100, limit=3) == 3


# --- generation with the policy on ---------------------------------------------------------------


def prompt(seed, length=6):
    return torch.randint(0, MASK_ID, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make_target", (qwen3_target, gemma4_target))
@pytest.mark.parametrize("per_token", (0.0, 0.08, 0.4))
@pytest.mark.parametrize("wrong_every", (0, 2, 1))
def test_greedy_equality_with_adaptation(make_target, per_token, wrong_every):
    target = dflash_hf.enable(make_target(), cost_profile=linear_profile(8, per_token=per_token))
    ids = prompt(3)
    expected = target.generate(ids, max_new_tokens=48, do_sample=False)
    oracle = drafter(0, cls=OracleDrafter, block_size=8, target_layer_ids=(0, 3))
    oracle.arm(expected, target.get_output_embeddings(), wrong_every=wrong_every, wrong_slot=1)
    assert torch.equal(target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=oracle), expected)
    stats = oracle.last_stats
    assert len(stats.verify_lengths) == len(stats.acceptance_lengths)
    assert all(a <= n + 1 for a, n in zip(stats.acceptance_lengths, stats.verify_lengths))
    assert stats.committed_tokens == 47
    if wrong_every == 0 and per_token == 0.0:
        assert stats.verify_lengths[0] == 7 and stats.plain_steps == 0
    if wrong_every == 1 and per_token > 0:
        # slot 1 wrong at every step: nothing is ever accepted, the policy falls back to plain steps
        assert stats.plain_steps > len(stats.verify_lengths) // 2


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_random_drafter_greedy_equality_with_measured_profile(seed):
    target = dflash_hf.enable(qwen3_target())  # the default: adaptive, profile measured on this machine
    model = drafter(seed, block_size=4)
    for length in (1, 7):
        ids = prompt(seed * 10 + length, length)
        expected = target.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.equal(target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=model), expected)
        assert len(model.last_stats.verify_lengths) == len(model.last_stats.acceptance_lengths)


def test_per_call_verify_length():
    target = dflash_hf.enable(qwen3_target(), cost_profile=linear_profile(8))
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
    with pytest.raises(TypeError, match="cost_profile"):
        dflash_hf.enable(target, cost_profile={"target_seconds": []})
    dflash_hf.enable(target)
    ids = prompt(0)
    with pytest.raises(ValueError, match="verify_length must be"):
        target.generate(ids, max_new_tokens=4, assistant_model=drafter(0), dflash_verify_length=-1)
    with pytest.raises(ValueError, match="applies to DFlash calls only"):
        target.generate(ids, max_new_tokens=4, dflash_verify_length=2)


def test_sampling_with_plain_steps_runs_and_counts():
    target = dflash_hf.enable(qwen3_target(), cost_profile=linear_profile(8, per_token=5.0))  # drafting never pays
    model = drafter(0, block_size=8)
    torch.manual_seed(0)
    out = target.generate(prompt(1), max_new_tokens=16, do_sample=True, assistant_model=model)
    stats = model.last_stats
    assert out.shape[1] == 6 + 16
    assert stats.plain_steps >= 10 and stats.drafted_tokens == sum(stats.verify_lengths)


@pytest.mark.parametrize("wrong_every", (2, 1))
def test_hybrid_target_with_plain_steps_and_rollbacks(wrong_every):
    from test_hybrid import hybrid_target

    target = dflash_hf.enable(hybrid_target(), cost_profile=linear_profile(8, per_token=0.08))
    ids = prompt(9)
    expected = target.generate(ids, max_new_tokens=40, do_sample=False)
    oracle = drafter(0, cls=OracleDrafter, block_size=8, target_layer_ids=(0, 3))
    oracle.arm(expected, target.get_output_embeddings(), wrong_every=wrong_every, wrong_slot=1)
    out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=oracle, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    stats = oracle.last_stats
    assert stats.replay_forwards > 0  # rejections were rolled back
    if wrong_every == 1:
        assert stats.plain_steps > 0  # and plain steps (no snapshot, nothing to roll back) mixed in
    assert out.past_key_values.get_seq_length() == expected.shape[1] - 1
