import os
import sys

import torch

# Tests never reach the Hub: every model is built in-process (tests/tiny.py) or read from tmp folders.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))
# The Triton kernels run in Triton's CPU interpreter here. `@triton.jit` reads this when the kernel
# module is first imported, and that module stays cached, so it is set once for the whole session;
# the loader tests that need "no interpreter" change it around the loader's decision only.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine OpenMP's spinning
# threads made each forward ~60x slower.
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _own_calibration_file(monkeypatch, tmp_path):
    """Each test reads and writes its own CPU calibration (`dflash_hf.hardware`), never the user's cached one."""
    from dflash_hf import hardware

    monkeypatch.setattr(hardware, "calibration_file", lambda: tmp_path / "calibration.json")
