"""What a target forward over k tokens costs against one token: eager, packed and compiled (issues 26, 36).

    python benchmarks/forward_widths.py                         # embedded SmolLM2, float32 and bfloat16
    python benchmarks/forward_widths.py --dtypes bfloat16 --widths 1 8 --repeats 20 --modes eager packed
    python benchmarks/forward_widths.py --tiny                  # a tiny random Qwen3, seconds (a dry run)

A verify forward appends k tokens to a static cache holding `--context` tokens, the way DFlash's verify
step does, then the cache is cropped back, so every timed forward sees the same cache. "compiled" is the
target's `get_compiled_call` (transformers' own `torch.compile` wrapper, the one `generate` uses for static
caches), one graph per width; its first calls per width are warm-up and not timed. Rounds alternate the
widths and the modes, and each figure is the median over rounds. "packed" is the target with
`dflash_hf.packed.pack_linears` (oneDNN-packed linear weights, eager otherwise). Prints t(k) in ms and t(k)/t(1).
"""

import argparse
import json
import statistics
import time

import torch
from transformers import CompileConfig, StaticCache

from dflash_hf.hardware import describe_cpu
from dflash_hf.packed import pack_linears, unpack_linears

MODES = ("eager", "packed", "compiled")


def _target(tiny: bool, dtype: torch.dtype):
    if tiny:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        return Qwen3ForCausalLM(config).eval().to(dtype)
    from dflash_hf import embedded

    model, _ = embedded.load_smollm2(dtype=str(dtype).removeprefix("torch."))
    return model.eval()


def time_widths(model, widths, context: int, repeats: int, mode: str) -> dict[int, float]:
    """Median ms of a forward over k new tokens after `context` cached ones, for each k in `widths`."""
    compiled = mode == "compiled"
    if mode == "packed":
        pack_linears(model, rows=max(widths))
    max_width = max(widths)
    cache = StaticCache(config=model.config, max_cache_len=context + max_width)
    ids = torch.randint(0, model.config.vocab_size, (1, context + max_width))
    call = model.get_compiled_call(CompileConfig(fullgraph=False)) if compiled else model.__call__
    with torch.inference_mode():
        model(input_ids=ids[:, :context], cache=cache, use_cache=True)  # the prefill, eager as in generate

        def forward(k):
            positions = torch.arange(context, context + k).unsqueeze(0)
            call(input_ids=ids[:, context:context + k], position_ids=positions, cache=cache, use_cache=True)
            cache.crop(-k)

        for k in widths:  # warm-up: compiles each width's graph once
            for _ in range(3 if compiled else 1):
                forward(k)
        samples = {k: [] for k in widths}
        for round_ in range(repeats):
            for k in widths if round_ % 2 == 0 else reversed(widths):
                start = time.perf_counter()
                forward(k)
                samples[k].append((time.perf_counter() - start) * 1e3)
    unpack_linears(model)
    return {k: statistics.median(v) for k, v in samples.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 instead of SmolLM2")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    print(describe_cpu())
    results = []
    for dtype in args.dtypes:
        model = _target(args.tiny, getattr(torch, dtype))
        for mode in args.modes + args.modes[::-1]:  # twice each, alternating: the machine drifts
            ms = time_widths(model, args.widths, args.context, args.repeats, mode)
            results.append({"dtype": dtype, "mode": mode, "ms": ms})
        for mode in args.modes:
            runs = [r["ms"] for r in results if r["dtype"] == dtype and r["mode"] == mode]
            ms = {k: statistics.median(run[k] for run in runs) for k in args.widths}
            cells = "  ".join(f"{k}: {ms[k]:6.1f} ms ({ms[k] / ms[args.widths[0]]:.2f})" for k in args.widths)
            print(f"{dtype:9s} {mode:8s} {cells}", flush=True)
        del model
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"cpu": describe_cpu(), "context": args.context, "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
