"""What the machine computes fast: the CPU's features, what a target's forwards cost on it (measured once and
cached), the dtype and forward path DFlash runs in, the dtypes plain decoding is compared in, the policy's prior.

On a CPU no flag predicts the cheapest dtype or whether a verify forward over k tokens costs little more than
one (SmolLM2-135M over 1/2/4/8/16 tokens, ms, 2 cores: an AVX2-only EPYC bf16 37/49/77/134/253 against fp32
56/94/98/90/108; an AVX-512F Xeon without BF16 fp32 40/46/79/92/141, bf16 42/59/93/123/151; a Xeon with
AVX512-BF16 and AMX decoded plain float32 faster although its wide bf16 forwards were far cheaper). So
`calibrate` times the target's own forwards, one and `width` tokens, in each dtype, eager and with packed
linears (`dflash_hf.packed`), in a few seconds, and caches the figures per CPU model, thread count and torch
version (`calibration_file()`); `resolve_dtype`, `use_packed` and `cost_prior` read them, and fall back to
the CPU's flags where no calibration exists. A speedup is only honest against every plain configuration,
each timed (`plain_dtypes`).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from .packed import is_packed, pack_linears, packed_ops_available

# the /proc/cpuinfo flags that decide how fast bfloat16 and float32 matmuls run
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


@functools.cache  # read once a process: describe_cpu and resolve_dtype both ask
def _cpuinfo() -> tuple[str, list[str]]:
    try:
        with open("/proc/cpuinfo") as info:
            lines = info.read().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU", []
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return name, flags


def cpu_features() -> list[str]:
    """Which of `CPU_FLAGS` this CPU has (from /proc/cpuinfo; torch's probes where that is missing)."""
    _, flags = _cpuinfo()
    if flags:
        return [flag for flag in CPU_FLAGS if flag in flags]
    found = []
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        found.append("avx2")
    if native_cpu_bf16():
        found.append("avx512_bf16")
    return found


def describe_cpu() -> str:
    """`"<model name> (avx2, avx512_bf16; 2 threads)"`: what every speed figure should be quoted with."""
    name, _ = _cpuinfo()
    return f"{name} ({', '.join(cpu_features()) or 'no avx2'}; {torch.get_num_threads()} threads)"


def describe_device(device: torch.device | str) -> str:
    """`describe_cpu()` on a CPU, else the accelerator's name: what a speed figure is quoted with."""
    device = torch.device(device)
    if device.type == "cpu":
        return describe_cpu()
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    # MPS, XPU, ...: torch names the device through its own module where it can
    module = getattr(torch, device.type, None)
    get_name = getattr(module, "get_device_name", None)
    return get_name(device) if callable(get_name) else f"{device.type} device"


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (AVX512-BF16 or AMX), from /proc/cpuinfo's flags
    (torch's own probes where that file is missing)."""
    _, flags = _cpuinfo()
    if flags:
        return "avx512_bf16" in flags or "amx_bf16" in flags
    # torch exposes the CPU's bf16 support only through these (underscored, but stable since 2.1) probes
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe is not None and probe() for probe in probes)


# ------------------------------------------------------------------------------------------------ calibration
CALIBRATION_DTYPES = ("float32", "bfloat16")
# The prior tau and drafter cost (in the target's one-token steps) a calibration chooses DFlash's path with:
# the shipped SmolLM2 drafter's held-out tau is ~2.5 on code and ~1.4 on prose, its forward 0.3 of a step.
PRIOR_TAU, DRAFT = 2.0, 0.3
# The policy's prior without a calibration, in plain steps (`generation.policy.StepCosts`): the drafter's forward,
# and each verified draft's extra in the target's forward.
PER_DRAFT = 0.05
# The same where bfloat16 matmuls of more than one row are emulated (a CPU without AVX512-BF16 or AMX: SmolLM2-135M's
# forward over 1/2/4/8/16 tokens took 37/49/77/134/253 ms on an AVX2-only EPYC, each row 0.36-0.39 of a token's
# step); the drafter's forward there (two layers and a 15,360-row head over 16 rows) estimated from those figures.
EMULATED_DRAFT, EMULATED_PER_DRAFT = 0.8, 0.38


def cache_dir() -> Path:
    """Where dflash-hf keeps its files (converted targets, calibrations): `$DFLASH_HF_CACHE` if set, else
    `dflash-hf` in huggingface_hub's home (`$HF_HOME`, by default `~/.cache/huggingface`)."""
    if os.environ.get("DFLASH_HF_CACHE"):
        return Path(os.environ["DFLASH_HF_CACHE"]).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "dflash-hf"


def calibration_file() -> Path:
    return cache_dir() / "calibration.json"


def machine_key() -> str:
    """What a calibration holds for: the CPU model, the threads torch uses and torch's version."""
    return f"{_cpuinfo()[0]} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def target_key(config) -> str:
    """A target's shape (what its forwards' cost depends on), e.g. `llama 30x576/1536 v49152`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (f"{text.model_type} {text.num_hidden_layers}x{text.hidden_size}/{getattr(text, 'intermediate_size', 0)} "
            f"v{text.vocab_size}")


def _read_calibrations() -> dict:
    try:
        return json.loads(calibration_file().read_text())
    except (OSError, ValueError):
        return {}


def cached_calibration(config) -> dict | None:
    """This machine's figures for a target of `config`'s shape, or None: `{"width": k, "ms": {dtype: {mode:
    [t(1), t(k)]}}, "seconds": ...}`, in ms."""
    return _read_calibrations().get(machine_key(), {}).get(target_key(config))


def time_forwards(model, width: int, repeats: int = 5, context: int = 64) -> list[float]:
    """Median ms `[t(1), t(width)]` of `model`'s forward over 1 and `width` new tokens after `context` cached ones
    (a verify step's shape: the cache is cropped back after each), alternating the two."""
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, context + width), device=model.device)
    cache = DynamicCache(config=model.config)
    samples = {1: [], width: []}
    with torch.inference_mode():
        model(input_ids=ids[:, :context], cache=cache, use_cache=True)
        for round_ in range(repeats + 1):  # the first round warms up (packs, allocates) and is not kept
            for k in (1, width) if round_ % 2 else (width, 1):
                start = time.perf_counter()
                positions = torch.arange(context, context + k, device=model.device)[None]
                model(input_ids=ids[:, context:context + k], position_ids=positions, cache=cache,
                      use_cache=True, logits_to_keep=k)
                if round_:
                    samples[k].append((time.perf_counter() - start) * 1e3)
                cache.crop(-k)
    return [statistics.median(samples[1]), statistics.median(samples[width])]


def calibrate(config, load: Callable[[str], torch.nn.Module], width: int = 8, repeats: int = 5,
              say: Callable[[str], None] | None = None) -> dict:
    """Times a target of `config`'s shape (`load(dtype)` gives it, eager, on the CPU) in each dtype, eager and
    packed, over 1 and `width` tokens, and caches the figures (`calibration_file()`); returns them. A few
    seconds for SmolLM2-135M; `say` is told what is measured and how long it took."""
    if say is not None:
        say(f"calibrating this CPU for {target_key(config)}: forwards over 1 and {width} tokens in "
            f"{' and '.join(CALIBRATION_DTYPES)}, eager and packed (once; cached in {calibration_file()})")
    start, ms, pack_seconds = time.perf_counter(), {}, {}
    for dtype in CALIBRATION_DTYPES:
        model = load(dtype)
        ms[dtype] = {"eager": time_forwards(model, width, repeats)}
        if packed_ops_available():
            packing = time.perf_counter()
            pack_linears(model, rows=width)
            pack_seconds[dtype] = round(time.perf_counter() - packing, 3)
            ms[dtype]["packed"] = time_forwards(model, width, repeats)
        del model
    entry = {"width": width, "ms": ms, "pack_seconds": pack_seconds, "seconds": round(time.perf_counter() - start, 2)}
    calibrations = _read_calibrations()
    calibrations.setdefault(machine_key(), {})[target_key(config)] = entry
    path = calibration_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.partial")  # written beside, then renamed: never half a file
    staging.write_text(json.dumps(calibrations, indent=1))
    staging.replace(path)
    if say is not None:
        say("calibrated in {:.1f} s: ".format(entry["seconds"]) + describe_calibration(entry))
    return entry


def describe_calibration(entry: dict) -> str:
    """`"forwards over 1/8 tokens: float32 eager 60.1/101.9 ms, packed 44.2/57.3 ms (packing 0.31 s); bfloat16 ..."`."""
    packing = entry.get("pack_seconds", {})
    return f"forwards over 1/{entry['width']} tokens: " + "; ".join(
        f"{dtype} " + ", ".join(f"{mode} {one:.1f}/{wide:.1f} ms" for mode, (one, wide) in modes.items())
        + (f" (packing {packing[dtype]:.2f} s)" if dtype in packing else "") for dtype, modes in entry["ms"].items())


def _draft_steps(one: float, wide: float, width: int) -> float:
    """The drafter's forward in target steps on a path whose target forwards over 1 and `width` tokens cost `one`
    and `wide`: `DRAFT` where those were measured (`width` tokens 1 + (width - 1) `PER_DRAFT` steps), scaled like
    the block's forward (the drafter runs over the block too: where a wide target forward is dear, so is its)."""
    return DRAFT * (wide / one) / (1 + (width - 1) * PER_DRAFT)


def _dflash_seconds_per_token(one: float, wide: float, width: int) -> float:
    """Expected seconds a token of DFlash on a path whose forwards cost `one`/`wide`: a drafted step commits
    `PRIOR_TAU` tokens for the verify forward and the drafter's (which scales like the target's over the block),
    and the adaptive verify length falls back to plain steps where those cost less."""
    drafted = wide + _draft_steps(one, wide, width) * one
    return min(one, drafted / PRIOR_TAU)


def fastest_paths(entry: dict) -> dict:
    """From a calibration: `{"plain": (dtype, mode), "dflash": (dtype, mode)}`, the fastest plain decoding (the
    cheapest one-token forward) and the path DFlash expects to decode fastest on."""
    paths = [(dtype, mode, one, wide) for dtype, modes in entry["ms"].items() for mode, (one, wide) in modes.items()]
    plain = min(paths, key=lambda path: path[2])
    dflash = min(paths, key=lambda path: _dflash_seconds_per_token(path[2], path[3], entry["width"]))
    return {"plain": plain[:2], "dflash": dflash[:2]}


def runs_on_cuda(device: str | None) -> bool:
    """Whether a model loaded for `device` runs on CUDA (`None`: wherever torch finds one)."""
    return (device or "cpu").startswith("cuda") or (device is None and torch.cuda.is_available())


def runs_on_cpu(device: str | None) -> bool:
    """Whether a model loaded for `device` runs on the CPU (`None`: where no CUDA device is found)."""
    return (device or "cpu") == "cpu" and not runs_on_cuda(device)


def resolve_dtype(dtype: str, device: str | None = None, for_training: bool = False, config=None) -> str:
    """The dtype DFlash (and a target loaded for it) runs in; `"auto"` picks it by the hardware:

    - CUDA: `"bfloat16"` where the GPU has it, else `"float32"`.
    - a CPU where this target's shape (`config`) has been calibrated (`calibrate`): the dtype of the path DFlash
      expects to decode fastest on (`fastest_paths`).
    - else, from the CPU's flags: `"bfloat16"` with AVX512-BF16 or AMX (native) or with AVX2 (its one-token
      bf16 steps were the fastest plain decoding on an AVX2-only EPYC, and the policy prices the emulated wider
      forwards, `cost_prior`), `"float32"` on any other CPU. Measured false on an AVX-512F Xeon without BF16,
      where float32 was faster at every width (DFlash in bf16 0.94x the fastest plain): hence the calibration.

    `for_training`: training runs forwards over whole sequences, which a CPU without native bf16 emulates, so
    there it gets `"float32"`.
    """
    if dtype != "auto":
        return dtype
    if runs_on_cuda(device):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if for_training:
        return "bfloat16" if native_cpu_bf16() else "float32"
    if config is not None and (entry := cached_calibration(config)) is not None:
        return fastest_paths(entry)["dflash"][0]
    return "bfloat16" if native_cpu_bf16() or "avx2" in cpu_features() else "float32"


def use_packed(dtype: str, config=None, device: str | None = None) -> bool:
    """Whether a target of `config`'s shape in `dtype` decodes faster with packed linears on this CPU: where the
    calibration says its DFlash step (`_dflash_seconds_per_token`) is cheaper packed; without a calibration, on
    any CPU with the ops (every calibrated CPU so far measured packed faster in float32)."""
    if not runs_on_cpu(device) or not packed_ops_available():
        return False
    entry = cached_calibration(config) if config is not None else None
    if entry is None or "packed" not in entry["ms"].get(dtype, {}):
        return True
    modes = entry["ms"][dtype]
    width = entry["width"]
    return _dflash_seconds_per_token(*modes["packed"], width) < _dflash_seconds_per_token(*modes["eager"], width)


def cost_prior(model) -> dict:
    """The policy's prior step costs (`generation.policy.StepCosts`: `draft`, `per_draft`, in plain steps) for
    decoding `model` where it is: from this CPU's calibration of its shape, dtype and path where there is one
    (each verified draft costs `(t(k) - t(1)) / ((k - 1) t(1))`, the drafter `DRAFT` scaled like the block
    forward); else where bfloat16 is emulated the prior of the AVX2-only EPYC's figures (there every verified row
    costs nearly a token, and a prior shaped for a native device would price a plain step from a drafted one's
    seconds at 2-3 times its cost, so the policy would never try one); else the native prior."""
    weight = model.get_output_embeddings().weight
    if weight.device.type != "cpu":
        return {"draft": DRAFT, "per_draft": PER_DRAFT}
    dtype = str(weight.dtype).removeprefix("torch.")
    entry = cached_calibration(model.config)
    mode = "packed" if is_packed(model) else "eager"
    if entry is not None and mode in entry["ms"].get(dtype, {}):
        one, wide = entry["ms"][dtype][mode]
        per_draft = max(0.0, (wide - one) / ((entry["width"] - 1) * one))
        return {"draft": _draft_steps(one, wide, entry["width"]), "per_draft": per_draft}
    if weight.dtype == torch.bfloat16 and not native_cpu_bf16():
        return {"draft": EMULATED_DRAFT, "per_draft": EMULATED_PER_DRAFT}
    return {"draft": DRAFT, "per_draft": PER_DRAFT}


def plain_paths(device: str | None = None) -> list[tuple[str, bool]]:
    """`(dtype, packed)` of every plain configuration demo and bench time: each of `plain_dtypes`, eager and (on a
    CPU with the ops) packed, so that a speedup is over the fastest thing a user could run."""
    packs = (False, True) if runs_on_cpu(device) and packed_ops_available() else (False,)
    return [(dtype, packed) for dtype in plain_dtypes(device) for packed in packs]


def plain_dtypes(device: str | None = None) -> list[str]:
    """The dtypes plain `generate` is timed in (besides DFlash's own) to find the fastest plain configuration:
    float32 and bfloat16 on a CPU (either can be the faster there); on a GPU its half-precision type alone
    (float32 is never the fast one there, and a second copy of a large target in float32 may not fit)."""
    if runs_on_cuda(device):
        return ["bfloat16" if torch.cuda.is_bf16_supported() else "float16"]
    return ["float32", "bfloat16"]


__all__ = ["CPU_FLAGS", "cache_dir", "cached_calibration", "calibrate", "calibration_file", "cost_prior", "cpu_features",
           "describe_calibration", "describe_cpu", "describe_device", "fastest_paths", "machine_key", "native_cpu_bf16",
           "plain_dtypes", "plain_paths", "resolve_dtype", "runs_on_cpu", "runs_on_cuda", "target_key", "time_forwards",
           "use_packed"]
