"""What a DFlash step costs on this hardware, measured once and cached.

A step is one drafter forward plus one target forward over `[anchor, d1..dn]`. How the target's
forward time grows with `n` is a property of the device (on a GPU it stays nearly flat until the chip
fills; on a CPU a 16-token forward costs ~2x a 1-token one), so the verify-length policy reads it
from a profile: the target's forward time for a few query lengths (1..block) at a few context
lengths, and the drafter's step time, interpolated in between.

Profiles are measured in seconds (a few dozen forwards) on the device and dtype in use and stored
as JSON under `profile_dir()`, one file per key; the key covers the models' configs, dtypes, device,
attention implementations, thread count and torch version, so a change of any of them measures again.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..targets import text_config

PROFILE_VERSION = 1
CONTEXT_LENGTHS = (128, 1024)


@dataclass
class CostProfile:
    """Measured seconds: `target_seconds[c][q]` for `context_lengths[c]` cached tokens and
    `query_lengths[q]` new ones; `drafter_seconds[c]` for one drafting step (block forward + lm_head)."""

    query_lengths: list[int]
    context_lengths: list[int]
    target_seconds: list[list[float]]
    drafter_seconds: list[float]
    key: str = ""
    device: str = ""

    def __post_init__(self):
        if len(self.target_seconds) != len(self.context_lengths) or len(self.drafter_seconds) != len(self.context_lengths):
            raise ValueError("CostProfile needs one target row and one drafter time per context length.")
        if any(len(row) != len(self.query_lengths) for row in self.target_seconds):
            raise ValueError("CostProfile needs one target time per query length in every row.")

    def target_time(self, num_tokens: int, context_length: int) -> float:
        """Seconds of a target forward over `num_tokens` new tokens after `context_length` cached ones."""
        per_context = [_interpolate(self.query_lengths, row, num_tokens) for row in self.target_seconds]
        return _interpolate(self.context_lengths, per_context, context_length)

    def draft_time(self, context_length: int) -> float:
        return _interpolate(self.context_lengths, self.drafter_seconds, context_length)

    def to_dict(self) -> dict:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> CostProfile:
        data = {k: v for k, v in data.items() if k != "version"}
        return cls(**data)


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise linear in `x`, extended linearly past the ends (never below the smallest measurement)."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    value = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(value, min(ys))


def profile_dir() -> Path:
    """`$DFLASH_HF_PROFILE_DIR`, else `profiles/` in dflash-hf's cache folder."""
    if os.environ.get("DFLASH_HF_PROFILE_DIR"):
        return Path(os.environ["DFLASH_HF_PROFILE_DIR"]).expanduser()
    from ..embedded import cache_dir

    return cache_dir() / "profiles"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        # the same CPU model with another thread count is another machine for this purpose
        return f"cpu:{platform.machine()}:{platform.processor()}:{os.cpu_count()}:{torch.get_num_threads()}threads"
    return device.type


def profile_key(target, drafter) -> str:
    """Changes whenever the cost of a step may: models, dtypes, device, attention backends, torch."""
    parameter = next(target.parameters())
    drafter_parameter = next(drafter.parameters())
    described = {
        "version": PROFILE_VERSION,
        "torch": torch.__version__,
        "target": type(target).__name__,
        "target_config": target.config.to_json_string(use_diff=False),
        "target_dtype": str(parameter.dtype),
        "target_attention": getattr(target.config, "_attn_implementation", None),
        "device": _device_name(parameter.device),
        "drafter_config": drafter.config.to_json_string(use_diff=False),
        "drafter_dtype": str(drafter_parameter.dtype),
        "drafter_attention": getattr(drafter.config, "_attn_implementation", None),
        "drafter_device": _device_name(drafter_parameter.device),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


def _synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _timed(run, device, repeats: int) -> float:
    """Median seconds of `run()` after one warm-up call (the median, since a step in a real run
    meets the same noise)."""
    run()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def _query_lengths(block_size: int) -> list[int]:
    lengths = {1, 2, 3, 4, block_size}
    power = 8
    while power < block_size:
        lengths.add(power)
        power *= 2
    return sorted(n for n in lengths if n <= block_size)


@torch.no_grad()
def measure_profile(target, drafter, context_lengths=CONTEXT_LENGTHS, repeats: int = 3) -> CostProfile:
    """Times the target's forward (1..block new tokens) and a drafting step at each context length."""
    config = text_config(target)
    block_size = drafter.config.block_size
    limit = getattr(config, "max_position_embeddings", None) or max(context_lengths) + 2 * block_size
    contexts = sorted({max(1, min(c, limit - 2 * block_size)) for c in context_lengths})
    queries = _query_lengths(block_size)
    target_device = next(target.parameters()).device
    drafter_device = drafter.device
    generator = torch.Generator().manual_seed(0)
    layer_ids = drafter.config.target_layer_ids
    hidden_wanted = sorted({i + 1 for i in layer_ids})
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    keeps_logits = target._supports_logits_to_keep()  # as the assisted loop passes it

    def random_ids(n):
        return torch.randint(config.vocab_size, (1, n), generator=generator).to(target_device)

    target_rows, drafter_times = [], []
    for context in contexts:
        prefill = target(input_ids=random_ids(context), use_cache=True)
        cache = prefill.cache
        row = []
        for q in queries:
            ids = random_ids(q)

            def verify(ids=ids, q=q):
                # a copy per call: verification grows the cache, and hybrid states cannot be cropped
                extra = {"logits_to_keep": q} if keeps_logits else {}
                target(input_ids=ids, cache=copy.deepcopy(cache), use_cache=True,
                       output_hidden_states=hidden_wanted, **extra)

            row.append(_timed(verify, target_device, repeats))
        # more tokens never cost less: a dip is noise, and would make the policy favour odd lengths
        target_rows.append([max(row[: i + 1]) for i in range(len(row))])
        del prefill, cache

        features = drafter.fc.in_features
        from transformers import DynamicCache

        drafter_cache = DynamicCache()
        context_hidden = torch.randn(1, context, features, generator=generator).to(drafter_device, drafter.dtype)
        drafter(block_embeds=embed(random_ids(block_size)).to(drafter_device), target_hidden=context_hidden,
                position_ids=torch.arange(context + block_size, device=drafter_device)[None], cache=drafter_cache)
        drafter_cache.crop(-block_size)
        new_hidden = torch.randn(1, 2, features, generator=generator).to(drafter_device, drafter.dtype)
        block_embeds = embed(random_ids(block_size)).to(drafter_device)
        positions = torch.arange(context, context + 2 + block_size, device=drafter_device)[None]

        def draft():
            step_cache = copy.deepcopy(drafter_cache)
            out = drafter(block_embeds=block_embeds, target_hidden=new_hidden, position_ids=positions, cache=step_cache)
            logits = lm_head(out.last_hidden_state[:, 1:].to(lm_head.weight.dtype))
            logits.argmax(dim=-1)

        drafter_times.append(_timed(draft, drafter_device, repeats))
    return CostProfile(queries, contexts, target_rows, drafter_times, device=_device_name(target_device))


_MEMORY: dict[str, CostProfile] = {}


def load_profile(target, drafter, measure: bool = True) -> CostProfile | None:
    """The cached profile for this pair on this hardware; measured (and stored) when missing."""
    key = profile_key(target, drafter)
    if key in _MEMORY:
        return _MEMORY[key]
    path = profile_dir() / f"{key}.json"
    profile = None
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("version") == PROFILE_VERSION:
                profile = CostProfile.from_dict(data)
        except (OSError, ValueError, TypeError):
            profile = None  # unreadable or from another version: measure again
    if profile is None:
        if not measure:
            return None
        profile = measure_profile(target, drafter)
        profile.key = key
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(profile.to_dict(), indent=1))
            temporary.replace(path)
        except OSError:
            pass  # a read-only cache only costs a new measurement next process
    _MEMORY[key] = profile
    return profile


__all__ = ["CostProfile", "load_profile", "measure_profile", "profile_dir", "profile_key"]
