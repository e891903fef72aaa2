"""Bad input fails at the boundary with an error that names the fix."""

import copy
import json
import re

import pytest
import torch

import dflash_hf
from dflash_hf import DFlashConfig, DFlashDraftModel
from test_checkpoint_format import ZLAB_CONFIG, write_zlab_folder, zlab_weights
from tiny import TARGET_LAYERS, VOCAB, drafter, qwen3_target

PROMPT = torch.tensor([[1, 2, 3]])


@pytest.fixture(scope="module")
def target():
    return dflash_hf.enable(qwen3_target())


def _generate(target, model, prompt=PROMPT):
    return target.generate(prompt, max_new_tokens=4, do_sample=False, assistant_model=model)


def test_target_not_enabled():
    plain = qwen3_target()
    with pytest.raises(ValueError, match=r"dflash_hf\.enable\(target\)"):
        _generate(plain, drafter(0))


def test_hidden_size_mismatch(target):
    with pytest.raises(ValueError, match="hidden size differs: target 64, drafter 32"):
        _generate(target, drafter(0, hidden_size=32))


def test_vocab_mismatch(target):
    with pytest.raises(ValueError, match="vocab size differs"):
        _generate(target, drafter(0, vocab_size=VOCAB * 2))


def test_target_layer_ids_out_of_range(target):
    with pytest.raises(ValueError, match=r"target_layer_ids \[4\] are out of range .* \(valid: 0\.\.3"):
        _generate(target, drafter(0, target_layer_ids=(1, TARGET_LAYERS)))


def test_drafter_for_another_target_depth(target):
    with pytest.raises(ValueError, match="trained for a 36-layer target"):
        _generate(target, drafter(0, num_target_layers=36))


def test_missing_mask_token(target):
    with pytest.raises(ValueError, match="no dflash_config.mask_token_id"):
        _generate(target, drafter(0, dflash_config={"target_layer_ids": [1, 2]}))


def test_mask_token_outside_vocab(target):
    with pytest.raises(ValueError, match="mask_token_id 64 is not in the target's vocabulary"):
        _generate(target, drafter(0, dflash_config={"mask_token_id": VOCAB, "target_layer_ids": [1, 2]}))




def test_target_whose_cache_cannot_roll_back(target):
    # a sliding-window static cache longer than its window cannot be cropped back after rejected drafts
    with pytest.raises(ValueError, match="cache that can be cropped"):
        target.generate(PROMPT, max_new_tokens=4, do_sample=False, assistant_model=drafter(0),
                        cache=_uncroppable_cache(target))


def _uncroppable_cache(target):
    from transformers import StaticCache

    config = copy.deepcopy(target.config)
    config.sliding_window, config.layer_types = 2, ["sliding_attention"] * config.num_hidden_layers
    return StaticCache(config=config, max_cache_len=16)


@pytest.mark.parametrize("block_size", (0, 1))
def test_block_size_below_two(block_size):
    with pytest.raises(ValueError, match="block_size` must be an int >= 2"):
        drafter(0, block_size=block_size)


def test_not_a_dflash_config(tmp_path):
    config = {k: v for k, v in ZLAB_CONFIG.items() if k not in ("dflash_config", "block_size", "auto_map")}
    config["architectures"] = ["Qwen3ForCausalLM"]
    write_zlab_folder(tmp_path, config=config, weights=zlab_weights(ZLAB_CONFIG))
    with pytest.raises(ValueError, match="not a DFlash drafter config"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_missing_weights_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ZLAB_CONFIG))
    with pytest.raises(ValueError, match="Could not load DFlash drafter weights"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_only_pickle_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ZLAB_CONFIG))
    torch.save(zlab_weights(ZLAB_CONFIG), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_corrupt_weights_file(tmp_path):
    write_zlab_folder(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="Could not load DFlash drafter weights"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_missing_and_misshapen_weights(tmp_path):
    weights = zlab_weights(ZLAB_CONFIG)
    del weights["layers.1.mlp.up_proj.weight"]
    weights["fc.weight"] = weights["fc.weight"][:, :64].contiguous()
    write_zlab_folder(tmp_path, weights=weights)
    with pytest.raises(ValueError, match=r"missing weights \['layers\.1\.mlp\.up_proj\.weight'\].*wrong shapes \['fc\.weight'\]"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_sliding_layers_without_window():
    with pytest.raises(ValueError, match="sliding_window"):
        DFlashConfig(layer_types=["sliding_attention"], num_hidden_layers=1, sliding_window=None,
                     dflash_config={"mask_token_id": 1, "target_layer_ids": [0]})


def test_enable_rejects_non_generative_models():
    with pytest.raises(TypeError, match="AutoModelForCausalLM"):
        dflash_hf.enable(qwen3_target().model)
    with pytest.raises(TypeError, match="not the drafter"):
        dflash_hf.enable(drafter(0))


def test_loading_errors_that_are_not_about_the_files_propagate_unchanged(tmp_path):
    write_zlab_folder(tmp_path)
    with pytest.raises(ImportError):  # not rephrased as "re-download the checkpoint"
        DFlashDraftModel.from_pretrained(tmp_path, attn_implementation="flash_attention_2")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_beams=2), r"beam search \(num_beams=2\); drop num_beams"),
        (dict(num_return_sequences=2, do_sample=True), r"several sequences per prompt"),
        (dict(dflash_lookup=0), r"lookup must be 'adaptive' .*, None \(off\) or the most tokens copied"),
        (dict(output_attentions=True, return_dict_in_generate=True), r"drop output_attentions"),
        (dict(use_cache=False), r"drop use_cache=False"),
        (dict(custom_generate=lambda *a, **k: None), r"brings its own decoding loop; drop custom_generate"),
        (dict(dflash_proposal="best"), r"proposal must be one of"),
        (dict(dflash_verify_length=-1), r"verify_length must be"),
    ],
    ids=["beam", "num_return_sequences", "lookup", "attentions", "no_cache", "custom_generate",
         "proposal", "verify_length"],
)
def test_options_dflash_cannot_honour(target, kwargs, message):
    kwargs = {"max_new_tokens": 4, "do_sample": False, **kwargs}
    with pytest.raises(ValueError, match=message):
        target.generate(PROMPT, assistant_model=drafter(0), **kwargs)


@pytest.mark.parametrize("batch", [1, 2])
def test_stateful_logits_processor_is_refused(target, batch):
    """Classifier-free guidance (`guidance_scale`) advances its own cache by one token per call: called on drafts that
    are then rejected it no longer gives plain generate's output (tiny Qwen3 and Llama, 16 greedy tokens, guidance
    1.5 and 3.0 differed), so DFlash refuses it."""
    with pytest.raises(ValueError, match=r"UnbatchedClassifierFreeGuidanceLogitsProcessor \(guidance_scale\).*Drop "
                                         r"guidance_scale"):
        target.generate(PROMPT.repeat(batch, 1), max_new_tokens=4, do_sample=False, guidance_scale=1.5,
                        assistant_model=drafter(0))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("shape", [(1, 2), (1, 4), (2, 3)])
def test_attention_mask_of_another_shape(target, shape, padded):
    """A mask of ones (which generate turns into positions, then drops) and a padded one (kept)."""
    mask = torch.ones(shape, dtype=torch.long)
    mask[:, 0] = 0 if padded else 1
    with pytest.raises(ValueError, match=re.escape(f"has shape {shape}, the prompt (1, 3) (batch, tokens)")):
        target.generate(PROMPT, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant_model=drafter(0))


def test_empty_prompt(target):
    with pytest.raises(ValueError, match="prompt of at least one token"):
        _generate(target, drafter(0), prompt=torch.zeros((1, 0), dtype=torch.long))


def test_dflash_options_without_a_drafter(target):
    with pytest.raises(ValueError, match="dflash_verify_length applies to DFlash calls only"):
        target.generate(PROMPT, max_new_tokens=4, dflash_verify_length=2)


@pytest.mark.parametrize("dflash_config", [[1, 2], {"mask_token_id": "x"}, {"mask_token_id": 1, "target_layer_ids": 3}])
def test_malformed_dflash_config(dflash_config):
    with pytest.raises(ValueError, match="dflash_config"):
        DFlashConfig.from_dict({**ZLAB_CONFIG, "dflash_config": dflash_config})
