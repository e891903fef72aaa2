"""Where a DFlash step's time goes on an accelerator: the target's and the drafter's forwards, and the rest.

    python benchmarks/device_step.py --json step.json             # a random Qwen3-8B-shaped target, bf16, CUDA
    python benchmarks/device_step.py --shape tiny --device cpu    # the same measurements on a tiny shape (dry run)

Random weights: the drafts are rejected (tau ~1), so every step drafts and verifies a full block, the
step whose overhead matters. Per configuration (eager, and compiled on a static cache where
transformers compiles decoding, on a target cut to `--compile-layers` layers so that compiling fits
the device's minutes):
- `step_ms`: wall time per decoding step; `target_ms` and `drafter_ms`: the time each step spends inside
  the target's and the drafter's forwards, from forward hooks that record CUDA events (no sync) or the
  host clock on a CPU; `outside_share`: 1 - (target + drafter) / step, the share lost to everything else
  (goal <= 5 %);
- `syncs_per_step`: the synchronising CUDA calls per step, counted under `torch.cuda.set_sync_debug_mode`;
- plain greedy `generate` tokens/s beside it, and whether DFlash's greedy output equals it.
"""

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
from transformers import CompileConfig, Qwen3Config, Qwen3ForCausalLM

import dflash_hf
from dflash_hf import DFlashConfig, DFlashDraftModel

# Qwen3-8B and its DFlash drafter (z-lab/Qwen3-8B-DFlash-b16: 5 layers, block 16), and a tiny stand-in.
SHAPES = {
    "8b": dict(target=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, vocab_size=151936),
               drafter_layers=5, block_size=16, target_layer_ids=[1, 9, 17, 25, 33]),
    "tiny": dict(target=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=512),
                 drafter_layers=1, block_size=8, target_layer_ids=[1, 2]),
}


def build(shape: dict, device, dtype, num_layers: int | None = None):
    target_kwargs = dict(shape["target"], max_position_embeddings=4096, tie_word_embeddings=False,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if num_layers is not None:
        target_kwargs["num_hidden_layers"] = num_layers
    layers = target_kwargs["num_hidden_layers"]
    layer_ids = [min(i, layers - 1) for i in shape["target_layer_ids"]]
    layer_ids = sorted(set(layer_ids))
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(Qwen3Config(**target_kwargs)).to(dtype).eval()
        drafter_kwargs = {k: v for k, v in target_kwargs.items() if k != "num_hidden_layers"}
        drafter = DFlashDraftModel(DFlashConfig(
            **drafter_kwargs, num_hidden_layers=shape["drafter_layers"], block_size=shape["block_size"],
            num_target_layers=layers,
            dflash_config={"mask_token_id": target_kwargs["vocab_size"] - 1, "target_layer_ids": layer_ids},
        )).to(dtype).eval()
    return dflash_hf.enable(target), drafter


class ForwardClock:
    """Time spent inside a module's forwards: CUDA events around each (read after the run), or the host clock."""

    def __init__(self, module, device):
        self.cuda, self.spans, self.starts = device.type == "cuda", [], []
        self.handles = [module.register_forward_pre_hook(self._start), module.register_forward_hook(self._end)]

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self, *_):
        self.starts.append(self._mark())

    def _end(self, *_):
        self.spans.append((self.starts.pop(), self._mark()))

    def reset(self):
        self.spans, self.starts = [], []

    def span_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for start, end in self.spans]
        return [(end - start) * 1e3 for start, end in self.spans]

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(target, drafter, prompt, new_tokens: int, device, **kwargs) -> dict:
    """One warm-up call, then one timed DFlash call (full block every step) and one plain call."""
    dflash = dict(assistant_model=drafter, dflash_verify_length=drafter.config.block_size - 1, dflash_lookup=None,
                  return_dict_in_generate=True)
    # the clocks' hooks are in place before the warm-up compiles: adding them later would recompile
    clocks = [ForwardClock(target, device), ForwardClock(drafter, device)]
    for extra in (dflash, {}):  # warm-up (and compile)
        target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, **extra, **kwargs)
    for clock in clocks:
        clock.reset()
    _sync(device)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            out = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, **dflash, **kwargs)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    _sync(device)
    seconds = time.perf_counter() - start
    target_spans, drafter_spans = (clock.span_ms() for clock in clocks)
    steps = len(out.dflash_stats.acceptance_lengths)  # verify forwards, after the prefill
    # the prefill is the target's first forward: the step figures leave it out
    prefill_ms, target_ms, drafter_ms = target_spans[0], sum(target_spans[1:]), sum(drafter_spans)
    step_wall_ms = seconds * 1e3 - prefill_ms
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    _sync(device)
    start = time.perf_counter()
    plain = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, **kwargs)
    _sync(device)
    plain_seconds = time.perf_counter() - start
    for clock in clocks:
        clock.remove()
    generated = out.sequences.shape[1] - prompt.shape[1]
    return dict(
        steps=steps, tau=out.dflash_stats.mean_acceptance_length, prefill_ms=prefill_ms,
        step_ms=step_wall_ms / steps, target_ms=target_ms / steps, drafter_ms=drafter_ms / steps,
        outside_share=1.0 - (target_ms + drafter_ms) / step_wall_ms,
        syncs_per_step=syncs / steps if device.type == "cuda" else None,
        dflash_tok_s=generated / seconds, plain_tok_s=(plain.shape[1] - prompt.shape[1]) / plain_seconds,
        identical=bool(torch.equal(out.sequences, plain)),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--compile-layers", type=int, default=4, help="target layers of the compiled runs (0: none)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device, dtype, shape = torch.device(args.device), getattr(torch, args.dtype), SHAPES[args.shape]
    prompt = torch.randint(0, shape["target"]["vocab_size"] - 1, (1, args.prompt_length),
                           generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    with torch.inference_mode():
        target, drafter = build(shape, device, dtype)
        rows.append(dict(config=f"eager, {target.config.num_hidden_layers} layers",
                         **measure(target, drafter, prompt, args.new_tokens, device)))
        del target, drafter
        if args.compile_layers:
            target, drafter = build(shape, device, dtype, num_layers=args.compile_layers)
            for name, kwargs in (("eager", {}), ("compiled static", dict(cache_implementation="static"))):
                if name != "eager" and device.type == "cpu":
                    config = CompileConfig(fullgraph=False)
                    config._compile_all_devices = True  # transformers' switch for compiling decoding on a CPU
                    kwargs["compile_config"] = config
                rows.append(dict(config=f"{name}, {args.compile_layers} layers",
                                 **measure(target, drafter, prompt, args.new_tokens, device, **kwargs)))
    print(f"{'config':<26} {'step ms':>8} {'target':>8} {'drafter':>8} {'outside':>8} {'syncs':>6} "
          f"{'dflash t/s':>10} {'plain t/s':>9} identical")
    for row in rows:
        syncs = "-" if row["syncs_per_step"] is None else f"{row['syncs_per_step']:.2f}"
        print(f"{row['config']:<26} {row['step_ms']:8.2f} {row['target_ms']:8.2f} {row['drafter_ms']:8.2f} "
              f"{row['outside_share']:8.1%} {syncs:>6} {row['dflash_tok_s']:10.1f} {row['plain_tok_s']:9.1f} "
              f"{row['identical']}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=name, shape=args.shape, dtype=args.dtype, rows=rows),
                                              indent=2) + "\n")
    return 0 if all(row["identical"] for row in rows) or dtype != torch.float32 else 1


if __name__ == "__main__":
    raise SystemExit(main())
