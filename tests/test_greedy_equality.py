"""Greedy DFlash output equals the target's own greedy output, token for token."""

import pytest
import torch

import dflash_hf
from tiny import MASK_ID, TARGETS, ForwardCounter, OracleDrafter, drafter

SEEDS = (0, 1, 2)
BLOCK_SIZES = (2, 4, 8, 16)
PROMPT_LENGTHS = (1, 5, 13)
MAX_NEW_TOKENS = (3, 17)


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request):
    return dflash_hf.enable(TARGETS[request.param](seed=0), verify_length=None)  # every draft: exact tau


def _prompt(seed, length):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, MASK_ID, (1, length), generator=generator)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_random_drafter_matches_plain_greedy(target, seed, block_size):
    model = drafter(seed, block_size=block_size)
    for length in PROMPT_LENGTHS:
        for max_new_tokens in MAX_NEW_TOKENS:
            prompt = _prompt(seed * 100 + length, length)
            expected = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
            actual = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=model)
            assert torch.equal(actual, expected), (length, max_new_tokens)
            stats = model.last_stats
            assert stats.committed_tokens == max_new_tokens - 1  # the prefill commits the first token


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("wrong_every", (0, 2))
def test_oracle_drafter_long_and_partial_acceptances(target, block_size, wrong_every):
    prompt = _prompt(7, 6)
    max_new_tokens = 40
    expected = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
    oracle = drafter(0, cls=OracleDrafter, block_size=block_size, target_layer_ids=(0, 3))
    oracle.arm(expected, target.get_output_embeddings(), wrong_every=wrong_every, wrong_slot=2)
    with ForwardCounter(target) as forwards:
        actual = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=oracle)
    assert torch.equal(actual, expected)

    stats = oracle.last_stats
    assert stats.committed_tokens == max_new_tokens - 1
    assert stats.num_target_forwards == forwards.count
    if wrong_every == 0:
        # every draft right: all but the budget-limited last block are fully accepted
        assert stats.acceptance_lengths[:-1] == [block_size] * (len(stats.acceptance_lengths) - 1)
    elif block_size > 2:
        assert 2 in stats.acceptance_lengths  # slot 2 wrong: the first draft is accepted, then the target corrects
    assert stats.mean_acceptance_length > 1
    # O(block) per step: after the prompt, each step feeds only the newly committed tokens
    assert oracle.context_lengths[0] == prompt.shape[1]
    assert max(oracle.context_lengths[1:]) <= block_size


def test_a_draft_vocabulary_drafts_only_its_tokens(target):
    """With every id as its draft vocabulary the oracle drafts exactly as with the full lm_head; without the
    ids of two tokens its script uses, the blocks stop at them, and the output is still the target's."""
    prompt = _prompt(7, 6)
    expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
    oracle = drafter(0, cls=OracleDrafter, block_size=8, target_layer_ids=(0, 3))
    oracle.arm(expected, target.get_output_embeddings())
    vocab_size = target.get_output_embeddings().out_features
    runs = {}
    for name, vocab in {"full": None, "every id": list(range(vocab_size)), "without two": "drop"}.items():
        if vocab == "drop":
            dropped = set(expected[0, prompt.shape[1] + 1 :].tolist()[:2])
            vocab = [i for i in range(vocab_size) if i not in dropped]
        oracle.config.dflash_config["draft_vocab"] = vocab
        oracle.arm(expected, target.get_output_embeddings())
        actual = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=oracle)
        assert torch.equal(actual, expected), name
        runs[name] = oracle.last_stats.acceptance_lengths
    assert runs["every id"] == runs["full"]
    assert sum(runs["without two"]) == sum(runs["full"]) and len(runs["without two"]) > len(runs["full"])


def test_a_draft_vocabulary_beyond_the_target_vocabulary_is_refused(target):
    model = drafter(0, block_size=4)
    model.config.dflash_config["draft_vocab"] = [1, target.get_output_embeddings().out_features]
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        target.generate(_prompt(0, 4), max_new_tokens=3, do_sample=False, assistant_model=model)


@pytest.mark.parametrize("block_size", (4, 16))
def test_eos_inside_a_drafted_block(target, block_size):
    prompt = _prompt(11, 5)
    reference = target.generate(prompt, max_new_tokens=30, do_sample=False)
    eos = int(reference[0, prompt.shape[1] + 9])  # the 10th new token becomes EOS
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert expected.shape[1] <= prompt.shape[1] + 10
    oracle = drafter(0, cls=OracleDrafter, block_size=block_size, target_layer_ids=(1, 2))
    oracle.arm(reference, target.get_output_embeddings())
    actual = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos, assistant_model=oracle)
    assert torch.equal(actual, expected)
    random_drafter = drafter(3, block_size=block_size)
    actual = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                             assistant_model=random_drafter)
    assert torch.equal(actual, expected)


def test_last_target_layer_is_a_valid_id(target):
    last = target.config.get_text_config().num_hidden_layers - 1
    model = drafter(0, block_size=4, target_layer_ids=(0, last))
    prompt = _prompt(3, 4)
    expected = target.generate(prompt, max_new_tokens=9, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=9, do_sample=False, assistant_model=model), expected)


def test_sliding_window_drafter_layers(target):
    model = drafter(0, block_size=8, num_layers=2, layer_types=["sliding_attention", "full_attention"],
                    sliding_window=4)
    prompt = _prompt(5, 9)
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=model), expected)


def test_max_length_instead_of_max_new_tokens(target):
    prompt = _prompt(2, 6)
    expected = target.generate(prompt, max_length=15, do_sample=False)
    actual = target.generate(prompt, max_length=15, do_sample=False, assistant_model=drafter(0, block_size=8))
    assert torch.equal(actual, expected) and actual.shape[1] == 15
