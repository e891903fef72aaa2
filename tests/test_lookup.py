"""Copies from the context (prompt lookup) combined with DFlash drafts: lossless, and chosen by the policy."""

import pytest
import torch

import dflash_hf
import tiny
from dflash_hf.generation.policy import AdaptiveVerifyLength, CopyPolicy, StepCosts


@pytest.fixture(scope="module")
def looping():
    """A tiny target whose greedy continuation of this prompt soon repeats itself: copies pay."""
    target = tiny.qwen3_target()
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6]])  # continued by runs of 36s and 5s
    script = target.generate(prompt, max_new_tokens=40, do_sample=False)
    return target, prompt, script


def test_greedy_output_unchanged_and_copies_accepted(looping):
    target, prompt, script = looping
    useless = tiny.drafter(0, block_size=4)
    for verify_length in ("adaptive", None):
        out = dflash_hf.generate(target, prompt, max_new_tokens=40, do_sample=False, assistant_model=useless,
                                 prompt_lookup_num_tokens=6, dflash_verify_length=verify_length)
        assert torch.equal(out, script)
        stats = useless.last_stats
        assert stats.copied_steps > 0 and stats.copied_accepted_tokens > 0
    # without lookup the same useless drafter commits (about) one token per forward
    dflash_hf.generate(target, prompt, max_new_tokens=40, do_sample=False, assistant_model=useless, dflash_lookup=None)
    assert useless.last_stats.copied_steps == 0


def test_copies_by_default_with_the_adaptive_verify_length_only(looping):
    target, prompt, script = looping
    useless = tiny.drafter(0, block_size=4)
    assert torch.equal(dflash_hf.generate(target, prompt, max_new_tokens=40, do_sample=False, assistant_model=useless),
                       script)
    assert useless.last_stats.copied_steps > 0
    # a fixed verify length would verify every copy found in place of the block: no copies unless asked
    dflash_hf.generate(target, prompt, max_new_tokens=40, do_sample=False, assistant_model=useless,
                       dflash_verify_length=None)
    assert useless.last_stats.copied_steps == 0
    enabled = dflash_hf.enable(tiny.qwen3_target(), verify_length=2)
    enabled.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=useless)
    assert useless.last_stats.copied_steps == 0


def test_copies_need_fewer_forwards_than_the_useless_drafter_alone(looping):
    target, prompt, script = looping
    useless = tiny.drafter(0, block_size=4)
    kwargs = dict(max_new_tokens=40, do_sample=False, assistant_model=useless, dflash_verify_length=None)
    dflash_hf.generate(target, prompt, **kwargs)
    alone = useless.last_stats.num_target_forwards
    dflash_hf.generate(target, prompt, prompt_lookup_num_tokens=6, **kwargs)
    assert useless.last_stats.num_target_forwards < alone - 8


def test_a_copy_is_verified_whole(looping, monkeypatch):
    # prompt lookup verifies all it found; cutting a copy to a "best" length only adds forwards
    target, prompt, script = looping
    from dflash_hf.generation.candidate_generator import DFlashCandidateGenerator

    found_and_verified = []
    propose = DFlashCandidateGenerator.propose

    def spy(self, input_ids, model_kwargs, first=False, room=None):
        found = len(self.lookup.find(self.main_model_max_length)[1])
        # as if copies here were often right for two tokens and then wrong: a "best length" would be 2
        for _ in range(10):
            self.planner.copies.stats.observe(6, 2)
        result = propose(self, input_ids, model_kwargs, first, room)
        if result.copied:
            found_and_verified.append((min(found, room), result.ids.shape[1] - input_ids.shape[1]))
        return result

    monkeypatch.setattr(DFlashCandidateGenerator, "propose", spy)
    useless = tiny.drafter(0, block_size=4)
    out = dflash_hf.generate(target, prompt, max_new_tokens=40, do_sample=False, assistant_model=useless,
                             prompt_lookup_num_tokens=6)
    assert torch.equal(out, script)
    assert len(found_and_verified) == useless.last_stats.copied_steps > 2
    assert all(found == verified for found, verified in found_and_verified)
    assert max(verified for _, verified in found_and_verified) == 6  # longer than the drafter's block


def test_copies_passed_over_are_still_scored_so_copying_resumes(looping, monkeypatch):
    # The copy statistics start as if every copy had failed at once (as on prose before the text
    # repeats): the policy passes copies over, but scores them against what the target then commits,
    # and copies again once they would have been accepted.
    target, prompt, _ = looping
    from dflash_hf.generation.candidate_generator import DFlashCandidateGenerator

    propose = DFlashCandidateGenerator.propose

    def pessimistic(self, *args, **kwargs):
        if not getattr(self, "seeded", False):
            self.seeded = True
            for _ in range(40):
                self.planner.copies.stats.observe(6, 0)
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(DFlashCandidateGenerator, "propose", pessimistic)
    useless = tiny.drafter(0, block_size=4)
    script = target.generate(prompt, max_new_tokens=60, do_sample=False)
    out = dflash_hf.generate(target, prompt, max_new_tokens=60, do_sample=False, assistant_model=useless,
                             prompt_lookup_num_tokens=6)
    assert torch.equal(out, script)
    stats = useless.last_stats
    assert stats.copied_steps >= 3 and stats.copied_accepted_tokens >= 10
    # and the copies it did verify came after copies it had passed over
    first_copy = next(i for i, n in enumerate(stats.verify_lengths) if n > 3)
    assert first_copy > 0


def test_enable_setting_and_per_call_override(looping):
    target, prompt, script = looping
    target = dflash_hf.enable(tiny.qwen3_target(), lookup=6)
    useless = tiny.drafter(0, block_size=4)
    assert torch.equal(target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=useless), script)
    assert useless.last_stats.copied_steps > 0
    target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=useless, dflash_lookup=None)
    assert useless.last_stats.copied_steps == 0


def test_policy_copies_only_when_the_copy_pays_more_than_drafting():
    drafts = AdaptiveVerifyLength(3, StepCosts(3))
    copies = CopyPolicy(6, drafts)
    for _ in range(20):  # drafts always fully accepted, copies always rejected at once
        drafts.observe(3, 3, 1.3)
        copies.stats.observe(6, 0, 1.6)
    assert not copies.pays(6, 3)
    for _ in range(40):  # now the reverse
        drafts.observe(3, 0, 1.3)
        copies.stats.observe(6, 6, 1.6)
    assert copies.pays(6, drafts.best(3))
    assert CopyPolicy(6).pays(1, 0)  # without drafts a copy always beats the plain step


def test_copies_passed_over_are_scored_as_verifying_them_would_have_been():
    scored, verified = CopyPolicy(3), CopyPolicy(3)
    scored.pass_over(10, [1, 2, 3])
    scored.pass_over(11, [2, 3, 9])
    scored.score_passed_over([1, 2])  # tokens 10 and 11 committed: neither outcome is known yet
    assert [start for start, _ in scored.passed_over] == [10, 11]
    scored.score_passed_over([1, 2, 3, 4])  # the first copy was right throughout, the second up to its third token
    assert scored.passed_over == []
    verified.observe(3, 3)
    verified.observe(3, 2)
    assert scored.stats.expected_tokens() == pytest.approx(verified.stats.expected_tokens())
    assert scored.stats.costs.mean == [None] * 4  # nothing was run: no step cost observed


def test_unobserved_copy_costs_are_priced_in_the_drafts_seconds():
    drafts = StepCosts(3)
    drafts.observe(0, 0.05)  # a plain step took 50 ms
    copies = StepCosts(6, draft=0.0, per_draft=0.1, fallback=drafts)
    assert copies.seconds()[0] == pytest.approx(0.05)
    assert copies.seconds()[2] == pytest.approx(0.05 * (1 + 0.1 * 2))


def test_a_copy_passed_over_is_verified_when_the_first_draft_agrees_with_it(looping, monkeypatch):
    # Copies never pay by the statistics here; an oracle drafter's first draft is always right, so it
    # agrees with every right copy, and those are verified anyway (whole, longer than the block).
    target, prompt, script = looping
    monkeypatch.setattr(CopyPolicy, "pays", lambda self, num_copied, num_drafts: False)
    oracle = tiny.drafter(0, cls=tiny.OracleDrafter, block_size=4).arm(script, target.get_output_embeddings())
    out = dflash_hf.generate(target, prompt, max_new_tokens=40, do_sample=False, assistant_model=oracle,
                             prompt_lookup_num_tokens=6)
    assert torch.equal(out, script)
    stats = oracle.last_stats
    assert stats.copied_steps > 0 and max(stats.verify_lengths) == 6
    dflash_hf.generate(target, prompt, max_new_tokens=40, do_sample=False, assistant_model=oracle, dflash_lookup=None)
    assert stats.num_target_forwards < oracle.last_stats.num_target_forwards  # than its blocks of 3 drafts alone



@pytest.mark.parametrize("max_length", (30, 1 << 20))
def test_the_host_lookup_proposes_what_transformers_prompt_lookup_does(max_length):
    # the loop keeps the ids on the host and searches them there (no host sync per n-gram size and match on an
    # accelerator); grown token by token, it must propose transformers' continuation at every length
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    from dflash_hf.generation.lookup import ContextLookup

    reference = PromptLookupCandidateGenerator(eos_token_id=None, num_output_tokens=6, max_matching_ngram_size=2,
                                               max_length=max_length)
    found = 0
    for seed in range(4):
        ids = torch.randint(0, 5, (1, 29), generator=torch.Generator().manual_seed(seed))
        lookup = ContextLookup(6)
        lookup.extend(ids[0, :1].tolist())
        for end in range(2, ids.shape[1] + 1):
            lookup.extend([int(ids[0, end - 1])])
            start, copy = lookup.find(max_length)
            expected = reference.get_candidates(ids[:, :end])[0][0, end:].tolist()
            assert copy == expected, (seed, end)
            assert copy == ids[0, start : start + len(copy)].tolist()  # where the generator slices it on the device
            found += bool(copy)
    assert found > 40
