"""Greedy DFlash at the default settings (adaptive verify length with its cut, copies from the context, the
agreeing copy) equals plain greedy `generate` on every supported family, fp32, on prompts that repeat so that
copies are found and verified: a random drafter (nearly every draft rejected), an oracle that errs every other
step (partial acceptances), and copies accepted whole, in part, or not at all."""

import pytest
import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration

import dflash_hf
from test_hybrid import hybrid_target
from test_more_targets import HYBRIDS, MORE_TARGETS
from tiny import MASK_ID, TARGET_LAYERS, TARGETS, VOCAB, OracleDrafter, _common, drafter


def gemma4_conditional(seed=0):
    text = {k: v for k, v in _common().items() if not k.endswith("_token_id")}
    text.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"] * (TARGET_LAYERS // 2),
                final_logit_softcapping=30.0, global_head_dim=16)
    torch.manual_seed(seed)
    return Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=None, audio_config=None)).eval()


FAMILIES = {**TARGETS, **MORE_TARGETS, **{name: lambda seed=0, f=f: f() for name, f in HYBRIDS.items()},
            "qwen3.5-hybrid": lambda seed=0: hybrid_target(seed), "gemma4-conditional": gemma4_conditional}


def repeating_prompt(seed, period=7, length=20):
    base = torch.randint(0, MASK_ID, (1, period), generator=torch.Generator().manual_seed(seed))
    return base.repeat(1, length // period + 1)[:, :length]


@pytest.mark.parametrize("block_size", (4, 8))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_defaults_match_plain_greedy(family, block_size):
    target = dflash_hf.enable(FAMILIES[family](seed=0))  # the defaults
    copied = 0
    for seed in range(2):
        prompt = repeating_prompt(seed)
        expected = target.generate(prompt, max_new_tokens=32, do_sample=False)
        oracle = drafter(0, cls=OracleDrafter, block_size=block_size).arm(
            expected, target.get_output_embeddings(), wrong_every=2)
        for model in (drafter(seed, block_size=block_size), oracle):
            actual = target.generate(prompt, max_new_tokens=32, do_sample=False, assistant_model=model)
            assert torch.equal(actual, expected), (seed, type(model).__name__)
            copied += model.last_stats.copied_steps
        assert max(oracle.last_stats.acceptance_lengths) > 2  # drafts were accepted, not only copies
    assert copied > 0
