"""Batched DFlash on an accelerator: plain batched greedy `generate` against batched DFlash at each batch size.

    python benchmarks/device_batch.py --json batch.json            # a random Qwen3-8B-shaped target, bf16, CUDA
    python benchmarks/device_batch.py --shape tiny --device cpu    # the same table on a tiny shape (dry run)

The embedded SmolLM2 pair cannot travel to a lent GPU (its GGUF file is larger than what a call carries), so
this runs `dflash_hf.evaluation.run_batch_bench` (what `dflash-hf bench --batch-size` runs) on the random
8B-shaped target and drafter of `device_step.py`, on left-padded random prompts of different lengths. Random
weights reject the drafts (tau ~1), which makes the full-block run a measurement of cost: a batched DFlash
step against a plain batched step at the same B. `break_even_tau` = that ratio, the tokens per row and step a
trained drafter must commit for batched DFlash to pay at that batch size (where it grows past a real drafter's
tau, batching stops paying for DFlash). The adaptive run is the default's worst case: with nothing accepted it
should fall back to plain steps and cost what plain decoding costs.
"""

import argparse
import json
from pathlib import Path

import torch

from dflash_hf.evaluation import format_batch_summary, run_batch_bench
from device_step import SHAPES, build


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 4, 8, 16], metavar="B")
    parser.add_argument("--prompt-length", type=int, default=256, help="the longest prompt; the shortest is half")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--min-rows", type=int, default=4, help="prompts per batch size at least")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device, dtype, shape = torch.device(args.device), getattr(torch, args.dtype), SHAPES[args.shape]
    generator = torch.Generator().manual_seed(0)
    rows = max(max(args.batch_size), args.min_rows)
    lengths = torch.randint(args.prompt_length // 2, args.prompt_length + 1, (rows,), generator=generator).tolist()
    vocab = shape["target"]["vocab_size"]
    # ids 1 .. vocab-2: 0 pads, vocab-1 is the drafter's mask token
    prompts = [torch.randint(1, vocab - 1, (n,), generator=generator).tolist() for n in lengths]
    target, drafter = build(shape, device, dtype)
    result = None
    for size in args.batch_size:  # each B on max(B, --min-rows) prompts, so that B = 1 does not take the minutes
        part = run_batch_bench(target, drafter, prompts[: max(size, args.min_rows)], [size],
                               max_new_tokens=args.new_tokens, pad_token_id=0)
        result = part if result is None else {**result, "batch_sizes": result["batch_sizes"] + part["batch_sizes"]}
    for row in result["batch_sizes"]:
        row["break_even_tau"] = row["tau"] * row["plain_tok_s"] / row["dflash_tok_s"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result.update(device=name, shape=args.shape, layers=target.config.num_hidden_layers)
    print(format_batch_summary(result))
    print("break-even tau per row (a DFlash step's cost in plain steps): "
          + ", ".join(f"B={row['batch_size']}: {row['break_even_tau']:.2f}" for row in result["batch_sizes"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    identical = all(row["identical"] == 1.0 for row in result["batch_sizes"])
    return 0 if identical or dtype != torch.float32 else 1  # bf16 may round a k-token verify differently


if __name__ == "__main__":
    raise SystemExit(main())
