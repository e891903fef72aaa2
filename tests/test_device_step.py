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
