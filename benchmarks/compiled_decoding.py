"""Plain and DFlash decoding, eager and compiled on a static cache, on the embedded SmolLM2 pair (issue 26 §2).

    python benchmarks/compiled_decoding.py                              # fp32 and bf16, 4 HumanEval prompts
    python benchmarks/compiled_decoding.py --dtypes bfloat16 --prompts humaneval:8 --repeats 3
    python benchmarks/compiled_decoding.py --dtypes bfloat16 --packed        # "eager" on packed linears

"compiled" is what `generate` does with `cache_implementation="static"` and a `compile_config` (on a CPU
transformers compiles only when the config allows every device, as here): plain decoding compiles its
one-token forward, DFlash its verify forward at a few padded widths. Greedy, 128 new tokens, chat template,
the default DFlash settings (adaptive verify length, copies from the context). Every prompt runs each method
in turn, the order rotating from one repeat to the next; figures are tokens per second over all prompts
(median over repeats) and whether each output equals plain greedy in the same dtype and mode. The first
call of every compiled method compiles and is not timed. With `--packed` the target's linears are packed
(`dflash_hf.packed`): the eager methods then run the packed fast path; a compiled graph computes plain linears.
"""

import argparse
import json
import statistics
import time

import torch
from transformers import CompileConfig

import dflash_hf
from dflash_hf import embedded
from dflash_hf.evaluation import encode_prompt, load_prompts
from dflash_hf.hardware import describe_cpu
from dflash_hf.packed import pack_linears

METHODS = ("plain eager", "plain compiled", "dflash eager", "dflash compiled")


def _kwargs(method: str, drafter) -> dict:
    kwargs = {}
    if method.endswith("compiled"):
        config = CompileConfig(fullgraph=False)
        config._compile_all_devices = True  # transformers' switch for compiling decoding on a CPU
        kwargs.update(cache_implementation="static", compile_config=config)
    if method.startswith("dflash"):
        kwargs["assistant_model"] = drafter
    return kwargs


def run(dtype: str, prompt_ids, repeats: int, max_new_tokens: int, packed: bool = False) -> dict:
    target, _ = embedded.load_smollm2(dtype=dtype)
    if packed:
        pack_linears(target)  # the drafter follows its packed target
    drafter = embedded.load_drafter(dtype=getattr(torch, dtype))
    eos = target.generation_config.eos_token_id

    def call(method, ids):
        ids = torch.tensor([ids])
        start = time.perf_counter()
        out = dflash_hf.generate(target, ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos if isinstance(eos, int) else eos[0],
                                 **_kwargs(method, drafter))
        return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start

    for method in METHODS:  # warm-up: compiles, and the first eager call's one-time costs
        call(method, prompt_ids[0])
    rates, texts = {m: [] for m in METHODS}, {}
    for repeat in range(repeats):
        seconds, tokens = dict.fromkeys(METHODS, 0.0), dict.fromkeys(METHODS, 0)
        for i, ids in enumerate(prompt_ids):
            order = METHODS[(i + repeat) % 4:] + METHODS[:(i + repeat) % 4]
            for method in order:
                new, took = call(method, ids)
                seconds[method] += took
                tokens[method] += len(new)
                texts[method, i] = new
        for method in METHODS:
            rates[method].append(tokens[method] / seconds[method])
    result = {}
    for method in METHODS:
        baseline = "plain compiled" if method.endswith("compiled") else "plain eager"
        same = sum(texts[method, i] == texts[baseline, i] for i in range(len(prompt_ids)))
        result[method] = {"tokens_per_second": statistics.median(rates[method]), "runs": rates[method],
                          "identical": f"{same}/{len(prompt_ids)}"}
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompts", default="humaneval:4")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--packed", action="store_true", help="the target's and drafter's linears packed")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    print(describe_cpu(), "packed" if args.packed else "")
    _, tokenizer = embedded.load_smollm2()
    prompt_ids = [encode_prompt(tokenizer, item["prompt"]) for item in load_prompts(args.prompts)]
    results = {}
    for dtype in args.dtypes:
        results[dtype] = run(dtype, prompt_ids, args.repeats, args.max_new_tokens, args.packed)
        fastest_plain = max(results[dtype][m]["tokens_per_second"] for m in METHODS[:2])
        for method, r in results[dtype].items():
            print(f"{dtype:9s} {method:16s} {r['tokens_per_second']:6.1f} tok/s  {r['tokens_per_second'] / fastest_plain:.2f}x "
                  f"of the fastest plain  identical to plain greedy (same mode): {r['identical']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"cpu": describe_cpu(), "prompts": args.prompts, "packed": args.packed, "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
