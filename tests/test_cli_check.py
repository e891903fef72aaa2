"""`dflash-hf check`: compatibility from the two configs, without weights or generation."""

import json

from dflash_hf.cli import main
from test_checkpoint_format import ZLAB_CONFIG
from test_hybrid import hybrid_target
from tiny import gemma4_target, qwen3_target


def _folders(tmp_path, target, **drafter_overrides):
    target.config.save_pretrained(tmp_path / "target")
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({**ZLAB_CONFIG, **drafter_overrides}))
    return str(tmp_path / "target"), str(tmp_path / "drafter")


def test_compatible_pair(tmp_path, capsys):
    assert main(["check", *_folders(tmp_path, qwen3_target())]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("compatible") and "reads target layers [1, 3]" in out
    assert "attention only, cropped" in out


def test_incompatible_pair_lists_every_reason(tmp_path, capsys):
    folders = _folders(tmp_path, qwen3_target(), hidden_size=32, num_target_layers=36,
                       dflash_config={"mask_token_id": 999, "target_layer_ids": [1, 35]})
    assert main(["check", *folders]) == 1
    out = capsys.readouterr().out
    assert "NOT compatible" in out and "hidden size differs" in out and "target_layer_ids [35]" in out
    assert "36-layer target" in out and "mask_token_id 999" in out


def test_hybrid_and_gemma_targets_are_described(tmp_path, capsys):
    assert main(["check", *_folders(tmp_path / "h", hybrid_target())]) == 0
    assert "rolled back to the recorded state of the last accepted token" in capsys.readouterr().out
    assert main(["check", *_folders(tmp_path / "g", gemma4_target())]) == 0
    assert "soft-capped at 30.0" in capsys.readouterr().out


def test_not_a_drafter(tmp_path, capsys):
    target, _ = _folders(tmp_path, qwen3_target())
    assert main(["check", target, target]) == 2
    assert "not a DFlash drafter config" in capsys.readouterr().err
