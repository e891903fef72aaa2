"""The DFlash kernels (block attention, verification) vs their PyTorch references.

    python benchmarks/kernel_timings.py                 # realistic shapes (GPU; CPU times the reference only)
    python benchmarks/kernel_timings.py --quick         # tiny shapes, seconds on a CPU
    TRITON_INTERPRET=1 python benchmarks/kernel_timings.py --quick   # also the kernel, in Triton's interpreter

Prints a table and writes JSON (`--json`). Drafter head layouts: Qwen3-8B-DFlash-b16 (32 query
heads, 8 KV heads, head_dim 128) and gemma-4-31B-it-DFlash (64 / 8 / 128); block size 16; cached
context 1k-32k. Verification: a block of 16 (15 drafts) over Qwen3's 151,936-token vocabulary, fp32
scores, greedy and rejection sampling (the reference includes the two softmaxes the kernel does inside).
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from dflash_hf.generation import verify as accept_rules
from dflash_hf.kernels import block_attention_reference, load_kernels
from dflash_hf.kernels.loader import interpreting

LAYOUTS = {"qwen3-8b-dflash": (32, 8, 128), "gemma-4-31b-it-dflash": (64, 8, 128)}
CONTEXTS = (1024, 4096, 8192, 16384, 32768)
QUICK_LAYOUTS = {"tiny-gqa4": (8, 2, 64)}
QUICK_CONTEXTS = (64, 256)
VERIFY_SHAPES = ((1, 15, 151936), (8, 15, 151936))  # (batch, drafts, vocab)
QUICK_VERIFY_SHAPES = ((1, 7, 4096),)


def _timer(device: torch.device, repeats: int):
    """Median milliseconds of `fn()`; CUDA events on GPUs, the wall clock elsewhere."""

    def measure(fn) -> float:
        fn()  # warm-up: Triton compiles on the first call
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    return measure


def _attention_rows(kernels, layouts, contexts, block, window, dtype, device, measure):
    for name, (heads, kv_heads, head_dim) in layouts.items():
        for context in contexts:
            q = torch.randn(1, block, heads, head_dim, dtype=dtype, device=device).transpose(1, 2)
            k = torch.randn(1, kv_heads, context + block, head_dim, dtype=dtype, device=device)
            v = torch.randn_like(k)
            scale = head_dim**-0.5
            row = dict(op="block_attention", shape=f"{name} ctx={context} block={block} window={window}",
                       reference_ms=measure(lambda: block_attention_reference(q, k, v, scale, window)))
            if kernels is not None:
                row["kernel_ms"] = measure(lambda: kernels.block_attention(q, k, v, scale, window))
            yield row


def _verify_rows(kernels, shapes, device, measure):
    for batch, k, vocab in shapes:
        target = torch.randn(batch, k + 1, vocab, device=device)
        draft_scores = target[:, :-1] + torch.randn(batch, k, vocab, device=device)
        drafts = target[:, :-1].argmax(-1)
        uniform, exponential = accept_rules.sampling_noise(batch, k, vocab, device=device)
        shape = f"batch={batch} drafts={k} vocab={vocab}"
        row = dict(op="greedy_verify", shape=shape, reference_ms=measure(lambda: accept_rules.greedy_verify(drafts, target)))
        if kernels is not None:
            row["kernel_ms"] = measure(lambda: kernels.greedy_verify(drafts, target))
        yield row
        reference = lambda: accept_rules.rejection_verify(drafts, draft_scores.softmax(-1), target.softmax(-1), uniform,
                                                          exponential)
        row = dict(op="rejection_verify", shape=shape, reference_ms=measure(reference))
        if kernels is not None:
            row["kernel_ms"] = measure(lambda: kernels.rejection_verify(drafts, draft_scores, target, uniform, exponential))
        yield row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--window", type=int, default=None, help="sliding window for the attention rows")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", default="kernel_timings.json", help="where to write the results")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu" and dtype != torch.float32 and not args.quick:
        print("note: CPU run, attention in float32 (CPU bf16 matmuls are not representative)")
        dtype = torch.float32
    kernels_can_run = device.type != "cpu" or interpreting()
    kernels = load_kernels() if kernels_can_run else None
    if kernels is None:
        note = "Triton kernels skipped: " + (
            "no GPU (set TRITON_INTERPRET=1 to run them in the interpreter)" if not kernels_can_run
            else "they could not load (see the warning above)"
        )
    else:
        note = "Triton kernels in the CPU interpreter: times are not representative" if device.type == "cpu" else ""
    if note:
        print(f"note: {note}")

    layouts, contexts = (QUICK_LAYOUTS, QUICK_CONTEXTS) if args.quick else (LAYOUTS, CONTEXTS)
    repeats = args.repeats or (3 if args.quick or device.type == "cpu" else 50)
    measure = _timer(device, repeats)
    rows = []
    with torch.inference_mode():
        for row in _attention_rows(kernels, layouts, contexts, 16, args.window, dtype, device, measure):
            rows.append(row)
        rows.extend(_verify_rows(kernels, QUICK_VERIFY_SHAPES if args.quick else VERIFY_SHAPES, device, measure))

    print(f"\n{'op':<17} {'shape':<52} {'reference ms':>13} {'kernel ms':>10} {'speedup':>8}")
    for row in rows:
        kernel = row.get("kernel_ms")
        if kernel is not None:
            row["speedup"] = row["reference_ms"] / kernel
        cells = (f"{kernel:10.3f}", f"{row['speedup']:7.2f}x") if kernel is not None else (f"{'-':>10}", f"{'-':>8}")
        print(f"{row['op']:<17} {row['shape']:<52} {row['reference_ms']:13.3f} {cells[0]} {cells[1]}")

    result = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, dtype=str(dtype).removeprefix("torch."), quick=args.quick, repeats=repeats,
        kernels="skipped" if kernels is None else ("interpreter" if device.type == "cpu" else "triton"),
        note=note, rows=rows,
    )
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
