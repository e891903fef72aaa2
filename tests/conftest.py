import os
import sys

import torch

# Tests never reach the Hub: every model is built in-process (tests/tiny.py) or read from tmp folders.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))
# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine OpenMP's spinning
# threads made each forward ~60x slower.
torch.set_num_threads(1)
