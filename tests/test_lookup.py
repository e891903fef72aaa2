"""Copies from the context (prompt lookup) combined with DFlash drafts: lossless, and chosen by the policy."""

import pytest
import torch

import dflash_hf
import tiny
from dflash_hf.generation.policy import AdaptiveVerifyLength, StepCosts


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
        assert stats.copied_accepted_tokens <= stats.accepted_tokens
    # without lookup the same useless drafter commits (about) one token per forward
    dflash_hf.generate(target, prompt, max_new_tokens=40, do_sample=False, assistant_model=useless)
    assert useless.last_stats.copied_steps == 0


def test_copies_need_fewer_forwards_than_the_useless_drafter_alone(looping):
    target, prompt, script = looping
    useless = tiny.drafter(0, block_size=4)
    kwargs = dict(max_new_tokens=40, do_sample=False, assistant_model=useless, dflash_verify_length=None)
    dflash_hf.generate(target, prompt, **kwargs)
    alone = useless.last_stats.num_target_forwards
    dflash_hf.generate(target, prompt, prompt_lookup_num_tokens=6, **kwargs)
    assert useless.last_stats.num_target_forwards < alone - 8


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
    copies = AdaptiveVerifyLength(6, StepCosts(6, draft=0.0, fallback=drafts.costs))
    for _ in range(20):  # drafts always fully accepted, copies always rejected at once
        drafts.observe(3, 3, 1.3)
        copies.observe(6, 0, 1.6)
    assert drafts.rate(3) > copies.rate(copies.best(6, lowest=1))
    for _ in range(40):  # now the reverse
        drafts.observe(3, 0, 1.3)
        copies.observe(6, 6, 1.6)
    assert copies.rate(copies.best(6, lowest=1)) > drafts.rate(drafts.best(3))


def test_unobserved_copy_costs_are_priced_in_the_drafts_seconds():
    drafts = StepCosts(3)
    drafts.observe(0, 0.05)  # a plain step took 50 ms
    copies = StepCosts(6, draft=0.0, fallback=drafts)
    assert copies.seconds()[0] == pytest.approx(0.05)
    assert copies.seconds()[2] == pytest.approx(0.05 * (1 + 0.1 * 2))
