"""The z-lab checkpoint format: load, save, reload, and trust_remote_code export."""

import ast
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

import dflash_hf
from dflash_hf import DFlashConfig, DFlashDraftModel, embedded, export
from tiny import HIDDEN, MASK_ID, VOCAB, drafter, qwen3_target

ZLAB_CONFIG = {  # the shape of z-lab/Qwen3-8B-DFlash-b16's config.json, scaled down
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "block_size": 16,
    "bos_token_id": None,
    "eos_token_id": None,
    "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3]},
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "max_position_embeddings": 40960,
    "max_window_layers": 2,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_target_layers": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": VOCAB,
}


def zlab_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    h, d = config["hidden_size"], config["head_dim"]
    q, kv, ff = config["num_attention_heads"] * d, config["num_key_value_heads"] * d, config["intermediate_size"]
    shapes = {"fc.weight": (h, len(config["dflash_config"]["target_layer_ids"]) * h), "hidden_norm.weight": (h,),
              "norm.weight": (h,)}
    for n in range(config["num_hidden_layers"]):
        p = f"layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                   p + "mlp.down_proj.weight": (h, ff), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    return {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in shapes.items()}


def write_zlab_folder(path: Path, config: dict = ZLAB_CONFIG, weights: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(weights if weights is not None else zlab_weights(config), str(path / "model.safetensors"))
    (path / "dflash.py").write_text("raise ImportError('z-lab remote code is not what we run')\n")
    return path


def test_zlab_folder_loads_saves_and_reloads_identically(tmp_path):
    source = write_zlab_folder(tmp_path / "zlab")
    model = DFlashDraftModel.from_pretrained(source, dtype=torch.bfloat16)
    assert model.block_size == 16 and model.mask_token_id == MASK_ID and model.target_layer_ids == [1, 3]
    original = load_file(str(source / "model.safetensors"))
    assert set(model.state_dict()) == set(original)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in original.items())

    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(saved) == set(original)  # no embeddings, no lm_head, no extra buffers
    assert all(torch.equal(saved[k], v) for k, v in original.items())
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 16 and config["num_target_layers"] == 4
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3]}
    assert config["rope_parameters"]["rope_theta"] == 1000000

    reloaded = DFlashDraftModel.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in original.items())


def test_draft_vocab_is_kept_in_the_config_and_checked(tmp_path):
    model = DFlashDraftModel.from_pretrained(write_zlab_folder(tmp_path / "zlab"))
    model.config.dflash_config["draft_vocab"] = [0, 5, 9]
    model.save_pretrained(tmp_path / "saved")
    assert set(load_file(str(tmp_path / "saved" / "model.safetensors"))) == set(model.state_dict())  # weights unchanged
    assert DFlashDraftModel.from_pretrained(tmp_path / "saved").config.draft_vocab == [0, 5, 9]
    for bad in ([5, 0], [0, 0], [-1, 3], [True], "0,5"):
        with pytest.raises(ValueError, match="draft_vocab must be ascending"):
            DFlashConfig(dflash_config={"mask_token_id": 0, "target_layer_ids": [1], "draft_vocab": bad})


def test_trust_remote_code_export_is_self_contained(tmp_path):
    model = DFlashDraftModel.from_pretrained(write_zlab_folder(tmp_path / "zlab"))
    model.save_pretrained(tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "modeling_dflash.DFlashConfig",
                                  "AutoModel": "modeling_dflash.DFlashDraftModel"}
    source = (tmp_path / "export" / "modeling_dflash.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative imports break trust_remote_code loading"
            imported.add(node.module.split(".")[0])
    assert imported <= {"torch", "transformers", "huggingface_hub", "collections"}

    remote = AutoModel.from_pretrained(tmp_path / "export", trust_remote_code=True)
    assert type(remote).__module__.startswith("transformers_modules")
    assert type(remote).__name__ == "DFlashDraftModel"
    assert all(torch.equal(remote.state_dict()[k], v) for k, v in model.state_dict().items())


def test_remote_code_drafter_drafts_like_ours(tmp_path):
    # the full block every step: the adaptive default chooses from measured step times, which differ between calls
    target = dflash_hf.enable(qwen3_target(), verify_length=None)
    model = DFlashDraftModel.from_pretrained(write_zlab_folder(tmp_path / "zlab"))
    model.save_pretrained(tmp_path / "export")
    remote = AutoModel.from_pretrained(tmp_path / "export", trust_remote_code=True)
    hidden = torch.randn(1, 5, 2 * HIDDEN)
    block = torch.randn(1, 16, HIDDEN)
    positions = torch.arange(21)[None]
    ours = model(noise_embeds=block, context_hidden_states=hidden, position_ids=positions).last_hidden_state
    theirs = remote(noise_embeds=block, context_hidden_states=hidden, position_ids=positions).last_hidden_state
    assert torch.equal(ours, theirs)
    # the remote-code class is not ours, and dflash_hf decodes with it all the same
    prompt = torch.tensor([[1, 2, 3]])
    expected = target.generate(prompt, max_new_tokens=12, assistant_model=model, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=12, assistant_model=remote, do_sample=False), expected)
    assert remote.last_stats.acceptance_lengths == model.last_stats.acceptance_lengths


def test_missing_target_layer_ids_are_derived_the_reference_way(tmp_path):
    config = dict(ZLAB_CONFIG, num_target_layers=36, num_hidden_layers=5, dflash_config={"mask_token_id": 3})
    loaded = DFlashConfig.from_dict(config)
    assert loaded.target_layer_ids == [1, 9, 17, 25, 33]  # z-lab/Qwen3-8B-DFlash-b16's ids
    assert DFlashConfig.from_dict(dict(config, num_hidden_layers=1)).target_layer_ids == [18]


def test_sliding_window_layers_are_kept_without_use_sliding_window():
    config = DFlashConfig.from_dict(dict(ZLAB_CONFIG, layer_types=["sliding_attention", "full_attention"],
                                         sliding_window=2048))
    assert config.sliding_window == 2048
    model = DFlashDraftModel(config)
    assert [layer.self_attn.sliding_window for layer in model.layers] == [2048, None]


def test_autoconfig_knows_dflash():
    config = AutoConfig.for_model("dflash", **{k: v for k, v in ZLAB_CONFIG.items() if k != "model_type"})
    assert isinstance(config, DFlashConfig)
    assert isinstance(AutoModel.from_config(config), DFlashDraftModel)


def rope_as_transformers_4_reads_it(folder: Path) -> dict:
    """What a transformers-4.x Qwen3Config (z-lab's reference code pins 4.57.1; vLLM and SGLang on 4.x) takes
    from config.json for RoPE: the top-level fields with 4.57's defaults. It knows no `rope_parameters`."""
    config = json.loads((folder / "config.json").read_text())
    return {"rope_theta": config.get("rope_theta", 10000.0), "rope_scaling": config.get("rope_scaling")}


def test_transformers_4_readers_get_the_drafters_rope(tmp_path):
    assert rope_as_transformers_4_reads_it(embedded.DRAFTER_DIR) == {"rope_theta": 100000.0, "rope_scaling": None}

    drafter(0, rope_parameters={"rope_type": "default", "rope_theta": 123456.0}).save_pretrained(tmp_path / "saved")
    assert rope_as_transformers_4_reads_it(tmp_path / "saved") == {"rope_theta": 123456.0, "rope_scaling": None}

    # a scaled RoPE reaches 4.x as `rope_scaling`: the same parameters, the theta beside them
    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 64}
    model = drafter(1, block_size=4, rope_parameters=dict(yarn))
    export.export(model, tmp_path / "export")
    assert rope_as_transformers_4_reads_it(tmp_path / "export") == {
        "rope_theta": 150000.0, "rope_scaling": {k: v for k, v in yarn.items() if k != "rope_theta"}}

    # transformers 5 reads `rope_parameters` alone: no warning about the legacy fields, nothing applied twice
    with CaptureLogger(hf_logging.get_logger("transformers")) as logs, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DFlashConfig.from_pretrained(tmp_path / "saved").rope_parameters == {"rope_type": "default",
                                                                                     "rope_theta": 123456.0}
        assert DFlashDraftModel.from_pretrained(tmp_path / "export").config.rope_parameters == yarn
    assert logs.out == ""
    stale = dict(json.loads((tmp_path / "saved" / "config.json").read_text()), rope_theta=1.0)
    assert DFlashConfig.from_dict(stale).rope_parameters == {"rope_type": "default", "rope_theta": 123456.0}
