"""benchmarks/device_step.py (the step part of scripts/device_check.sh), dry-run on the CPU on a tiny shape:
it measures a step's forwards against its wall time and checks DFlash's greedy output against plain."""

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("device_step", Path(__file__).parent.parent / "benchmarks" / "device_step.py")
device_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device_step)


def test_tiny_dry_run(tmp_path):
    out = tmp_path / "step.json"
    code = device_step.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-length", "24",
                             "--new-tokens", "12", "--compile-layers", "0", "--json", str(out)])
    assert code == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["identical"]
    # random weights: drafts are rejected, so each verify forward commits about one token
    assert 1 <= row["tau"] < 2 and row["steps"] >= 6
    # the forwards the hooks saw fit inside the step's wall time, and the drafter ran on every step
    assert 0 < row["target_ms"] + row["drafter_ms"] < row["step_ms"]
    assert row["drafter_ms"] > 0 and 0 < row["outside_share"] < 1


def test_tiny_batch_dry_run(tmp_path, monkeypatch):
    """benchmarks/device_batch.py (the batch table of the device script): every batch size runs every prompt to its
    last token, and every row of both DFlash runs equals plain batched greedy in fp32."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    path = Path(__file__).parent.parent / "benchmarks" / "device_batch.py"
    device_batch = importlib.util.module_from_spec(importlib.util.spec_from_file_location("device_batch", path))
    device_batch.__spec__.loader.exec_module(device_batch)
    out = tmp_path / "batch.json"
    code = device_batch.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batch-size", "1", "3",
                              "--prompt-length", "20", "--new-tokens", "10", "--min-rows", "2", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [row["batch_size"] for row in result["batch_sizes"]] == [1, 3]
    for row in result["batch_sizes"]:
        assert row["rows"] == max(row["batch_size"], 2) and row["new_tokens"] == 10 * row["rows"]  # no EOS: all tokens
        assert row["identical"] == 1.0
        assert 1 <= row["tau"] < 2  # random weights: drafts rejected
        assert row["break_even_tau"] > 0
