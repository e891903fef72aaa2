"""The committed-token distribution of DFlash sampling, computed exactly through the real decoding path.

Every random draw of a `generate` call goes through two places: `torch.multinomial` (the drafts, plain
steps, the "match" rule) and `rejection_verify` (accept tests and the residual sample). `Enumerator` replaces
both by choices read from a tape and weighted by their probabilities: a draw from `probs` takes each
outcome of nonzero probability in turn; a rejection test takes each (accepted count, next token) outcome
with its probability under rejection sampling, computed here independently (accept draft j with
min(1, p/q), then draw from max(p - q, 0), or from p after the last draft), and the real
`rejection_verify` is then run on uniform and exponential draws that produce exactly that outcome (its
result is checked). Replaying `generate` over every tape (depth first) gives the probability of every
sequence of first tokens, which must equal plain sampling's to 1e-6.

This catches any decision of a step (how many drafts to verify, a copy or the block) that reads a drawn
draft: such a rule changes the distribution by far more than 1e-6, where chi-square tests need thousands of
samples to see a bias of 0.05.
"""

import math

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, SuppressTokensLogitsProcessor

import dflash_hf
from dflash_hf.generation import candidate_generator, decoding, policy, verify
from tiny import BatchOracleDrafter, OracleDrafter, drafter, qwen3_target

TOLERANCE = 1e-6


class Enumerator:
    """Drives a function over every sequence of random outcomes; `weight` is the current run's probability."""

    def __init__(self):
        self.tape: list[int] = []

    def choose(self, weights: list[float]) -> int:
        if self.position == len(self.tape):
            self.tape.append(0)
        index = self.tape[self.position]
        self.arities.append(len(weights))
        self.position += 1
        self.weight *= weights[index]
        return index

    def run(self, function) -> dict:
        """{result: probability} over all outcomes; `function()` must be deterministic given its draws."""
        results: dict = {}
        while True:
            self.position, self.arities, self.weight = 0, [], 1.0
            result = function()
            assert self.position == len(self.tape), "a replay drew less than the tape it followed"
            results[result] = results.get(result, 0.0) + self.weight
            # the next tape: the deepest choice that has an untried outcome, advanced; everything after it dropped
            while self.tape and self.tape[-1] + 1 == self.arities[len(self.tape) - 1]:
                self.tape.pop()
            if not self.tape:
                return results
            self.tape[-1] += 1

    def multinomial(self, probs, num_samples=1, replacement=False, *, generator=None, out=None):
        assert num_samples == 1 and out is None
        rows = probs.reshape(-1, probs.shape[-1]).double()
        chosen = []
        for row in rows:
            support = torch.nonzero(row > 0)[:, 0]
            weights = (row[support] / row.sum()).tolist()
            chosen.append(int(support[self.choose(weights)]))
        return torch.tensor(chosen, device=probs.device).view(*probs.shape[:-1], 1)

    def rejection_verify(self, real):
        """A stand-in for `rejection_verify` that enumerates its outcomes, then checks the real rule gives each."""

        def enumerated(draft_ids, draft_probs, target_probs, uniform, exponential):
            batch, k = draft_ids.shape
            uniform, exponential = torch.full_like(uniform, 0.5), torch.full_like(exponential, 1e30)
            expected = []
            for row in range(batch):
                p, q, d = target_probs[row].double(), draft_probs[row].double(), draft_ids[row]
                accept = [min(1.0, float(p[j, d[j]] / q[j, d[j]])) if q[j, d[j]] > 0 else 0.0 for j in range(k)]
                # P(exactly m drafts accepted), m = 0..k
                chances = [math.prod(accept[:m]) * (1.0 - accept[m] if m < k else 1.0) for m in range(k + 1)]
                support = [m for m in range(k + 1) if chances[m] > 0]
                m = support[self.choose([chances[i] for i in support])]
                residual = (p[m] - q[m]).clamp_min(0) if m < k else p[k]
                if residual.sum() <= 0:
                    residual = p[m]
                tokens = torch.nonzero(residual > 0)[:, 0]
                token = int(tokens[self.choose((residual[tokens] / residual.sum()).tolist())])
                # draws that give this outcome: u_j inside [0, accept_j) for the accepted drafts, inside
                # [accept_m, 1) for the rejected one; the exponential race won by `token`
                for j in range(m):
                    uniform[row, j] = accept[j] / 2
                if m < k:
                    uniform[row, m] = (1.0 + accept[m]) / 2
                exponential[row, token] = 1.0
                expected.append((m, token))
            accepted, next_token = real(draft_ids, draft_probs, target_probs, uniform, exponential)
            assert list(zip(accepted.tolist(), next_token.tolist())) == expected, "the rule is not rejection sampling"
            return accepted, next_token

        return enumerated


class StopAfter(StoppingCriteria):
    """Ends the call once `length` tokens are in the sequence: only the first ones are enumerated."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


class FixedCosts(policy.StepCosts):
    """Step costs at their prior shape whatever the timings: replays take the same decisions."""

    def observe(self, num_drafts, seconds):
        pass


class Clock:
    """A `time` module whose clock advances by one second per reading: the default policy's learnt costs (a
    drafted step costs what a plain one does) are the same in every replay."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1.0
        return self.now


def trusted_policy(max_drafts, costs=None):
    """The adaptive verify length, its cut trusting the drafter's probabilities from the first step on, with
    costs (fixed, in place of the hardware's `costs`) under which a draft of confidence below ~0.45 after one of 0.79 is left out."""
    adaptive = policy.AdaptiveVerifyLength(max_drafts, FixedCosts(max_drafts, draft=0.2, per_draft=0.3))
    adaptive.observe(adaptive.cut([1.0]), 1)
    return adaptive


class Uncut(policy.AdaptiveVerifyLength):
    """The adaptive verify length without the cut by the drafter's probabilities."""

    def cut(self, confidences):
        return len(confidences)


def uncut_policy(max_drafts, costs=None):
    return Uncut(max_drafts, FixedCosts(max_drafts))


def failing_copies(max_copy, drafts=None):
    """Copy statistics that have seen copies fail: copies are passed over, and verified only when they agree."""
    copies = policy.CopyPolicy(max_copy, drafts)
    for _ in range(4):
        copies.stats.observe(max_copy, 0)
    return copies


@torch.no_grad()
def plain_distribution(target, prompt, num_tokens, processors=None) -> dict:
    """{first `num_tokens` tokens: probability} of plain sampling from `target`, by enumerating every prefix."""
    vocab = target.config.vocab_size
    joint, ids = torch.ones(1, dtype=torch.float64), prompt
    for _ in range(num_tokens):
        logits = target(ids).logits[:, -1].float()
        if processors is not None:
            logits = processors(ids, logits)
        joint = (joint[:, None] * logits.softmax(-1).double()).reshape(-1)
        ids = torch.cat([ids.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(ids.shape[0])[:, None]], 1)
    return {tuple(int(t) for t in seq): float(w) for seq, w in zip(ids[:, prompt.shape[1]:], joint)}


def assert_same_distribution(actual: dict, expected: dict):
    assert abs(sum(actual.values()) - 1.0) < TOLERANCE, sum(actual.values())
    worst = max(expected, key=lambda seq: abs(actual.get(seq, 0.0) - expected[seq]))
    assert abs(actual.get(worst, 0.0) - expected[worst]) < TOLERANCE, (
        f"P{worst}: DFlash {actual.get(worst, 0.0):.6f}, plain sampling {expected[worst]:.6f}")


VOCAB = 3
PROMPT = torch.tensor([[1, 2, 0, 2, 1, 0, 1, 2]])  # every bigram recurs: copies are found at every step
SCALES = {"sure": {}, "unsure": {2: 1.1}, "flat": {2: 0.3}}  # the oracle's logit scale of block slot 2 (1: 2.0)

# (verify length, lookup, policy factories, the oracle's second slot): each way a step decides what it verifies
MODES = {
    "fixed": (None, None, {}, "sure"),
    "fixed-copies": (None, 2, {}, "sure"),
    # q(mode) 0.79 at slot 1 and 0.6 at slot 2: a cut by the drawn draft's probability verifies slot 2 only
    # when its draft is the mode (a biased rule), one by the slot's top probability always
    "adaptive-cut": ("adaptive", None, {"AdaptiveVerifyLength": trusted_policy}, "unsure"),
    # slot 2 of top probability 0.4: always cut
    "adaptive-cut-flat": ("adaptive", None, {"AdaptiveVerifyLength": trusted_policy}, "flat"),
    "adaptive-copies": ("adaptive", 2, {"AdaptiveVerifyLength": trusted_policy}, "unsure"),
    # copies passed over, verified after all where they agree with the drafter's first slot
    "agreeing-copy": ("adaptive", 2, {"AdaptiveVerifyLength": uncut_policy, "CopyPolicy": failing_copies}, "sure"),
}


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    model = qwen3_target(seed=5, vocab_size=VOCAB, num_hidden_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # distributions far from uniform, but no token of probability ~0
    return model


def oracle(target, block_size, second_slot, vocab=VOCAB, prompt=PROMPT):
    script = target.generate(prompt, do_sample=False, max_new_tokens=block_size + 4)
    layers = target.config.num_hidden_layers
    model = drafter(0, cls=OracleDrafter, block_size=block_size, vocab_size=vocab, num_target_layers=layers,
                    dflash_config={"mask_token_id": 0, "target_layer_ids": [0, layers - 1]})
    model.logit_scale, model.slot_scales = 2.0, SCALES[second_slot]
    return model.arm(script, target.get_output_embeddings())


def dflash_distribution(target, assistant, enumerator, num_tokens, prompt=PROMPT, **kwargs) -> tuple[dict, list]:
    """The distribution of the first `num_tokens` tokens, and the statistics of every replay."""
    stop = StoppingCriteriaList([StopAfter(prompt.shape[1] + num_tokens)])
    stats = []

    def call():
        out = target.generate(prompt, do_sample=True, max_new_tokens=num_tokens + 4, assistant_model=assistant,
                              stopping_criteria=stop, return_dict_in_generate=True, **kwargs)
        stats.append(out.dflash_stats)
        return tuple(out.sequences[0, prompt.shape[1]:].tolist())

    return enumerator.run(call), stats


@pytest.fixture
def enumerator(monkeypatch):
    torch.set_num_threads(1)  # hundreds of tiny forwards: threads cost more than they give
    enumerator = Enumerator()
    monkeypatch.setattr(torch, "multinomial", enumerator.multinomial)
    monkeypatch.setattr(verify, "rejection_verify", enumerator.rejection_verify(verify.rejection_verify))
    return enumerator


@pytest.mark.parametrize("proposal", ("sample", "argmax", "match"))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_first_three_tokens_are_exactly_plain_sampling(target, enumerator, monkeypatch, mode, proposal):
    verify_length, lookup, factories, second_slot = MODES[mode]
    for name, factory in factories.items():
        monkeypatch.setattr(candidate_generator, name, factory)
    monkeypatch.setattr(policy.StepCosts, "observe", FixedCosts.observe)  # copies' costs too
    dflash_hf.enable(target, proposal=proposal, verify_length=verify_length, lookup=lookup)
    assistant = oracle(target, block_size=3, second_slot=second_slot)
    actual, stats = dflash_distribution(target, assistant, enumerator, num_tokens=3)
    assert_same_distribution(actual, plain_distribution(target, PROMPT, 3))
    # what the mode is there to test happened in some replay
    assert any(s.accepted_tokens > 0 for s in stats)
    copied = any(s.copied_steps for s in stats)
    assert copied == (lookup is not None)
    if mode == "agreeing-copy":
        assert any(s.verify_lengths[0] == 2 and not s.copied_steps for s in stats)  # the block, where they disagree
    if mode == "adaptive-cut-flat":
        assert all(s.verify_lengths[0] == 1 for s in stats)


@pytest.mark.parametrize("proposal", ("sample", "argmax", "match"))
def test_defaults_over_two_drafted_steps_are_exactly_plain_sampling(enumerator, monkeypatch, proposal):
    """The default settings (adaptive verify length, its cut, copies, the agreeing copy), whose second drafted
    step decides from what the first one measured: three tokens over a vocabulary of two."""
    monkeypatch.setattr(decoding, "time", Clock())
    model = qwen3_target(seed=2, vocab_size=2, num_hidden_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    dflash_hf.enable(model, proposal=proposal)
    prompt = PROMPT % 2
    assistant = oracle(model, block_size=3, second_slot="unsure", vocab=2, prompt=prompt)
    actual, stats = dflash_distribution(model, assistant, enumerator, num_tokens=3, prompt=prompt)
    assert_same_distribution(actual, plain_distribution(model, prompt, 3))
    assert any(len(s.verify_lengths) >= 2 and s.verify_lengths[1] > 0 for s in stats)  # a second drafted step


@pytest.mark.parametrize("suppressed", (False, True), ids=("draft-vocab", "draft-vocab-all-suppressed"))
@pytest.mark.parametrize("proposal", ("sample", "argmax"))
def test_a_draft_vocabulary_keeps_sampling_exact(target, enumerator, monkeypatch, proposal, suppressed):
    """Drafts from tokens 0 and 2 only (token 1 cannot be drafted: q sits on the others); with both suppressed the
    processors forbid every draft token and q falls back to uniform."""
    monkeypatch.setattr(policy.StepCosts, "observe", FixedCosts.observe)
    dflash_hf.enable(target, proposal=proposal, verify_length=None, lookup=None)
    assistant = oracle(target, block_size=3, second_slot="unsure")
    assistant.config.dflash_config["draft_vocab"] = [0, 2]
    kwargs = {"suppress_tokens": [0, 2]} if suppressed else {}
    actual, stats = dflash_distribution(target, assistant, enumerator, num_tokens=3, **kwargs)
    processors = LogitsProcessorList([SuppressTokensLogitsProcessor([0, 2])]) if suppressed else None
    assert_same_distribution(actual, plain_distribution(target, PROMPT, 3, processors))
    assert suppressed or any(s.accepted_tokens > 0 for s in stats)


@pytest.mark.parametrize("proposal", ("sample", "argmax"))
def test_a_ragged_batch_is_exactly_plain_sampling_row_by_row(enumerator, proposal):
    """Two left-padded rows of different lengths, four tokens each (three with drafts drawn from q) over a
    vocabulary of two: every outcome of every
    draw enumerated, the batch's joint distribution must be the product of each row's plain sampling alone. Rows
    accept different numbers of drafts in one step (ragged acceptance, the holes of generation/batched.py), which
    some replays check; the rejection rule is run on the batch's rows at once."""
    model = qwen3_target(seed=2, vocab_size=2, num_hidden_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    dflash_hf.enable(model, proposal=proposal, verify_length=None, lookup=None)
    prompts = [PROMPT[:, :8] % 2, PROMPT[:, 3:8] % 2]
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, 8 - prompt.shape[1] :], mask[row, 8 - prompt.shape[1] :] = prompt[0], 1
    layers = model.config.num_hidden_layers
    assistant = drafter(0, cls=BatchOracleDrafter, block_size=3, vocab_size=2, num_target_layers=layers,
                        dflash_config={"mask_token_id": 0, "target_layer_ids": [0, layers - 1]})
    assistant.logit_scale = 1.0  # q spread over both tokens, leaning to each row's greedy continuation
    assistant.arm([model.generate(prompt, do_sample=False, max_new_tokens=8)[0] for prompt in prompts], model)
    num_tokens, stats = {"argmax": 4, "sample": 3}[proposal], []  # (drafts drawn too: 10x the replays a token)

    def call():
        out = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=num_tokens,
                             assistant_model=assistant, return_dict_in_generate=True)
        stats.append(out.dflash_stats)
        return tuple(tuple(row) for row in out.sequences[:, ids.shape[1]:].tolist())

    actual = enumerator.run(call)
    alone = [plain_distribution(model, prompt, num_tokens) for prompt in prompts]
    expected = {(a, b): pa * pb for a, pa in alone[0].items() for b, pb in alone[1].items()}
    assert_same_distribution(actual, expected)
    assert any(s.rows[0].acceptance_lengths[0] != s.rows[1].acceptance_lengths[0] for s in stats)  # ragged
    assert any(s.rows[0].acceptance_lengths[0] == num_tokens - 1 for s in stats)  # every draft of a step accepted
