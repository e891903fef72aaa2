"""Training loop: a DFlash drafter distilled from any HF causal LM target.

`accelerate` does devices, mixed precision, gradient accumulation, multi-GPU (launch with
`accelerate launch`) and checkpoint state; there is no distributed code of our own. Checkpoints
(`output_dir/checkpoints/step-N`) hold the drafter, optimizer, scheduler and RNG states plus
`trainer_state.json`; `resume=True` continues from the latest one at the same step and batch.

The target's embeddings and lm_head stay frozen and are not saved; the drafter folder written at
the end is the z-lab format (`DFlashDraftModel.save_pretrained`) plus a model card.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..modeling_dflash import DFlashConfig, DFlashDraftModel, find_mask_token_id
from ..targets import logit_softcap, text_config
from .data import DFlashDataset, collate, target_layer_features
from .objective import BlockTrainingModule, default_gamma, dflash_loss

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"


def _arg(default, help: str, **kwargs):
    """A dataclass field whose help text `HfArgumentParser` shows in `dflash-hf train --help`."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class TrainConfig:
    """Hyper-parameters (published recipe defaults: lr 6e-4, warmup 4%, clip 1.0, 6 epochs).

    `dflash-hf train` exposes every field as an option (`transformers.HfArgumentParser`)."""

    output_dir: str = _arg("dflash-drafter", "drafter folder; checkpoints and data are kept inside")
    block_size: int = _arg(16, "tokens per drafted block (anchor + block_size - 1 drafts)")
    num_draft_layers: int = _arg(5, "decoder layers of the drafter")
    target_layer_ids: list[int] | None = _arg(None, "target layers whose outputs the drafter reads "
                                              "(default: distinct layers spread over the target, never the last)")
    mask_token_id: int | None = _arg(None, "default: an unused special token of the tokenizer")
    epochs: float = _arg(6.0, "passes over the data")
    max_steps: int | None = _arg(None, "cap on the total optimizer steps (the lr schedule follows it)")
    stop_after_steps: int | None = _arg(None, "end this session at that global step; the schedule is unchanged, "
                                        "so a later resumed run continues exactly as if never interrupted")
    learning_rate: float = _arg(6e-4, "peak learning rate (AdamW)")
    lr_scheduler_type: str = _arg("cosine", "a transformers.get_scheduler name; constant_with_warmup suits a run "
                                  "that is resumed and extended across sessions (a cosine to zero wastes a short run)")
    warmup_ratio: float = _arg(0.04, "fraction of the steps spent warming up")
    weight_decay: float = _arg(0.0, "AdamW weight decay")
    max_grad_norm: float = _arg(1.0, "gradient clipping (0: none)")
    batch_size: int = _arg(4, "sequences per step")
    gradient_accumulation_steps: int = _arg(1, "batches per optimizer step")
    max_anchors: int = _arg(512, "blocks sampled per sequence and step")
    max_length: int = _arg(2048, "tokens kept of each example")
    gamma: float | None = _arg(None, "decay of the slot weights exp(-(k-1)/gamma); default 7 for block 16, 4 for 8")
    lm_head_chunk: int = _arg(2048, "rows of the frozen lm_head matmul computed at once")
    restrict_vocab: bool = _arg(False, "cross-entropy over the tokens the training labels use, not the whole "
                                "vocabulary (the frozen lm_head matmul is most of a CPU step); the drafter records "
                                "them as its draft_vocab, from which decoding then drafts")
    precompute_features: bool | None = _arg(None, "compute the target features once (default: in one process)")
    feature_dtype: str = _arg("bfloat16", "dtype of the stored target features")
    mixed_precision: str = _arg("no", "accelerate mixed precision: no, bf16 or fp16", )
    seed: int = _arg(0, "seed of the data order, anchors and initialisation")
    checkpoint_every: int = _arg(0, "optimizer steps between checkpoints; 0: only at the end of each epoch")
    keep_checkpoints: int = _arg(2, "checkpoints kept")
    log_every: int = _arg(10, "steps between logged points")
    progress: bool = _arg(True, "progress bars")
    drafter_config_overrides: dict = _arg({}, "DFlashConfig fields to override (JSON on the command line)")

    def __post_init__(self):
        if isinstance(self.drafter_config_overrides, str):  # from the command line
            self.drafter_config_overrides = json.loads(self.drafter_config_overrides)
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be 'no', 'bf16' or 'fp16', got {self.mixed_precision!r}.")

    def to_json(self) -> dict:
        return asdict(self)


class EpochSampler(torch.utils.data.Sampler):
    """A fresh permutation per epoch from `(seed, epoch)`: resuming reproduces the order.

    The method is deliberately not called `set_epoch`: accelerate's data loaders call `set_epoch`
    with their own iteration count, which restarts at 0 in a resumed run."""

    def __init__(self, size: int, seed: int = 0):
        self.size, self.seed, self.epoch = size, seed, 0

    def use_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())

    def __len__(self):
        return self.size


def label_vocabulary(examples: list[dict], vocab_size: int) -> torch.Tensor:
    """`[vocab_size]` map from token id to its row in the restricted lm_head (-1: never a label)."""
    used = torch.zeros(vocab_size, dtype=torch.bool)
    for example in examples:
        ids = torch.tensor(example["input_ids"])
        used[ids[torch.tensor(example["loss_mask"], dtype=torch.bool)]] = True
    label_map = torch.full((vocab_size,), -1, dtype=torch.long)
    label_map[used] = torch.arange(int(used.sum()))
    return label_map


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    folder = Path(output_dir) / CHECKPOINTS
    if not folder.is_dir():
        return None
    steps = [(int(p.name.split("-")[1]), p) for p in folder.glob("step-*") if (p / STATE_FILE).is_file()]
    return max(steps)[1] if steps else None


class Metrics:
    """Running sums of loss and per-slot accuracy."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.reset()

    def reset(self):
        self.loss_sum, self.batches = 0.0, 0
        self.correct = torch.zeros(self.block_size, dtype=torch.long)
        self.count = torch.zeros(self.block_size, dtype=torch.long)

    def add(self, out: dict):
        self.loss_sum += float(out["loss"].detach())
        self.batches += 1
        self.correct += out["correct"].cpu()
        self.count += out["count"].cpu()

    def summary(self) -> dict:
        count = self.count.clamp(min=1)
        per_slot = (self.correct / count).tolist()
        # Accuracy of slot k given the anchor only (not conditioned on earlier slots being right):
        # the product over slots is a rough estimate of the acceptance length.
        est, prod = 1.0, 1.0
        for k in range(1, self.block_size):
            prod *= per_slot[k]
            est += prod
        return {
            "loss": self.loss_sum / max(1, self.batches),
            "accuracy": float(self.correct.sum()) / max(1, int(self.count.sum())),
            "slot_accuracy": [round(a, 4) for a in per_slot[1:]],
            "estimated_tau": est,
        }


def train_drafter(
    target,
    examples: list[dict],
    config: TrainConfig,
    drafter: DFlashDraftModel | None = None,
    resume: bool = True,
    accelerator=None,
    save: bool = True,
    model_card: str | None = None,
    checkpoints: bool = True,
) -> tuple[DFlashDraftModel, dict]:
    """Trains a drafter on `examples` (`{"input_ids", "loss_mask"}` from `data.build_dataset`).

    `save`: write the drafter folder at the end; `checkpoints`: write resumable checkpoints.
    Returns the (unwrapped) drafter and a metrics dict (`final`: loss, accuracy, per-slot accuracy over
    the last epoch's batches; `history`: logged points; `steps_per_second`).
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    if accelerator is None:
        accelerator = Accelerator(
            gradient_accumulation_steps=config.gradient_accumulation_steps, mixed_precision=config.mixed_precision
        )
    set_seed(config.seed)
    output_dir = Path(config.output_dir)
    target.requires_grad_(False)
    target.eval()
    target.to(accelerator.device)

    if drafter is None:
        drafter = DFlashDraftModel(
            DFlashConfig.from_target(
                target,
                config.block_size,
                config.num_draft_layers,
                config.mask_token_id,
                target_layer_ids=config.target_layer_ids,
                **config.drafter_config_overrides,
            )
        )
    drafter.train()
    layer_ids = drafter.config.target_layer_ids

    dataset = DFlashDataset(examples, max_length=config.max_length)
    if len(dataset) == 0:
        raise ValueError("No training example has two or more response tokens.")
    precompute = config.precompute_features
    if precompute is None:
        precompute = accelerator.num_processes == 1
    if precompute:
        dataset.precompute_features(
            target, layer_ids, batch_size=config.batch_size, dtype=getattr(torch, config.feature_dtype),
            progress=config.progress and accelerator.is_main_process,
            cache_dir=output_dir / "data" if checkpoints else None,
        )

    sampler = EpochSampler(len(dataset), config.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=config.batch_size, sampler=sampler, collate_fn=collate)
    optimizer = torch.optim.AdamW(
        [p for p in drafter.parameters() if p.requires_grad], lr=config.learning_rate, weight_decay=config.weight_decay
    )
    updates_per_epoch = math.ceil(len(loader) / accelerator.num_processes / config.gradient_accumulation_steps)
    total_steps = max(1, math.ceil(config.epochs * updates_per_epoch))
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    warmup = int(round(config.warmup_ratio * total_steps))
    # accelerate steps a prepared scheduler once per process at each optimizer step.
    scheduler = get_scheduler(
        config.lr_scheduler_type, optimizer, num_warmup_steps=warmup * accelerator.num_processes,
        num_training_steps=total_steps * accelerator.num_processes,
    )
    block_size = drafter.config.block_size
    model, optimizer, loader, scheduler = accelerator.prepare(BlockTrainingModule(drafter), optimizer, loader, scheduler)

    state = {"global_step": 0, "epoch": 0, "batch_in_epoch": 0, "history": []}
    checkpoint = latest_checkpoint(output_dir) if resume else None
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        state = json.loads((checkpoint / STATE_FILE).read_text())
        accelerator.print(f"Resumed from {checkpoint} (step {state['global_step']}).")

    embed_tokens = target.get_input_embeddings()
    lm_head_weight = target.get_output_embeddings().weight
    label_map = None
    if config.restrict_vocab:
        label_map = label_vocabulary(dataset.examples, lm_head_weight.shape[0])
        lm_head_weight = lm_head_weight.detach()[label_map >= 0].to(accelerator.device)
        # Decoding then drafts from the tokens the drafter learnt to rank: these labels and an earlier run's.
        labels = (label_map >= 0).nonzero().flatten().tolist()
        drafter.config.dflash_config["draft_vocab"] = sorted(set(drafter.config.draft_vocab or []) | set(labels))
        label_map = label_map.to(accelerator.device)
    softcap = logit_softcap(target)
    metrics, epoch_metrics = Metrics(block_size), Metrics(block_size)
    last_epoch_summary = None
    bar = tqdm(
        total=total_steps, initial=state["global_step"], desc="train drafter", unit="step",
        disable=not (config.progress and accelerator.is_main_process),
    )
    started, start_step = time.perf_counter(), state["global_step"]
    device = accelerator.device
    num_epochs = math.ceil(config.epochs)

    def save_checkpoint():
        folder = output_dir / CHECKPOINTS / f"step-{state['global_step']}"
        accelerator.save_state(str(folder))
        if accelerator.is_main_process:
            (folder / STATE_FILE).write_text(json.dumps(state))
            done = sorted(
                (int(p.name.split("-")[1]), p) for p in (output_dir / CHECKPOINTS).glob("step-*") if p != folder
            )
            for _, old in done[: max(0, len(done) - config.keep_checkpoints + 1)]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()

    def more() -> bool:
        if config.stop_after_steps is not None and state["global_step"] >= config.stop_after_steps:
            return False
        return state["global_step"] < total_steps and state["epoch"] < num_epochs

    while more():
        sampler.use_epoch(state["epoch"])
        epoch_loader = loader
        if state["batch_in_epoch"]:
            epoch_loader = accelerator.skip_first_batches(loader, state["batch_in_epoch"])
        epoch_metrics.reset()
        for batch in epoch_loader:
            with accelerator.accumulate(model):
                if "features" in batch:
                    features = batch["features"].to(device)
                else:
                    features = target_layer_features(
                        target, batch["input_ids"].to(device), batch["attention_mask"].to(device), layer_ids
                    )
                # Anchors are resampled every batch, reproducibly (a resumed run draws the same ones).
                generator = torch.Generator().manual_seed(
                    config.seed * 1000003 + state["epoch"] * 7919 + state["batch_in_epoch"] * 131
                    + accelerator.process_index
                )
                out = dflash_loss(
                    model, embed_tokens, lm_head_weight, features, batch["input_ids"], batch["loss_mask"],
                    batch["lengths"], max_anchors=config.max_anchors, gamma=config.gamma, generator=generator,
                    chunk_size=config.lm_head_chunk, softcap=softcap, label_map=label_map,
                )
                accelerator.backward(out["loss"])
                if accelerator.sync_gradients and config.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            state["batch_in_epoch"] += 1
            metrics.add(out)
            epoch_metrics.add(out)
            if not accelerator.sync_gradients:
                continue
            state["global_step"] += 1
            bar.update(1)
            if state["global_step"] % config.log_every == 0 or state["global_step"] == total_steps:
                point = {"step": state["global_step"], "epoch": state["epoch"], "lr": scheduler.get_last_lr()[0],
                         **metrics.summary()}
                state["history"].append(point)
                bar.set_postfix(loss=f"{point['loss']:.3f}", acc=f"{point['accuracy']:.3f}")
                metrics.reset()
            if checkpoints and config.checkpoint_every and state["global_step"] % config.checkpoint_every == 0:
                save_checkpoint()
            if state["global_step"] >= total_steps or state["global_step"] == config.stop_after_steps:
                break
        else:  # the epoch ran to its end
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
            last_epoch_summary = epoch_metrics.summary()
            epoch_metrics.reset()
            if checkpoints and state["global_step"] < total_steps:
                save_checkpoint()
    bar.close()
    if epoch_metrics.batches:  # stopped inside an epoch: its batches are the latest
        last_epoch_summary = epoch_metrics.summary()
    if checkpoints and not (output_dir / CHECKPOINTS / f"step-{state['global_step']}").exists():
        save_checkpoint()  # so that a rerun with more epochs or steps continues from here

    elapsed = time.perf_counter() - started
    steps_done = state["global_step"] - start_step
    result = {
        "final": last_epoch_summary or (state["history"][-1] if state["history"] else {}),
        "history": state["history"],
        "global_step": state["global_step"],
        "total_steps": total_steps,
        "steps_per_second": steps_done / elapsed if elapsed > 0 else 0.0,
        "train_examples": len(dataset),
        "train_tokens": dataset.num_tokens,
        "train_response_tokens": dataset.num_response_tokens,
        "gamma": config.gamma if config.gamma is not None else default_gamma(block_size),
    }
    unwrapped = accelerator.unwrap_model(model).drafter
    unwrapped.eval()
    if save and accelerator.is_main_process:
        save_drafter(unwrapped, output_dir, config, result, model_card)
    return unwrapped, result


def save_drafter(drafter: DFlashDraftModel, output_dir, config: TrainConfig | None = None, metrics: dict | None = None,
                 model_card: str | None = None) -> Path:
    """z-lab format drafter folder (weights + config + remote-code file) plus a model card and metrics."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    drafter.save_pretrained(output_dir)
    if config is not None:
        (output_dir / "training_args.json").write_text(json.dumps(config.to_json(), indent=2))
    if metrics is not None:
        (output_dir / "training_metrics.json").write_text(json.dumps(metrics, indent=2))
    (output_dir / "README.md").write_text(model_card or default_model_card(drafter, config, metrics))
    return output_dir


def default_model_card(drafter: DFlashDraftModel, config: TrainConfig | None, metrics: dict | None) -> str:
    cfg = drafter.config
    final = (metrics or {}).get("final", {})
    lines = [
        "---",
        "library_name: dflash-hf",
        "tags: [dflash, speculative-decoding, block-diffusion]",
        "---",
        "",
        "# DFlash drafter",
        "",
        "A DFlash block-diffusion drafter trained with `dflash-hf train`. It has no embeddings and no lm_head: "
        "it borrows the target's.",
        "",
        f"- block size {cfg.block_size}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}",
        f"- target layers {cfg.target_layer_ids} of {cfg.num_target_layers}, mask token id {cfg.mask_token_id}",
    ]
    if final:
        lines.append(f"- training loss {final.get('loss', float('nan')):.4f}, accuracy {final.get('accuracy', 0):.4f}")
    if metrics and "eval" in metrics:
        lines.append(f"- held-out acceptance length (tau): {metrics['eval'].get('mean_tau', float('nan')):.3f}")
    lines += [
        "",
        "```python",
        "import dflash_hf",
        "drafter = dflash_hf.DFlashDraftModel.from_pretrained(PATH)",
        "dflash_hf.enable(target)",
        "target.generate(input_ids, assistant_model=drafter, do_sample=False)",
        "```",
        "",
    ]
    return "\n".join(lines)


__all__ = ["EpochSampler", "TrainConfig", "latest_checkpoint", "save_drafter", "train_drafter"]


def distill(
    target,
    tokenizer,
    prompts: list,
    config: TrainConfig,
    max_new_tokens: int = 256,
    generation_batch_size: int = 8,
    eval_prompts: list | None = None,
    eval_max_new_tokens: int = 128,
    resume: bool = True,
    target_name: str = "",
    model_card=None,
    drafter: DFlashDraftModel | None = None,
    extra_examples: list[dict] | None = None,
) -> tuple[DFlashDraftModel, dict]:
    """The whole recipe: regenerate responses with the target (cached in `output_dir/data`), train,
    then report training accuracy and held-out acceptance (tau) and write the drafter folder.

    `model_card(drafter, config, metrics) -> str` may replace the default card. `drafter`: start from
    these weights instead of a new drafter (a checkpoint in `output_dir`, when resuming, wins).
    `extra_examples`: examples trained on besides the regenerated ones, in one shuffled mix (teacher-forced
    text such as `data.source_text_examples`; `metrics["extra_examples"]` counts them).
    """
    from ..evaluation import encode_prompt, mean_tau
    from .data import build_dataset

    output_dir = Path(config.output_dir)
    if config.mask_token_id is None:
        config.mask_token_id = find_mask_token_id(tokenizer, text_config(target).vocab_size)
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
    stop = set()
    eos = target.generation_config.eos_token_id
    stop.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        stop.add(tokenizer.eos_token_id)
    started = time.perf_counter()
    examples = build_dataset(
        target, prompt_ids, output_dir / "data" / "responses.jsonl", max_new_tokens=max_new_tokens,
        batch_size=generation_batch_size, stop_ids=stop, pad_token_id=tokenizer.pad_token_id, progress=config.progress,
    )
    data_seconds = time.perf_counter() - started
    extra = list(extra_examples or [])
    drafter, metrics = train_drafter(target, examples + extra, config, drafter=drafter, resume=resume, save=False)
    metrics["data_seconds"] = data_seconds
    metrics["extra_examples"] = len(extra)
    metrics["target"] = target_name
    if eval_prompts:
        eval_ids = [encode_prompt(tokenizer, p) for p in eval_prompts]
        metrics["eval"] = mean_tau(target, drafter, eval_ids, eval_max_new_tokens, eos_token_id=sorted(stop) or None)
    card = model_card(drafter, config, metrics) if model_card else None
    save_drafter(drafter, output_dir, config, metrics, card)
    return drafter, metrics
