"""scripts/smollm2_data_curve.py: nested arms from the committed answers, a source stage, one line per arm."""

import gzip
import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))  # the curve script imports the training script beside it
spec = importlib.util.spec_from_file_location("smollm2_data_curve", SCRIPTS / "smollm2_data_curve.py")
curve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(curve)


def write_answers(path: Path, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        prompt = [rng.randrange(10, 20) for _ in range(rng.randrange(3, 6))]
        answer = [rng.randrange(0, 8) for _ in range(rng.randrange(6, 12))]
        examples.append({"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)})
    path.write_bytes(gzip.compress("".join(json.dumps(e) + "\n" for e in examples).encode()))
    return examples


def test_arm_names():
    assert curve.parse_arm("4k") == (0, 4000, 1.0)
    assert curve.parse_arm("1k-x4") == (0, 1000, 4.0)
    assert curve.parse_arm("500-x2") == (0, 500, 2.0)
    assert curve.parse_arm("src2k+1k") == (2000, 1000, 1.0)
    with pytest.raises(ValueError):
        curve.parse_arm("many")


def test_arms_train_nested_parts_of_both_answer_files_and_are_recorded_once(tmp_path, monkeypatch):
    import tiny
    from dflash_hf import embedded

    first = write_answers(tmp_path / "first.jsonl.gz", 10, seed=1)
    second = write_answers(tmp_path / "second.jsonl.gz", 6, seed=2)
    monkeypatch.setattr(curve, "RESPONSES", tmp_path / "first.jsonl.gz")
    monkeypatch.setattr(curve, "MORE_RESPONSES", tmp_path / "second.jsonl.gz")
    monkeypatch.setattr(curve, "RESULTS", tmp_path / "curve.jsonl")
    monkeypatch.setattr(curve, "EVAL_SETS", {"humaneval": "humaneval:1", "prose": "prose:1"})
    monkeypatch.setattr(curve, "CURVE_SETTINGS", dict(
        curve.CURVE_SETTINGS, block_size=4, target_layer_ids=[0, 2], max_anchors=8, mixed_precision="no",
        checkpoint_every=0))
    target, tokenizer = tiny.qwen3_target(), tiny.tokenizer()
    loads = []
    monkeypatch.setattr(embedded, "load_target", lambda name, **kwargs: loads.append(name) or (target, tokenizer))

    pool = curve.pool()
    assert sorted(map(json.dumps, pool)) == sorted(map(json.dumps, first + second))  # every answer, once
    assert pool != first + second  # shuffled: a part of it mixes both files

    with pytest.raises(ValueError):  # a malformed name fails before anything trains
        curve.main(["8", "eight", "--output-dir", str(tmp_path / "runs")])
    assert loads == []
    curve.main(["8", "src4+8-x2", "--output-dir", str(tmp_path / "runs")])
    plain, staged = [json.loads(line) for line in (tmp_path / "curve.jsonl").read_text().splitlines()]
    assert (plain["arm"], plain["examples"], plain["steps"]) == ("8", 8, 2)
    # 4 source pieces (1 step), then 2 passes over the same 8 answers (4 steps)
    assert (staged["source_pieces"], staged["examples"], staged["passes"], staged["steps"]) == (4, 8, 2.0, 5)
    # the answers use token ids 0-19; the source pieces' characters join what the staged drafter drafts from
    assert plain["draft_vocab"] <= 8 < staged["draft_vocab"]
    for record in (plain, staged):
        assert record["humaneval"] >= 1.0 and record["prose"] >= 1.0
    assert len(loads) == 2

    curve.main(["8", "--output-dir", str(tmp_path / "runs")])  # recorded: not trained again
    assert len(loads) == 2 and len((tmp_path / "curve.jsonl").read_text().splitlines()) == 2
