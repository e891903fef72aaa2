"""scripts/train_smollm2_drafter.py: the committed response cache."""

import gzip
import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "train_smollm2_drafter", Path(__file__).parent.parent / "scripts" / "train_smollm2_drafter.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def test_saved_responses_round_trip_and_are_deterministic(tmp_path, monkeypatch):
    monkeypatch.setattr(script, "RESPONSES", tmp_path / "responses.jsonl.gz")
    cache = tmp_path / "responses.jsonl"
    records = [{"input_ids": [1, 2, 7], "loss_mask": [0, 0, 1]}, {"input_ids": [3, 8, 9], "loss_mask": [0, 1, 1]}]
    # an older record of the same prompt, a cut last line: the newest complete record of each prompt is kept
    lines = [json.dumps({"index": 0, "input_ids": [1, 2, 5], "loss_mask": [0, 0, 1]})]
    lines += [json.dumps(r) for r in records] + ['{"input_ids": [4, 4']
    cache.write_text("\n".join(lines))
    assert script.save_responses(cache) == 2
    saved = script.RESPONSES.read_bytes()
    assert [json.loads(line) for line in gzip.decompress(saved).decode().splitlines()] == records
    script.save_responses(cache)
    assert script.RESPONSES.read_bytes() == saved  # no diff when nothing changed
