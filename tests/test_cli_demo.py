"""`dflash-hf demo`: streams a DFlash answer through the chat template, then compares with plain generate."""

import re

import pytest

from dflash_hf import embedded
from dflash_hf.cli import main
from tiny import drafter, qwen3_target, tokenizer


@pytest.fixture
def pair(tmp_path):
    """A tiny target (with its tokenizer) and drafter saved as folders: the demo's arguments to them."""
    qwen3_target().save_pretrained(tmp_path / "target")
    tokenizer().save_pretrained(tmp_path / "target")
    drafter(0, block_size=4).save_pretrained(tmp_path / "drafter")
    # float32: there DFlash's output is plain greedy's exactly (bfloat16 may round a wider forward differently)
    return ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--dtype", "float32"]


def test_demo_streams_and_reports(pair, capsys):
    code = main(["demo", *pair, "--prompt", "write fib", "--max-new-tokens", "12"])
    out = capsys.readouterr().out
    assert code == 0
    # copies from the context are on by default (`--lookup 0`: DFlash alone)
    # plain generate in each dtype, eager and on the packed fast path (DFlash's own configuration first)
    paths = r"(float32 packed|float32|bfloat16 packed|bfloat16)"
    assert re.search(r"12 tokens, tau \d\.\d\d over \d+ target forwards \(\d+ of them verified copies from the context\); "
                     rf"speedup over the fastest plain greedy generate \({paths}\) \d+\.\d\dx "
                     r"\(DFlash [\d.]+ tok/s in (float32 packed|float32); plain \2 [\d.]+ tok/s, "
                     r"(float32|float32 packed) [\d.]+ tok/s, bfloat16 [\d.]+ tok/s, bfloat16 packed [\d.]+ tok/s\); "
                     r"identical output to plain \2: True\n", out)
    assert "calibrating this CPU for qwen3" in out and "calibrated in" in out  # said aloud, once
    assert re.search(r"^on .*threads\)$", out.rstrip().splitlines()[-1])  # the CPU the figures were measured on
    assert out.split("\n")[0].strip()  # the streamed answer comes first
    main(["demo", *pair, "--prompt", "write fib", "--max-new-tokens", "12", "--lookup", "0"])
    assert re.search(r"over \d+ target forwards; speedup", capsys.readouterr().out)  # DFlash alone


def test_demo_without_a_shipped_drafter_says_how_to_get_one(monkeypatch, pair, tmp_path, capsys):
    monkeypatch.setattr(embedded, "DRAFTER_DIR", tmp_path / "nothing")
    assert main(["demo", *pair[:2]]) == 2
    assert "dflash-hf train" in capsys.readouterr().err


def test_demo_with_lookup_stays_identical_and_counts_copies(pair, capsys):
    # a prompt that repeats itself, so that the context offers copies
    code = main(["demo", *pair, "--prompt", "a b c a b c a b c a b c", "--max-new-tokens", "24", "--lookup", "5"])
    out = capsys.readouterr().out
    assert code == 0
    copies = re.search(r"target forwards \((\d+) of them verified copies from the context\); speedup", out)
    assert copies and int(copies.group(1)) > 0
    assert "identical output to plain float32: True" in out
