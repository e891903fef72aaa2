"""DFlash on a static cache (`cache_implementation="static"`), eager and compiled the way transformers' `generate`
compiles decoding (`compile_config`; on a CPU only when the config allows every device): greedy output equals
plain greedy `generate`, also when a padded verify forward would not fit the cache at the end."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

import dflash_hf
from test_defaults_greedy import repeating_prompt
from test_hybrid import hybrid_target
from test_more_targets import gpt_oss_target
from tiny import OracleDrafter, drafter, llama_target, qwen3_target


def _compile_everywhere() -> CompileConfig:
    config = CompileConfig(fullgraph=False)
    config._compile_all_devices = True  # transformers' own switch for compiling on a CPU (its tests use it too)
    return config


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3.5-hybrid"])
def test_static_cache_greedy_equality(family):
    target = {"qwen3": qwen3_target, "llama": llama_target, "qwen3.5-hybrid": hybrid_target}[family](0)
    prompt = repeating_prompt(1)
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)
    for block_size in (4, 8):
        out = dflash_hf.generate(target, prompt, max_new_tokens=30, do_sample=False, cache_implementation="static",
                                 assistant_model=drafter(1, block_size=block_size), return_dict_in_generate=True)
        assert type(out.cache).__name__ == "StaticCache"
        assert torch.equal(out.sequences, plain), (family, block_size)


def test_static_cache_with_sliding_window_layers_says_what_to_do():
    with pytest.raises(ValueError, match="sliding-window.*default cache"):
        dflash_hf.generate(gpt_oss_target(0), repeating_prompt(1), max_new_tokens=8, do_sample=False,
                           cache_implementation="static", assistant_model=drafter(1, block_size=4))


def test_compiled_static_cache_greedy_equality_with_padded_widths():
    target = qwen3_target(0)
    prompt = repeating_prompt(2)
    plain = target.generate(prompt, max_new_tokens=36, do_sample=False)
    # an oracle wrong every third step: accepted runs of every length, copies from the repeating prompt
    oracle = drafter(0, cls=OracleDrafter, block_size=4).arm(plain, target.get_output_embeddings(), wrong_every=3)
    counters.clear()
    for new, model in ((36, oracle), (33, drafter(1, block_size=4)), (35, oracle)):
        out = dflash_hf.generate(target, prompt, max_new_tokens=new, do_sample=False, assistant_model=model,
                                 cache_implementation="static", compile_config=_compile_everywhere(),
                                 return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain[:, : prompt.shape[1] + new]), new
        # forwards padded to a wider graph ran: widths (1 + drafts or copied tokens) 1, 2, 4, 8 and 11 have graphs
        assert set(out.dflash_stats.verify_lengths) - {0, 1, 3, 7, 10}, out.dflash_stats.verify_lengths
    # compiled at all (graphs were captured), and not once per verify width or call
    assert 0 < counters["stats"]["unique_graphs"] <= 6
