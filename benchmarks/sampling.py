"""Acceptance under `do_sample=True`: the three proposals of DFlashCandidateGenerator side by side.

- argmax: the drafter's most likely token, verified by rejection sampling (q one-hot)
- sample: a draw from the drafter's q, verified by rejection sampling
- match:  the reference rule (argmax drafts kept only where equal to an independent target sample)

Same prompts, same seeds, same drafter for each. By default a synthetic pair built in-process: a
tiny Qwen3 target with peaked distributions and an oracle drafter whose block logits are the
target's own logits along the target's greedy continuation of the current sequence, scaled by
`--logit-scale` (1: the target's conditionals given the greedy prefix, which is what a perfectly
trained DFlash drafter predicts, since it never sees the tokens sampled inside the block). Pass
--target and --drafter (Hub ids or folders) to measure a real pair instead.

    python benchmarks/sampling.py --json sampling.json
"""

import argparse
import json
import sys
from pathlib import Path

import torch

import dflash_hf
from dflash_hf.generation.candidate_generator import DFlashCandidateGenerator

from dflash_hf.generation import api

PROPOSALS = ("argmax", "sample", "match")


class GreedyPathOracle(DFlashCandidateGenerator):
    """Drafts from the target itself: slot k gets the target's logits after the greedy path."""

    logit_scale = 1.0
    target = None  # the model being decoded (set by the benchmark)

    def _draft_block(self, input_ids, model_kwargs):
        out = self.target.generate(input_ids, do_sample=False, max_new_tokens=self.block_size - 1,
                                   output_logits=True, return_dict_in_generate=True)
        logits = torch.stack(out.logits, dim=1) * self.logit_scale  # (1, B-1, V)
        weight = self.main_model_output_embeddings.weight.detach().float()  # square here (vocab == hidden)
        hidden = logits @ torch.linalg.pinv(weight).T
        return torch.cat([hidden[:, :1], hidden], dim=1)  # slot 0 (the anchor) is never read


def synthetic_pair(logit_scale: float, block_size: int):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny import drafter, qwen3_target

    target = qwen3_target(seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(12.0)
    return target, drafter(0, block_size=block_size)


def measure(target, drafter, prompts, temperature, max_new_tokens, seeds) -> dict:
    results = {}
    for proposal in PROPOSALS:
        dflash_hf.enable(target, proposal=proposal)
        lengths, drafted, accepted = [], 0, 0
        for prompt in prompts:
            for seed in seeds:
                torch.manual_seed(seed)
                stats = target.generate(prompt, do_sample=True, temperature=temperature, max_new_tokens=max_new_tokens,
                                        assistant_model=drafter, return_dict_in_generate=True).dflash_stats
                lengths += stats.acceptance_lengths
                drafted += stats.drafted_tokens
                accepted += stats.accepted_tokens
        results[proposal] = {"tau": sum(lengths) / len(lengths), "acceptance_rate": accepted / drafted,
                             "target_forwards": len(lengths)}
    dflash_hf.enable(target)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--logit-scale", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)

    rows = []
    if args.target:
        from transformers import AutoModelForCausalLM

        target = dflash_hf.enable(AutoModelForCausalLM.from_pretrained(args.target).eval())
        drafter = dflash_hf.DFlashDraftModel.from_pretrained(args.drafter).eval()
        vocab = target.config.get_text_config().vocab_size
        prompts = [torch.randint(0, vocab, (1, 16), generator=generator) for _ in range(args.prompts)]
        pairs = [("real", target, drafter, None)]
    else:
        pairs = []
        for scale in args.logit_scale:
            target, drafter = synthetic_pair(scale, args.block_size)
            pairs.append((f"oracle, logit scale {scale:g}", target, drafter, scale))
        prompts = [torch.randint(0, 60, (1, 8), generator=generator) for _ in range(args.prompts)]
    seeds = range(args.seeds)
    for name, target, drafter, scale in pairs:
        GreedyPathOracle.logit_scale, GreedyPathOracle.target = scale, target
        for temperature in args.temperatures:
            if name == "real":
                result = measure(target, drafter, prompts, temperature, args.max_new_tokens, seeds)
            else:
                # the synthetic oracle replaces the drafter's forward inside the candidate generator
                original, api.DFlashCandidateGenerator = api.DFlashCandidateGenerator, GreedyPathOracle
                try:
                    result = measure(target, drafter, prompts, temperature, args.max_new_tokens, seeds)
                finally:
                    api.DFlashCandidateGenerator = original
            rows.append({"pair": name, "temperature": temperature, **{p: result[p] for p in PROPOSALS}})

    print(f"{'pair':24} {'T':>4} " + " ".join(f"{p + ' tau':>11} {p + ' acc':>11}" for p in PROPOSALS))
    for row in rows:
        cells = " ".join(f"{row[p]['tau']:11.2f} {row[p]['acceptance_rate']:11.2f}" for p in PROPOSALS)
        print(f"{row['pair']:24} {row['temperature']:4.1f} {cells}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
