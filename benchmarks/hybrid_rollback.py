"""What the state rollback of hybrid (linear-attention) targets costs per DFlash step.

A small Qwen3.5-style target (3 Gated-DeltaNet layers per full-attention layer) built in-process with
random weights, and a random drafter, so that nearly every step rejects and needs a rollback: the
worst case. Reports per step: the snapshot copy, the target's verify forward over the block, and the
replay forward over the committed tokens, side by side in one run. Absolute times only mean
something on the machine they were measured on; the ratios are the point.

    python benchmarks/hybrid_rollback.py --json rollback.json
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

import dflash_hf
from dflash_hf.generation import rollback


def build(hidden: int, layers: int, vocab: int, block_size: int):
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
        linear_num_key_heads=hidden // 128, linear_num_value_heads=hidden // 64, linear_key_head_dim=64,
        linear_value_head_dim=64, tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    )
    target = dflash_hf.enable(Qwen3_5ForCausalLM(config).eval())
    drafter = dflash_hf.DFlashDraftModel(dflash_hf.DFlashConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=1,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
        block_size=block_size, num_target_layers=layers, dflash_config={"mask_token_id": vocab - 1},
    )).eval()
    return target, drafter


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    target, drafter = build(args.hidden, args.layers, args.vocab, args.block_size)
    prompt = torch.randint(0, args.vocab - 1, (1, args.prompt_length), generator=torch.Generator().manual_seed(0))

    snapshot_seconds = []
    original_snapshot = rollback.RollbackCache.snapshot

    def timed_snapshot(self):
        start = time.perf_counter()
        original_snapshot(self)
        snapshot_seconds.append(time.perf_counter() - start)

    rollback.RollbackCache.snapshot = timed_snapshot
    try:
        target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=drafter)  # warm-up
        snapshot_seconds.clear()
        start = time.perf_counter()
        expected = target.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
        plain_seconds = time.perf_counter() - start
        start = time.perf_counter()
        output = target.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=drafter)
        dflash_seconds = time.perf_counter() - start
    finally:
        rollback.RollbackCache.snapshot = original_snapshot
    assert torch.equal(output, expected)

    stats = drafter.last_stats
    steps = len(stats.acceptance_lengths)
    verify = stats.verify_seconds / stats.num_target_forwards
    result = {
        "config": vars(args),
        "steps": steps,
        "replay_forwards": stats.replay_forwards,
        "snapshot_ms": 1e3 * sum(snapshot_seconds) / len(snapshot_seconds),
        "verify_forward_ms": 1e3 * verify,
        "replay_forward_ms": 1e3 * stats.replay_seconds / max(stats.replay_forwards, 1),
        "plain_generate_ms_per_token": 1e3 * plain_seconds / args.max_new_tokens,
        "dflash_ms_per_token": 1e3 * dflash_seconds / args.max_new_tokens,
    }
    result["rollback_over_verify"] = (result["snapshot_ms"] + result["replay_forward_ms"]) / result["verify_forward_ms"]
    for key, value in result.items():
        if key != "config":
            print(f"{key:30} {value:.3f}" if isinstance(value, float) else f"{key:30} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
