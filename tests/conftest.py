import os
import sys

# Tests never reach the Hub: every model is built in-process (tests/tiny.py) or read from tmp folders.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))
