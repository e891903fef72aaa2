"""Greedy DFlash output equals plain greedy `generate` on more target architectures.

- gpt-oss (`GptOssForCausalLM`): attention sinks, alternating sliding/full attention with a window
  (4) far shorter than prompt + generation, YaRN RoPE, a 4-expert top-2 MoE. transformers runs it
  with eager attention (no SDPA: the sinks), and its cache keeps sliding layers windowed.
- Qwen3-MoE (`Qwen3MoeForCausalLM`, also the class of Qwen3-Coder-30B-A3B): 4 experts, top-2,
  `norm_topk_prob`.
- Gemma-4 as `AutoModelForCausalLM` loads the published checkpoints: `Gemma4ForConditionalGeneration`
  (text-only prompts; tests/test_greedy_equality.py covers `Gemma4ForCausalLM`).
- Qwen3-Next (Qwen3-Coder-Next), Qwen3.5 and Qwen3.5-MoE (Qwen3.5/3.6, dense and MoE) are hybrid linear-attention
  models (`_is_stateful`): greedy equality through the state rollback (dflash_hf/generation/rollback.py).
"""


import pytest
import torch
from transformers import (
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    GptOssConfig,
    GptOssForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

import dflash_hf
from tiny import MASK_ID, TARGET_LAYERS, VOCAB, ForwardCounter, OracleDrafter, _common, drafter

WINDOW = 4  # the target's sliding window: every prompt + generation below is longer


def gpt_oss_target(seed=0, sliding_window=WINDOW, **overrides):
    torch.manual_seed(seed)
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 64, "truncate": False}
    extra = dict(
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"] * (TARGET_LAYERS // 2),
        rope_parameters=rope,
        # With the default 0.02 the tiny model soon repeats one token; 0.2 keeps its greedy output varied.
        initializer_range=0.2,
    )
    extra.update(overrides)
    return GptOssForCausalLM(GptOssConfig(**_common(**extra))).eval()


def qwen3_moe_target(seed=0, **overrides):
    torch.manual_seed(seed)
    extra = dict(moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                 initializer_range=0.3)  # varied greedy output, as for gpt-oss
    extra.update(overrides)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**_common(**extra))).eval()


MORE_TARGETS = {
    "gpt-oss": gpt_oss_target,
    # a window that no block size divides: verify forwards straddle window edges at every offset
    "gpt-oss-window7": lambda seed=0: gpt_oss_target(seed, sliding_window=7),
    "qwen3-moe": qwen3_moe_target,
    # dense and sparse layers mixed (`decoder_sparse_step`, `mlp_only_layers`), as Qwen3-MoE configs allow
    "qwen3-moe-mixed": lambda seed=0: qwen3_moe_target(seed, decoder_sparse_step=2, mlp_only_layers=[0]),
}
SEEDS = (0, 1)
BLOCK_SIZES = (4, 16)
PROMPT_LENGTHS = (1, 6, 11)


@pytest.fixture(scope="module", params=sorted(MORE_TARGETS))
def target(request):
    return dflash_hf.enable(MORE_TARGETS[request.param](seed=0), verify_length=None)


def _prompt(seed, length):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, MASK_ID, (1, length), generator=generator)


def test_gpt_oss_config_exercises_window_and_sinks():
    """Guards the test config itself: the window and the sinks change the greedy output."""
    prompt = _prompt(7, 6)
    windowed = gpt_oss_target(seed=0).generate(prompt, max_new_tokens=20, do_sample=False)
    unwindowed = gpt_oss_target(seed=0, sliding_window=512).generate(prompt, max_new_tokens=20, do_sample=False)
    assert not torch.equal(windowed, unwindowed)
    assert len(set(windowed[0, prompt.shape[1]:].tolist())) > 5  # not a degenerate repetition
    model = gpt_oss_target(seed=0)
    assert model.config._attn_implementation == "eager"
    assert all(bool(layer.self_attn.sinks.abs().sum() > 0) for layer in model.model.layers)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()
    without_sinks = model.generate(prompt, max_new_tokens=20, do_sample=False)
    assert not torch.equal(windowed, without_sinks)
    # DFlash decoding keeps transformers' windowed cache on the sliding layers (cropped after rejections).
    target = dflash_hf.enable(gpt_oss_target(seed=0))
    out = target.generate(
        prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter(0, block_size=8),
        return_dict_in_generate=True)
    assert torch.equal(out.sequences, windowed)
    assert [type(layer).__name__ for layer in out.cache.layers[:2]] == [
        "DynamicSlidingWindowLayer", "DynamicLayer"]


def test_tiny_target_output_is_varied(target):
    """Guards the configs: a target that repeats one token would make every drafter look right."""
    prompt = _prompt(7, 6)
    new_tokens = target.generate(prompt, max_new_tokens=40, do_sample=False)[0, prompt.shape[1]:]
    assert len(set(new_tokens.tolist())) >= 10


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_random_drafter_matches_plain_greedy(target, seed, block_size):
    model = drafter(seed, block_size=block_size)
    for length in PROMPT_LENGTHS:
        for max_new_tokens in (3, 20) if length == 6 else (20,):
            prompt = _prompt(seed * 100 + length, length)
            expected = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
            actual = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=model)
            assert torch.equal(actual, expected), (length, max_new_tokens)
            assert model.last_stats.committed_tokens == max_new_tokens - 1


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
        # Every draft right: whole blocks, each verify forward spanning several target windows.
        assert stats.acceptance_lengths[:-1] == [block_size] * (len(stats.acceptance_lengths) - 1)
    else:
        assert 2 in stats.acceptance_lengths  # slot 2 wrong: one draft accepted, then the target's token
        assert block_size in stats.acceptance_lengths  # the steps in between accept whole blocks
    assert oracle.context_lengths[0] == prompt.shape[1]
    assert max(oracle.context_lengths[1:]) <= block_size


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_eos_inside_a_drafted_block(target, block_size):
    prompt = _prompt(11, 5)
    reference = target.generate(prompt, max_new_tokens=30, do_sample=False)
    new_tokens = reference[0, prompt.shape[1]:].tolist()
    # The first new token at or after the 10th that did not occur before it becomes EOS.
    index = next(i for i in range(9, len(new_tokens)) if new_tokens[i] not in new_tokens[:i])
    eos = new_tokens[index]
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert expected.shape[1] == prompt.shape[1] + index + 1
    oracle = drafter(0, cls=OracleDrafter, block_size=block_size, target_layer_ids=(1, 2))
    oracle.arm(reference, target.get_output_embeddings())
    actual = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos, assistant_model=oracle)
    assert torch.equal(actual, expected)
    random_drafter = drafter(3, block_size=block_size)
    actual = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                             assistant_model=random_drafter)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_sliding_window_drafter_layers(target, block_size):
    sliding = dict(block_size=block_size, num_layers=2, layer_types=["sliding_attention", "full_attention"],
                   sliding_window=4)
    prompt = _prompt(5, 9)
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False)
    actual = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter(1, **sliding))
    assert torch.equal(actual, expected)
    oracle = drafter(0, cls=OracleDrafter, **sliding).arm(expected, target.get_output_embeddings(), wrong_every=3)
    assert torch.equal(target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=oracle), expected)
    assert max(oracle.last_stats.acceptance_lengths) == block_size


def test_last_target_layer_is_a_valid_id(target):
    model = drafter(0, block_size=4, target_layer_ids=(0, TARGET_LAYERS - 1))
    prompt = _prompt(3, 4)
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=model), expected)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_gemma4_conditional_generation_text_only(block_size):
    """`AutoModelForCausalLM` loads the published Gemma-4 checkpoints (`model_type: gemma4`) as
    `Gemma4ForConditionalGeneration`; text-only prompts decode through it (no vision tower here)."""
    text = {k: v for k, v in _common().items() if not k.endswith("_token_id")}
    text.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"] * (TARGET_LAYERS // 2),
                final_logit_softcapping=30.0, global_head_dim=16)
    torch.manual_seed(0)
    model = dflash_hf.enable(verify_length=None, target=Gemma4ForConditionalGeneration(
        Gemma4Config(text_config=text, vision_config=None, audio_config=None)).eval())
    prompt = _prompt(4, 7)
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
    actual = model.generate(prompt, max_new_tokens=24, do_sample=False,
                            assistant_model=drafter(0, block_size=block_size))
    assert torch.equal(actual, expected)
    oracle = drafter(0, cls=OracleDrafter, block_size=block_size).arm(expected, model.get_output_embeddings(),
                                                                       wrong_every=2)
    assert torch.equal(model.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=oracle), expected)
    assert max(oracle.last_stats.acceptance_lengths) == block_size


def _qwen3_next_target():
    torch.manual_seed(0)
    config = Qwen3NextConfig(**_common(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"], moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    ))
    return Qwen3NextForCausalLM(config).eval()


def _qwen3_5_target():
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**_common(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    ))
    return Qwen3_5ForCausalLM(config).eval()


def _qwen3_5_moe_target():
    torch.manual_seed(0)
    config = Qwen3_5MoeTextConfig(**_common(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"], moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    ))
    return Qwen3_5MoeForCausalLM(config).eval()


HYBRIDS = {"qwen3-next": _qwen3_next_target, "qwen3.5": _qwen3_5_target, "qwen3.5-moe": _qwen3_5_moe_target}
# Hybrid targets roll their linear-attention states back to the last accepted token (transformers' cache crop).


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request):
    model = HYBRIDS[request.param]()
    assert "linear_attention" in model.config.layer_types and model.config.vocab_size == VOCAB
    return dflash_hf.enable(model, verify_length=None)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_hybrid_targets_match_plain_greedy(hybrid, block_size):
    for length in (1, 9):
        prompt = _prompt(length, length)
        expected = hybrid.generate(prompt, max_new_tokens=30, do_sample=False)
        actual = hybrid.generate(prompt, max_new_tokens=30, do_sample=False,
                                 assistant_model=drafter(length, block_size=block_size))
        assert torch.equal(actual, expected), length
        # Partial acceptances: the recurrent state must come back to the committed tokens exactly.
        oracle = drafter(0, cls=OracleDrafter, block_size=block_size).arm(
            expected, hybrid.get_output_embeddings(), wrong_every=2)
        assert torch.equal(hybrid.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=oracle),
                           expected), length
        assert 2 in oracle.last_stats.acceptance_lengths and block_size in oracle.last_stats.acceptance_lengths


def test_hybrid_eos_inside_a_drafted_block(hybrid):
    prompt = _prompt(11, 5)
    reference = hybrid.generate(prompt, max_new_tokens=30, do_sample=False)
    new_tokens = reference[0, prompt.shape[1]:].tolist()
    index = next(i for i in range(9, len(new_tokens)) if new_tokens[i] not in new_tokens[:i])
    expected = hybrid.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=new_tokens[index])
    assert expected.shape[1] == prompt.shape[1] + index + 1
    oracle = drafter(0, cls=OracleDrafter, block_size=16).arm(reference, hybrid.get_output_embeddings())
    actual = hybrid.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=new_tokens[index],
                             assistant_model=oracle)
    assert torch.equal(actual, expected)
