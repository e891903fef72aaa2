"""do_sample=True with DFlash keeps the target's exact distribution (speculative rejection sampling).

Every statistical test has a fixed seed and rejects at p < 1e-4, so the suite's false-failure
rate stays below 1e-3; each is paired with a deliberately broken rule that it must reject.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    LogitsProcessorList,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import dflash_hf
from dflash_hf.generation import candidate_generator, decoding
from dflash_hf.generation.decoding import rejection_verify, sampling_noise
from tiny import OracleDrafter, drafter, qwen3_target

ALPHA = 1e-4


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square over the categories expected at least 5 times, the rest pooled."""
    observed, expected = observed.double().flatten(), expected_probs.double().flatten() * observed.sum()
    big = expected >= 5
    assert big.sum() >= 2, "too few samples for a chi-square test"
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy() * obs[keep].sum().item() / exp[keep].sum().item()).pvalue)


# --- the verification function alone -------------------------------------------------------------

VOCAB, DRAFTS, SAMPLES = 8, 3, 200_000  # block of 4: 3 drafts + the target's token


def _synthetic(seed, one_hot_q):
    generator = torch.Generator().manual_seed(seed)
    p = torch.distributions.Dirichlet(torch.full((VOCAB,), 0.7)).sample((DRAFTS + 1,))
    q = torch.distributions.Dirichlet(torch.full((VOCAB,), 0.7)).sample((DRAFTS,))
    # every sample draws its own drafts from q, as a drafter would
    draft_ids = torch.multinomial(q, SAMPLES, replacement=True, generator=generator).T
    if one_hot_q:  # the "argmax" proposal of a drafter that agrees with the target's mode
        draft_ids = p[:DRAFTS].argmax(-1).expand(SAMPLES, DRAFTS)
        q = torch.nn.functional.one_hot(draft_ids[0], VOCAB).float()
    return p, q, draft_ids, generator


def _committed_token_counts(p, q, draft_ids, generator, verify):
    uniform, exponential = sampling_noise(SAMPLES, DRAFTS, VOCAB, generator=generator)
    accepted, next_token = verify(draft_ids, q.expand(SAMPLES, -1, -1), p.expand(SAMPLES, -1, -1),
                                  uniform, exponential)
    committed = torch.cat([draft_ids, torch.zeros(SAMPLES, 1, dtype=torch.long)], dim=1)
    committed[torch.arange(SAMPLES), accepted] = next_token
    # p is position-wise (prefix-independent), so committed token j, wherever it exists, follows p_j
    return [torch.bincount(committed[accepted >= j, j], minlength=VOCAB) for j in range(DRAFTS + 1)]


def always_accept(draft_ids, draft_probs, target_probs, uniform, exponential):
    accepted = torch.full((draft_ids.shape[0],), draft_ids.shape[1])
    return accepted, (target_probs[:, -1] / exponential).argmax(-1)


@pytest.mark.parametrize("one_hot_q", (False, True), ids=("sampled-q", "argmax-q"))
@pytest.mark.parametrize("seed", (0, 1))
def test_rejection_verify_commits_target_distribution(seed, one_hot_q):
    p, q, draft_ids, generator = _synthetic(seed, one_hot_q)
    counts = _committed_token_counts(p, q, draft_ids, generator, rejection_verify)
    for j, observed in enumerate(counts):
        assert chi_square_pvalue(observed, p[j]) > ALPHA, f"position {j}"
    assert counts[DRAFTS].sum() > 1000  # all drafts accepted often enough to test the bonus token


@pytest.mark.parametrize("one_hot_q", (False, True), ids=("sampled-q", "argmax-q"))
def test_distribution_check_rejects_a_broken_rule(one_hot_q):
    p, q, draft_ids, generator = _synthetic(0, one_hot_q)
    counts = _committed_token_counts(p, q, draft_ids, generator, always_accept)
    assert min(chi_square_pvalue(observed, p[j]) for j, observed in enumerate(counts)) < ALPHA


def test_rejection_verify_edge_cases():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]]])
    q = torch.tensor([[[0.5, 0.5, 0.0]]])
    uniform, exponential = torch.tensor([[0.999]]), torch.ones(1, 3)
    # p(d) >= q(d) is always accepted; the bonus then comes from p at the last position
    assert rejection_verify(torch.tensor([[1]]), q, p, uniform, exponential)[0].item() == 1
    # p(d) = 0 is always rejected, and the residual max(p - q, 0) cannot give d back
    accepted, token = rejection_verify(torch.tensor([[0]]), q, p, torch.tensor([[0.0]]), exponential)
    assert accepted.item() == 0 and token.item() == 1


# --- end to end through generate() --------------------------------------------------------------

E2E_VOCAB, E2E_SAMPLES = 16, 1500
PROMPT = torch.tensor([[3, 1, 4, 1, 5]])
SETTINGS = {
    "t1.0": dict(temperature=1.0),
    "t0.7-top_p0.9": dict(temperature=0.7, top_p=0.9),
    "top_k5": dict(temperature=1.0, top_k=5),
}


def _processors(temperature=1.0, top_p=None, top_k=None):
    # the warpers generate() builds for these settings, in its order
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k is not None:
        processors.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        processors.append(TopPLogitsWarper(top_p))
    return processors


@pytest.fixture(scope="module")
def sampling_target():
    target = qwen3_target(seed=3, vocab_size=E2E_VOCAB)
    with torch.no_grad():
        target.lm_head.weight.mul_(12.0)  # peakier distributions: drafts get accepted often
    return dflash_hf.enable(target, verify_length=None)


@torch.no_grad()
def exact_first_three(target, processors, prompt=PROMPT) -> torch.Tensor:
    """P(t1, t2, t3) of plain sampling, by enumerating every prefix: (V, V, V)."""
    joint = torch.ones(())
    ids = prompt
    for _ in range(3):
        logits = target(ids).logits[:, -1].float()
        probs = processors(ids, logits).softmax(-1)  # (V**n, V)
        joint = (joint.reshape(-1, 1) * probs).reshape(-1)
        ids = torch.cat([ids.repeat_interleave(E2E_VOCAB, 0), torch.arange(E2E_VOCAB).repeat(ids.shape[0])[:, None]], 1)
    return joint.reshape(E2E_VOCAB, E2E_VOCAB, E2E_VOCAB)


def sample_first_three(target, assistant, settings, seed=0, samples=E2E_SAMPLES, prompt=PROMPT, max_new_tokens=3):
    """Counts of (t1, t2, t3) over `samples` DFlash generations, and the drafts accepted in total."""
    torch.manual_seed(seed)
    counts, accepted = torch.zeros(E2E_VOCAB**3), 0
    for _ in range(samples):
        out = target.generate(prompt, do_sample=True, max_new_tokens=max_new_tokens, assistant_model=assistant, **settings)
        a, b, c = out[0, prompt.shape[1] : prompt.shape[1] + 3].tolist()
        counts[(a * E2E_VOCAB + b) * E2E_VOCAB + c] += 1
        accepted += assistant.last_stats.accepted_tokens
    return counts, accepted


def _oracle(target, block_size=4):
    script = target.generate(PROMPT, do_sample=False, max_new_tokens=8)
    return drafter(0, cls=OracleDrafter, block_size=block_size, vocab_size=E2E_VOCAB,
                   dflash_config={"mask_token_id": 0, "target_layer_ids": [1, 3]}).arm(
        script, target.get_output_embeddings())


# "match" (the reference rule, kept for comparison) runs with -m slow
PROPOSAL_PARAMS = ("sample", "argmax", pytest.param("match", marks=pytest.mark.slow))


@pytest.mark.parametrize("proposal", PROPOSAL_PARAMS)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_first_three_tokens_follow_plain_sampling(sampling_target, setting, proposal):
    dflash_hf.enable(sampling_target, proposal=proposal, verify_length=None)
    oracle = _oracle(sampling_target)
    expected = exact_first_three(sampling_target, _processors(**SETTINGS[setting]))
    observed, accepted = sample_first_three(sampling_target, oracle, SETTINGS[setting])
    assert chi_square_pvalue(observed, expected) > ALPHA
    assert accepted > E2E_SAMPLES // 10  # the drafter's tokens are really being accepted


@pytest.mark.parametrize("proposal", ["sample", "argmax"])
def test_copies_from_the_context_keep_sampling_exact(sampling_target, proposal):
    """A prompt whose last two tokens recur in it: the copied continuation is verified as a
    deterministic proposal (q one-hot), and the tokens still follow plain sampling."""
    prompt = torch.tensor([[1, 5, 2, 7, 1, 3, 4, 6, 1, 5]])
    settings = {"temperature": 1.0, "prompt_lookup_num_tokens": 3}
    dflash_hf.enable(sampling_target, proposal=proposal, verify_length=None)
    useless = drafter(0, vocab_size=E2E_VOCAB, dflash_config={"mask_token_id": 0, "target_layer_ids": [1, 3]})
    expected = exact_first_three(sampling_target, _processors(temperature=1.0), prompt)
    observed, accepted = sample_first_three(sampling_target, useless, settings, prompt=prompt)
    assert chi_square_pvalue(observed, expected) > ALPHA
    assert useless.last_stats.copied_steps > 0 and accepted > 0


@pytest.mark.parametrize("proposal", ["sample", "argmax"])
def test_a_draft_vocabulary_keeps_sampling_exact(sampling_target, proposal, monkeypatch):
    """Drafts from the even tokens only (the oracle's odd tokens cannot be drafted: its q then sits on other
    tokens); with the even tokens suppressed, processors forbid every draft token and q falls back to uniform.
    Either way the committed tokens follow plain sampling."""
    drafted = []
    propose = candidate_generator.DFlashCandidateGenerator._propose

    def spy(self, input_ids, logits):
        drafts, scores = propose(self, input_ids, logits)
        drafted.extend(drafts[0].tolist())
        return drafts, scores

    monkeypatch.setattr(candidate_generator.DFlashCandidateGenerator, "_propose", spy)
    dflash_hf.enable(sampling_target, proposal=proposal, verify_length=None)
    oracle = _oracle(sampling_target)
    even = list(range(0, E2E_VOCAB, 2))
    oracle.config.dflash_config["draft_vocab"] = even
    expected = exact_first_three(sampling_target, _processors())
    observed, accepted = sample_first_three(sampling_target, oracle, {"temperature": 1.0})
    assert chi_square_pvalue(observed, expected) > ALPHA
    assert accepted > E2E_SAMPLES // 20 and drafted and all(t % 2 == 0 for t in drafted)

    suppressed = LogitsProcessorList([SuppressTokensLogitsProcessor(even), *_processors()])
    expected = exact_first_three(sampling_target, suppressed)
    observed, _ = sample_first_three(sampling_target, oracle, {"temperature": 1.0, "suppress_tokens": even})
    assert chi_square_pvalue(observed, expected) > ALPHA


@pytest.mark.parametrize("proposal", ["sample", "argmax"])
def test_drafts_cut_by_their_own_probability_keep_sampling_exact(sampling_target, proposal, monkeypatch):
    """The adaptive verify length leaves out drafts the drafter itself finds unlikely: its second draft is the
    oracle's token with q 0.57, any other with q 0.03, and verifying a draft costs 0.3 plain steps, so whether it
    is verified depends on the token drawn ("sample") and on how often such drafts were accepted before (both).
    The committed tokens still follow plain sampling."""
    from dflash_hf.generation.policy import AdaptiveVerifyLength, StepCosts

    class Costs(StepCosts):  # a drafted step 1.2 + 0.3 per draft, whatever the timings say
        def observe(self, num_drafts, seconds):
            pass

    cuts = []

    class Recorded(AdaptiveVerifyLength):
        def cut(self, confidences):
            cuts.append((len(confidences), super().cut(confidences)))
            return cuts[-1][1]

    def policy(max_drafts):  # its probabilities trusted from the first step (one right draft of probability 1)
        recorded = Recorded(max_drafts, Costs(max_drafts, draft=0.2, per_draft=0.3))
        recorded.observe(recorded.cut([1.0]), 1)
        return recorded

    monkeypatch.setattr(candidate_generator, "AdaptiveVerifyLength", policy)
    dflash_hf.enable(sampling_target, proposal=proposal, lookup=None)
    oracle = _oracle(sampling_target)
    oracle.slot_scales = {2: 3.0}
    expected = exact_first_three(sampling_target, _processors())
    observed, accepted = sample_first_three(sampling_target, oracle, {"temperature": 1.0}, max_new_tokens=5)
    assert chi_square_pvalue(observed, expected) > ALPHA
    cut = {n < length for length, n in cuts}
    assert accepted > E2E_SAMPLES // 10 and cut == {True, False}


def test_end_to_end_check_rejects_always_accept(sampling_target, monkeypatch):
    def accept_everything(draft_ids, draft_probs, target_probs, uniform, exponential):
        bonus = torch.multinomial(target_probs[:, -1], 1)[:, 0]
        return torch.full_like(bonus, draft_ids.shape[1]), bonus

    monkeypatch.setattr(decoding, "rejection_verify", accept_everything)
    dflash_hf.enable(sampling_target, proposal="argmax", verify_length=None)
    expected = exact_first_three(sampling_target, _processors(temperature=1.0))
    observed, _ = sample_first_three(sampling_target, _oracle(sampling_target), {"temperature": 1.0}, samples=300)
    assert chi_square_pvalue(observed, expected) < ALPHA


def test_same_seed_same_output(sampling_target):
    dflash_hf.enable(sampling_target, proposal="sample", verify_length=None)
    oracle = _oracle(sampling_target, block_size=8)
    outputs = []
    for _ in range(2):
        torch.manual_seed(1234)
        outputs.append(sampling_target.generate(PROMPT, do_sample=True, max_new_tokens=20, assistant_model=oracle))
    assert torch.equal(*outputs)
    dflash_hf.enable(sampling_target, proposal="argmax", verify_length=None)


def test_sampling_stats_report_acceptance_rate(sampling_target):
    dflash_hf.enable(sampling_target, proposal="argmax", verify_length=None)
    oracle = _oracle(sampling_target, block_size=8)
    torch.manual_seed(0)
    sampling_target.generate(PROMPT, do_sample=True, temperature=0.3, max_new_tokens=20, assistant_model=oracle)
    stats = oracle.last_stats
    assert 0 < stats.acceptance_rate <= 1
    assert stats.acceptance_rate == stats.accepted_tokens / stats.drafted_tokens
