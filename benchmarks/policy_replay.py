"""Replays the verify-length and copy policies on recorded answers: every method on the same tokens.

    HF_HUB_OFFLINE=1 python benchmarks/policy_replay.py record humaneval:16 humaneval-edit:16 prose:16 --out replay.json
    python benchmarks/policy_replay.py replay replay.json --costs bf16
    python benchmarks/policy_replay.py replay replay.json --alternatives   # two branches, oracle

Why: in bf16 a method that verifies several tokens per forward drifts from plain greedy at near-ties
and is then timed on other text, so a bench of 8-16 prompts cannot tell two policies apart by less
than ~10 %. `record` (the target and the shipped drafter, a few minutes on a CPU) writes, per prompt,
plain greedy's answer and, at every position of it, how many drafts of the drafter would be accepted
(one drafter forward over all positions under the training block mask, which is what decoding
computes) and the run transformers' prompt lookup would copy, with its accepted length. `replay`
(seconds, no model) runs `dflash_hf.generation.policy` on them under a cost model in plain-step
units and prints each method's speedup over plain decoding. Left out: the loop's own overhead, the
prefill, and any difference between the modelled and the real step costs.
"""

import argparse
import json

# Seconds of a target forward over n tokens in plain steps, SmolLM2-135M on 2 CPU cores, and of the drafter's
# forward. bf16: steps of the decoding loop itself by verify length (the step-6,300 drafter with its draft
# vocabulary, 6 prompts, 64 tokens, median of 2: a plain step 38 ms, 1 draft 1.23, 3 drafts 1.29, 7 drafts
# 1.42), less the drafter's 5 ms; 16 tokens from the table. fp32: the table.
COSTS = {
    "bf16": {"forward": {1: 1.0, 2: 1.10, 4: 1.16, 8: 1.29, 16: 1.45}, "draft": 0.13},
    "fp32": {"forward": {1: 1.0, 2: 1.61, 4: 1.61, 8: 1.62, 16: 1.98}, "draft": 0.21},
}
METHODS = ("plain", "lookup", "full block", "adaptive", "adaptive+lookup")
# `--alternatives`: other ways for the two proposals to meet, measured against the one shipped.
# "two branches": where the first draft and the copy disagree, both are verified in one forward (a tree
# attention mask; its cost is that of a forward over both); "oracle": each step the best of a plain step,
# any verify length and the copy, knowing what the target will accept (no policy can do better).
ALTERNATIVES = ("adaptive+lookup", "two branches", "oracle")


def forward_cost(table: dict, tokens: int) -> float:
    """Linear interpolation of the forward-cost table (extrapolated from its last two points)."""
    points = sorted((int(k), v) for k, v in table.items())
    for (n0, c0), (n1, c1) in zip(points, points[1:]):
        if tokens <= n1 or (n1, c1) == points[-1]:
            return c0 + (c1 - c0) * (tokens - n0) / (n1 - n0)
    return points[0][1]


def record(specs: list[str], out: str) -> None:
    import torch
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    from dflash_hf import embedded
    from dflash_hf.evaluation import encode_prompt, load_prompts
    from dflash_hf.generation.policy import matching_prefix
    from dflash_hf.training.data import target_layer_features
    from dflash_hf.training.objective import drafter_block_forward

    target, tokenizer = embedded.load_smollm2("bfloat16")
    drafter = embedded.load_drafter().to(torch.bfloat16)
    block, dflash = drafter.config.block_size, drafter.config.dflash_config
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    lookup = PromptLookupCandidateGenerator(eos_token_id=None, num_output_tokens=10, max_matching_ngram_size=2,
                                            max_length=1 << 30)
    recorded = {}
    for spec in specs:
        for item in load_prompts(spec):
            prompt = torch.tensor([encode_prompt(tokenizer, item["prompt"])])
            with torch.inference_mode():
                ids = target.generate(prompt, max_new_tokens=128, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.eos_token_id)[0]
                start, end = prompt.shape[1], ids.shape[0]
                # the block anchored at each committed token, its context the features of the tokens before it
                anchors = torch.arange(start, end - 1)[None]
                block_ids = torch.full((anchors.shape[1], block), dflash["mask_token_id"])
                block_ids[:, 0] = ids[start : end - 1]
                positions = (anchors[0, :, None] + torch.arange(block)).flatten()[None]
                features = target_layer_features(target, ids[None], None, dflash["target_layer_ids"])
                hidden = drafter_block_forward(drafter, embed(block_ids.flatten()[None]), features, anchors, positions)
                logits = head(hidden.view(-1, block, hidden.shape[-1])[:, 1:]).float()
                if drafter.config.draft_vocab:  # decoding drafts from these tokens only
                    vocab = torch.tensor(drafter.config.draft_vocab)
                    confidence, best = logits[..., vocab].softmax(-1).max(-1)
                    drafts = vocab[best].tolist()
                else:
                    confidence, drafts = logits.softmax(-1).max(-1)
                    drafts = drafts.tolist()
            text = ids.tolist()
            accepted_drafts, copies, accepted_copies = [], [], []
            for j, anchor in enumerate(range(start, end - 1)):
                truth = text[anchor + 1 :]
                accepted_drafts.append(matching_prefix(drafts[j], truth))
                copy = lookup.get_candidates(ids[None, : anchor + 1])[0][0, anchor + 1 :].tolist()
                copies.append(copy)
                accepted_copies.append(matching_prefix(copy, truth))
            # the drafts themselves too: a rule that compares them with the copy can be replayed from them
            recorded[item["id"]] = {"set": spec.split(":")[0], "start": start, "text": text, "drafts": drafts,
                                    "accepted_drafts": accepted_drafts, "copies": copies,
                                    "accepted_copies": accepted_copies,
                                    "draft_confidence": [[round(x, 4) for x in row] for row in confidence.tolist()]}
            print(item["id"], end - start, "tokens", flush=True)
    with open(out, "w") as file:
        json.dump(recorded, file)


def replay(answer: dict, method: str, costs: dict, max_drafts: int = 7) -> tuple[int, float]:
    """(tokens, cost in plain steps) of decoding `answer` with `method`; the policies are the package's."""
    from dflash_hf.generation.policy import AdaptiveVerifyLength, CopyPolicy, StepPlanner

    start, text = answer["start"], answer["text"]
    verify = lambda n: forward_cost(costs["forward"], n + 1)  # noqa: E731  (n proposed tokens + the anchor)
    policy = AdaptiveVerifyLength(max_drafts) if method.startswith("adaptive") or method == "two branches" else None
    copy_policy = CopyPolicy(10, policy) if method in ("adaptive+lookup", "two branches") else None
    planner = StepPlanner(max_drafts, policy, copy_policy)  # the decisions DFlashCandidateGenerator takes
    position, cost = start, 0.0  # position: the anchor, the last committed token
    while position < len(text) - 1:
        j = position - start
        drafts, copy = answer["accepted_drafts"][j], answer["copies"][j]
        plan = None
        if method == "plain":
            accepted, seconds = 0, verify(0)
        elif method == "lookup":
            accepted, seconds = (answer["accepted_copies"][j], verify(len(copy))) if copy else (0, verify(0))
        elif method == "full block":
            accepted, seconds = drafts, costs["draft"] + verify(max_drafts)
        elif method == "oracle":
            options = [(0, verify(0))] + [(min(drafts, n), costs["draft"] + verify(n)) for n in range(1, max_drafts + 1)]
            if copy:
                options.append((answer["accepted_copies"][j], verify(len(copy))))
            accepted, seconds = max(options, key=lambda option: (option[0] + 1) / option[1])
        else:  # the decisions of DFlashCandidateGenerator.propose, by the same StepPlanner
            # the room the generator leaves: the answer's end here
            plan = planner.before_draft(position + 1, len(text) - position - 1, copy if copy_policy is not None else None)
            ran_drafter = plan.copy is None and plan.num_drafts > 0
            if ran_drafter:  # the greedy first draft and the drafter's confidence per slot, as the CPU reads them
                confidences = answer["draft_confidence"][j] if "draft_confidence" in answer else None
                plan = planner.after_draft(plan, answer["drafts"][j][0], confidences)
            if method == "two branches" and plan.copy is None and copy_policy.passed_over \
                    and copy_policy.passed_over[-1][0] == position + 1:
                # the copy passed over at this step (its first token and the first draft disagree) is verified in the
                # same forward as the drafts, instead of being scored as passed over
                copy_policy.passed_over.pop()
                drafted, copied_run = min(drafts, plan.num_drafts), answer["accepted_copies"][j]
                accepted, seconds = max(drafted, copied_run), costs["draft"] + verify(plan.num_drafts + len(copy))
                copy_policy.stats.observe(len(copy), copied_run)
                policy.observe(plan.num_drafts, drafted, seconds)
                plan = None
            elif plan.copy is not None:
                accepted = answer["accepted_copies"][j]
                seconds = verify(len(copy)) + (costs["draft"] if ran_drafter else 0.0)
            else:
                accepted = min(drafts, plan.num_drafts)
                seconds = (costs["draft"] if plan.num_drafts else 0.0) + verify(plan.num_drafts)
        if plan is not None:
            planner.observe(plan, accepted, seconds, text[: position + accepted + 2])
        elif copy_policy is not None and copy_policy.passed_over:  # (two branches: the copies passed over before)
            copy_policy.score_passed_over(text[copy_policy.passed_over[0][0] : position + accepted + 2])
        cost += seconds
        position += accepted + 1
    return len(text) - start, cost


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="decode prompt sets with the target and record what each proposal would accept")
    rec.add_argument("prompts", nargs="+", help="prompt sets, e.g. humaneval:16 prose:16")
    rec.add_argument("--out", default="policy-replay.json")
    rep = sub.add_parser("replay", help="speedups over plain decoding of each method on the recorded answers")
    rep.add_argument("recorded")
    rep.add_argument("--costs", choices=sorted(COSTS), default="bf16")
    rep.add_argument("--alternatives", action="store_true", help=f"compare {', '.join(ALTERNATIVES)} instead")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.prompts, args.out)
        return
    with open(args.recorded) as file:
        answers = json.load(file)
    costs = COSTS[args.costs]
    sets = sorted({answer["set"] for answer in answers.values()})
    print(f"speedup over plain decoding, {args.costs} cost model, same text for every method")
    methods = ("plain", *ALTERNATIVES) if args.alternatives else METHODS
    print(f"{'prompts':22s}" + "".join(f"{m:>17s}" for m in methods))
    for name in sets:
        chosen = [a for a in answers.values() if a["set"] == name]
        rates = {}
        for method in methods:
            runs = [replay(answer, method, costs) for answer in chosen]
            rates[method] = sum(t for t, _ in runs) / sum(c for _, c in runs)
        print(f"{name + f' ({len(chosen)})':22s}" + "".join(f"{rates[m] / rates['plain']:>16.3f}x" for m in methods))


if __name__ == "__main__":
    main()
