"""Hybrid linear-attention targets (Qwen3.5/3.6): lossless DFlash, the recurrent states rolled back
to the last accepted token after every rejection (transformers' cache crop over recorded states)."""

import pytest
import torch
from transformers import DynamicCache, Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

import dflash_hf
from dflash_hf import DFlashCandidateGenerator
from tiny import MASK_ID, TARGET_LAYERS, VOCAB, OracleDrafter, drafter


def hybrid_target(seed=0, vocab_size=VOCAB):
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None,
    )
    return dflash_hf.enable(Qwen3_5ForCausalLM(config).eval(), verify_length=None)


@pytest.fixture(scope="module")
def target():
    return hybrid_target()


def _prompt(seed, length=6):
    return torch.randint(0, MASK_ID, (1, length), generator=torch.Generator().manual_seed(seed))


def _is_linear(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


@pytest.fixture
def state_checks(monkeypatch, target):
    """Before each draft, compare the live cache with a fresh forward over the committed tokens."""
    checks = []
    original = DFlashCandidateGenerator.propose

    def checked(self, input_ids, model_kwargs, first=False, room=None):
        cache = model_kwargs["cache"]
        if not first:
            fresh = DynamicCache(config=target.config)
            with torch.no_grad():
                target(input_ids[:, :-1], cache=fresh, use_cache=True)
            for live_layer, fresh_layer in zip(cache.layers, fresh.layers):
                if _is_linear(live_layer):
                    torch.testing.assert_close(live_layer.recurrent_states[0], fresh_layer.recurrent_states[0],
                                               atol=1e-5, rtol=1e-4)
                    # a state of fewer than `kernel` tokens is stored unpadded: the missing columns are zeros
                    kernel = fresh_layer.conv_kernel_size[0]
                    live, fresh_conv = live_layer.conv_states[0][..., -kernel:], fresh_layer.conv_states[0][..., -kernel:]
                    live = torch.nn.functional.pad(live, (kernel - live.shape[-1], 0))
                    torch.testing.assert_close(live, fresh_conv, atol=1e-5, rtol=1e-4)
                else:
                    assert live_layer.keys.shape == fresh_layer.keys.shape
                    torch.testing.assert_close(live_layer.keys, fresh_layer.keys, atol=1e-5, rtol=1e-4)
            checks.append(input_ids.shape[1])
        return original(self, input_ids, model_kwargs, first, room)

    monkeypatch.setattr(DFlashCandidateGenerator, "propose", checked)
    return checks


def _rejected_drafts(stats) -> int:
    return stats.drafted_tokens - stats.accepted_tokens


@pytest.mark.parametrize("block_size", (4, 16))
@pytest.mark.parametrize("wrong_every", (0, 2, 3))
def test_oracle_drafter_greedy_equality_and_exact_state(target, state_checks, block_size, wrong_every):
    prompt = _prompt(block_size + wrong_every)
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False)
    oracle = drafter(0, cls=OracleDrafter, block_size=block_size).arm(
        expected, target.get_output_embeddings(), wrong_every=wrong_every)
    actual = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=oracle)
    assert torch.equal(actual, expected)
    stats = oracle.last_stats
    assert stats.mean_acceptance_length > 1 and len(state_checks) == len(stats.acceptance_lengths)  # every step
    assert _rejected_drafts(stats) > 0 or wrong_every == 0 or block_size == 16  # 30 tokens: 2 steps of 16


@pytest.mark.parametrize("seed", (0, 1, 2))
@pytest.mark.parametrize("block_size", (4, 16))
def test_random_drafter_greedy_equality(target, state_checks, seed, block_size):
    model = drafter(seed, block_size=block_size)
    for length, max_new_tokens in ((1, 5), (9, 20)):
        prompt = _prompt(seed * 10 + length, length)
        expected = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
        assert torch.equal(
            target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=model), expected)


def test_eos_inside_a_block(target):
    prompt = _prompt(5)
    reference = target.generate(prompt, max_new_tokens=30, do_sample=False)
    eos = int(reference[0, prompt.shape[1] + 9])
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    oracle = drafter(0, cls=OracleDrafter, block_size=16).arm(reference, target.get_output_embeddings(),
                                                              wrong_every=2)
    assert torch.equal(target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                                       assistant_model=oracle), expected)


def test_state_check_catches_a_missing_rollback(target, state_checks, monkeypatch):
    original = LinearAttentionLayer.crop

    def crop_keeping_the_drafts_state(self, tokens_to_remove):
        history = {i: states[:] for i, states in self.recurrent_states_history.items()}
        current = dict(self.recurrent_states)
        original(self, tokens_to_remove)
        if tokens_to_remove:  # undo the rollback of the recurrent state (the conv states stay rolled back)
            self.recurrent_states, self.recurrent_states_history = current, history

    monkeypatch.setattr(LinearAttentionLayer, "crop", crop_keeping_the_drafts_state)
    prompt = _prompt(4)
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    oracle = drafter(0, cls=OracleDrafter, block_size=4).arm(expected, target.get_output_embeddings(), wrong_every=2)
    with pytest.raises(AssertionError):
        target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=oracle)


def _repeating_prompt(seed, period=8, length=23):
    base = _prompt(seed, period)
    return base.repeat(1, length // period + 1)[:, :length]


@pytest.mark.parametrize("lookup", (10, 16))
@pytest.mark.parametrize("block_size", (4, 8, 16))
def test_copies_longer_than_the_block_roll_back_exactly(target, state_checks, monkeypatch, block_size, lookup):
    """The default settings on a prompt that repeats: copied runs of up to `lookup` tokens are verified, longer
    than the block, and rolling back their rejected tail restores the recurrent state of the last committed token
    (checked against a fresh forward before every step) however long that tail is."""
    rolled_back = []
    crop = LinearAttentionLayer.crop

    def recorded(self, tokens_to_remove):
        rolled_back.append(-tokens_to_remove)
        crop(self, tokens_to_remove)

    monkeypatch.setattr(LinearAttentionLayer, "crop", recorded)
    checked = 0
    for seed in range(3):
        prompt = _repeating_prompt(seed)
        expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
        model = drafter(seed, block_size=block_size)
        actual = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=model,
                                 dflash_verify_length="adaptive", dflash_lookup=lookup)
        assert torch.equal(actual, expected), seed
        assert model.last_stats.copied_steps > 0
        checked += len(model.last_stats.acceptance_lengths)
    assert len(state_checks) == checked  # the state was compared before every step
    # a rejected tail as long as the block or longer (as long as the copies allow) was rolled back
    assert max(rolled_back) >= min(block_size, lookup), max(rolled_back)


def test_user_cache_is_used_and_rolled_back(target):
    prompt = _prompt(1)
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    cache = DynamicCache(config=target.config)
    model = drafter(0)
    actual = target.generate(prompt, max_new_tokens=12, assistant_model=model, cache=cache, do_sample=False)
    assert torch.equal(actual, expected) and _rejected_drafts(model.last_stats) > 0
    assert cache.get_seq_length() == expected.shape[1] - 1


@pytest.mark.parametrize("proposal", ("sample", "argmax"))
def test_sampling_is_exactly_the_targets(monkeypatch, proposal):
    """The committed distribution, computed exactly (tests/test_exact_sampling.py) at the default settings: every
    rejection rolls the recurrent states back, and what follows is still sampled as the target samples."""
    from test_exact_sampling import (PROMPT, Clock, Enumerator, assert_same_distribution, dflash_distribution,
                                     oracle, plain_distribution)
    from dflash_hf.generation import decoding, verify

    torch.set_num_threads(1)
    enumerator = Enumerator()
    monkeypatch.setattr(torch, "multinomial", enumerator.multinomial)
    monkeypatch.setattr(verify, "rejection_verify", enumerator.rejection_verify(verify.rejection_verify))
    monkeypatch.setattr(decoding, "time", Clock())
    sampler = hybrid_target(seed=3, vocab_size=3)
    with torch.no_grad():
        sampler.lm_head.weight.mul_(4.0)
    dflash_hf.enable(sampler, proposal=proposal)
    assistant = oracle(sampler, block_size=3, second_slot="unsure")
    actual, stats = dflash_distribution(sampler, assistant, enumerator, num_tokens=3)
    assert_same_distribution(actual, plain_distribution(sampler, PROMPT, 3))
    assert any(s.accepted_tokens > 0 for s in stats) and any(s.drafted_tokens > s.accepted_tokens for s in stats)


@pytest.mark.parametrize("block_size", (4, 16))
def test_left_padded_prompt(target, block_size):
    # random drafters: nearly every step rejects, so every step replays through the padded mask
    prompt = torch.cat([torch.full((1, 4), 5), _prompt(8, 8)], dim=1)
    mask = torch.tensor([[0] * 4 + [1] * 8])
    expected = target.generate(prompt, attention_mask=mask, max_new_tokens=24, do_sample=False)
    for seed in range(4):
        random_drafter = drafter(seed, block_size=block_size)
        actual = target.generate(prompt, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                 assistant_model=random_drafter)
        assert torch.equal(actual, expected), seed
        assert _rejected_drafts(random_drafter.last_stats) > 0


def test_returned_cache_covers_the_committed_tokens(target):
    prompt = _prompt(3)
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    oracle = drafter(0, cls=OracleDrafter, block_size=4).arm(plain.sequences, target.get_output_embeddings(),
                                                             wrong_every=1)
    out = target.generate(prompt, max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                          assistant_model=oracle)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.cache.get_seq_length() == plain.cache.get_seq_length()
    for ours, theirs in zip(out.cache.layers, plain.cache.layers):
        if _is_linear(ours):
            torch.testing.assert_close(ours.recurrent_states[0], theirs.recurrent_states[0], atol=1e-5, rtol=1e-4)


def test_prompt_as_inputs_embeds(target):
    prompt = _prompt(2, 5)
    embeds = target.get_input_embeddings()(prompt).detach()
    expected = target.generate(inputs_embeds=embeds, max_new_tokens=16, do_sample=False)
    for seed in range(3):
        random_drafter = drafter(seed, block_size=4)
        actual = target.generate(inputs_embeds=embeds, max_new_tokens=16, do_sample=False,
                                 assistant_model=random_drafter)
        assert torch.equal(actual, expected), seed
        assert _rejected_drafts(random_drafter.last_stats) > 0
