"""enable() changes one target instance and nothing else."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import GenerationMixin, Qwen3ForCausalLM

import dflash_hf
from tiny import ForwardCounter, drafter, qwen3_target


def test_import_alone_patches_nothing():
    code = (
        "import transformers, transformers.generation.utils as u\n"
        "from transformers import GenerationMixin, Qwen3ForCausalLM\n"
        "before = (GenerationMixin.generate, GenerationMixin._get_candidate_generator, u._speculative_sampling,"
        " Qwen3ForCausalLM.__dict__.copy())\n"
        "import dflash_hf\n"
        "after = (GenerationMixin.generate, GenerationMixin._get_candidate_generator, u._speculative_sampling,"
        " Qwen3ForCausalLM.__dict__.copy())\n"
        "assert before == after\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_enable_is_per_instance_and_idempotent():
    enabled, other = qwen3_target(), qwen3_target()
    assert dflash_hf.enable(enabled) is enabled and dflash_hf.enable(enabled) is enabled
    assert dflash_hf.is_enabled(enabled) and not dflash_hf.is_enabled(other)
    assert type(enabled) is Qwen3ForCausalLM
    assert "generate" not in other.__dict__ and Qwen3ForCausalLM.generate is GenerationMixin.generate
    prompt = torch.tensor([[5, 6, 7]])
    assert torch.equal(enabled.generate(prompt, max_new_tokens=6, do_sample=False),
                       other.generate(prompt, max_new_tokens=6, do_sample=False))


def test_other_assistants_still_use_transformers_generators():
    target = dflash_hf.enable(qwen3_target())
    prompt = torch.tensor([[5, 6, 7, 5, 6]])
    expected = target.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3),
                       expected)
    assistant = qwen3_target(seed=1)
    assert torch.equal(target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=assistant),
                       expected)


def test_enabled_target_saves_its_own_architecture(tmp_path):
    target = dflash_hf.enable(qwen3_target())
    target.generate(torch.tensor([[1, 2]]), max_new_tokens=3, assistant_model=drafter(0))
    target.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and "auto_map" not in config
    assert not (tmp_path / "modeling_dflash.py").exists()
    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path)
    assert not dflash_hf.is_enabled(reloaded)


def test_each_call_has_its_own_stats():
    target = dflash_hf.enable(qwen3_target(), verify_length=None)
    model = drafter(0)
    target.generate(torch.tensor([[1, 2]]), max_new_tokens=9, assistant_model=model, do_sample=False)
    first = model.last_stats
    with ForwardCounter(target) as forwards:
        target.generate(torch.tensor([[1, 2]]), max_new_tokens=3, assistant_model=model, do_sample=False)
    assert model.last_stats is not first and model.last_stats.committed_tokens == 2
    stats = model.last_stats.as_dict()
    assert stats["num_target_forwards"] == forwards.count
    assert stats["draft_seconds"] > 0 and stats["verify_seconds"] > 0


def test_deepcopy_of_an_enabled_target_decodes_with_the_copy():
    import copy

    target = dflash_hf.enable(qwen3_target())
    clone = copy.deepcopy(target)
    with torch.no_grad():
        for parameter in clone.parameters():
            parameter.add_(torch.randn_like(parameter))
    prompt = torch.tensor([[5, 6, 7]])
    model = drafter(0)
    expected = Qwen3ForCausalLM.generate(clone, prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(clone.generate(prompt, max_new_tokens=6, do_sample=False, assistant_model=model), expected)
    assert not torch.equal(target.generate(prompt, max_new_tokens=6, do_sample=False), expected)


def test_dropping_an_enabled_target_frees_it_without_the_cycle_collector():
    import gc
    import weakref

    target = dflash_hf.enable(qwen3_target())
    target.generate(torch.tensor([[1, 2]]), max_new_tokens=4, assistant_model=drafter(0))
    freed = weakref.ref(target)
    gc.disable()  # reference counting alone must free it: no cycle through the bound generate
    try:
        del target
        assert freed() is None
    finally:
        gc.enable()


def test_generate_of_a_freed_target_says_what_to_do():
    bound = dflash_hf.enable(qwen3_target()).generate  # the model itself is not kept
    with pytest.raises(ReferenceError, match="keep a reference"):
        bound(torch.tensor([[1, 2]]), max_new_tokens=2)


def test_stats_come_back_with_the_output_and_concurrent_calls_keep_their_own():
    from concurrent.futures import ThreadPoolExecutor

    target = dflash_hf.enable(qwen3_target(), verify_length=None)
    model = drafter(0, block_size=4)

    def run(new_tokens):
        out = target.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=new_tokens, do_sample=False,
                              assistant_model=model, return_dict_in_generate=True)
        return new_tokens, out

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, [5, 17, 9, 13]))
    for new_tokens, out in results:
        assert out.dflash_stats.committed_tokens == new_tokens - 1 == out.sequences.shape[1] - 3 - 1
    assert model.last_stats in [out.dflash_stats for _, out in results]


def test_without_enable_through_the_function_and_custom_generate():
    target, model = qwen3_target(), drafter(0, block_size=4)
    prompt = torch.tensor([[5, 6, 7]])
    expected = target.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(dflash_hf.generate(target, prompt, assistant_model=model, max_new_tokens=10, do_sample=False),
                       expected)
    out = target.generate(prompt, custom_generate=dflash_hf.dflash_decode, drafter=model, max_new_tokens=10,
                          do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected) and out.dflash_stats is model.last_stats
    assert "generate" not in target.__dict__
