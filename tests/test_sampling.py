"""do_sample=True with DFlash keeps the target's exact distribution (speculative rejection sampling).

Every statistical test has a fixed seed and rejects at p < 1e-4, so the suite's false-failure
rate stays below 1e-3; each is paired with a deliberately broken rule that it must reject.
"""

import numpy as np
import pytest
import torch
from scipy.stats import binom, chisquare
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import dflash_hf
from dflash_hf.generation import verify
from dflash_hf.generation.verify import rejection_verify, sampling_noise
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
    # an exponential draw of exactly 0 (exponential_ returns one now and then) on a token of residual 0: not taken
    accepted, token = rejection_verify(torch.tensor([[0]]), q, p, torch.tensor([[0.0]]), torch.tensor([[0.0, 1.0, 0.0]]))
    assert accepted.item() == 0 and token.item() == 1


# --- end to end through generate(), at the default settings ------------------------------------
# tests/test_exact_sampling.py computes the committed distribution exactly for every proposal, verify length
# and copy rule; these sample real calls at the defaults instead, on a prompt that repeats (copies verified).

E2E_VOCAB, E2E_SAMPLES = 4, 2500
PROMPT = torch.tensor([[1, 3, 2, 0, 1, 3, 2, 0, 1, 3]])  # repeats: copies are found and verified
SETTINGS = {
    "t1.0": dict(temperature=1.0),
    "t0.7-top_p0.9": dict(temperature=0.7, top_p=0.9),
    "top_k3": dict(temperature=1.0, top_k=3),
}


def cell_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """The smallest two-sided binomial p-value over the cells, Bonferroni-corrected: unlike one chi-square over
    many cells, it sees a bias confined to one cell. With 2,500 samples a cell of probability p <= 0.5 that is
    off by 0.05 is z >= 0.05 / sqrt(0.25 / 2500) = 5 standard deviations away (p < 1e-6, below ALPHA / 64)."""
    n = int(observed.sum())
    k, p = observed.double().flatten().numpy(), expected_probs.double().flatten().numpy()
    two_sided = 2 * np.minimum(binom.cdf(k, n, p), binom.sf(k - 1, n, p))
    return float(min(1.0, two_sided.min() * len(k)))


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
    target = qwen3_target(seed=3, vocab_size=E2E_VOCAB, num_hidden_layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)  # peakier distributions: drafts and copies get accepted often
    return target


@torch.no_grad()
def exact_first_three(target, processors, prompt=PROMPT) -> torch.Tensor:
    """P(t1, t2, t3) of plain sampling, by enumerating every prefix: (V, V, V)."""
    vocab = target.config.vocab_size
    joint = torch.ones(())
    ids = prompt
    for _ in range(3):
        logits = target(ids).logits[:, -1].float()
        probs = processors(ids, logits).softmax(-1)  # (V**n, V)
        joint = (joint.reshape(-1, 1) * probs).reshape(-1)
        ids = torch.cat([ids.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(ids.shape[0])[:, None]], 1)
    return joint.reshape(vocab, vocab, vocab)


def sample_first_three(target, assistant, settings, seed=0, samples=E2E_SAMPLES, prompt=PROMPT, max_new_tokens=5):
    """Counts of (t1, t2, t3) over `samples` DFlash generations, and the calls' summed statistics."""
    torch.manual_seed(seed)
    vocab = target.config.vocab_size
    counts, accepted, copied = torch.zeros(vocab**3), 0, 0
    for _ in range(samples):
        out = target.generate(prompt, do_sample=True, max_new_tokens=max_new_tokens, assistant_model=assistant,
                              return_dict_in_generate=True, **settings)
        a, b, c = out.sequences[0, prompt.shape[1] : prompt.shape[1] + 3].tolist()
        counts[(a * vocab + b) * vocab + c] += 1
        accepted += out.dflash_stats.accepted_tokens
        copied += out.dflash_stats.copied_steps
    return counts, accepted, copied


def _oracle(target, block_size=4, prompt=PROMPT):
    script = target.generate(prompt, do_sample=False, max_new_tokens=12)
    return drafter(0, cls=OracleDrafter, block_size=block_size, vocab_size=target.config.vocab_size,
                   num_target_layers=2, dflash_config={"mask_token_id": 0, "target_layer_ids": [0, 1]}).arm(
        script, target.get_output_embeddings())


CASES = [("sample", "t1.0"), ("sample", "t0.7-top_p0.9"), ("argmax", "top_k3"),
         pytest.param("match", "t1.0", marks=pytest.mark.slow)]


@pytest.mark.parametrize("proposal,setting", CASES)
def test_defaults_follow_plain_sampling(sampling_target, proposal, setting):
    """The default settings (adaptive verify length with its cut, copies from the context, the agreeing copy)."""
    dflash_hf.enable(sampling_target, proposal=proposal)
    expected = exact_first_three(sampling_target, _processors(**SETTINGS[setting]))
    observed, accepted, copied = sample_first_three(sampling_target, _oracle(sampling_target), SETTINGS[setting])
    assert cell_pvalue(observed, expected) > ALPHA
    assert chi_square_pvalue(observed, expected) > ALPHA
    assert accepted > E2E_SAMPLES // 2 and copied > E2E_SAMPLES // 10, (accepted, copied)  # drafts and copies accepted


def test_cell_check_sees_a_bias_of_005_in_one_cell(sampling_target):
    """The power the sample count is chosen for: 0.05 of probability moved into one cell from all the others."""
    expected = exact_first_three(sampling_target, _processors(temperature=1.0)).flatten()
    cell = expected.argmax()
    biased = expected * 0.95 + 0.05 * torch.nn.functional.one_hot(cell, len(expected))
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        observed = torch.bincount(torch.multinomial(biased, E2E_SAMPLES, True, generator=generator), minlength=len(biased))
        assert cell_pvalue(observed, expected) < ALPHA
    unbiased = torch.bincount(torch.multinomial(expected, E2E_SAMPLES, True, generator=generator), minlength=len(biased))
    assert cell_pvalue(unbiased, expected) > ALPHA


def test_end_to_end_check_rejects_always_accept(sampling_target, monkeypatch):
    def accept_everything(draft_ids, draft_probs, target_probs, uniform, exponential):
        bonus = torch.multinomial(target_probs[:, -1], 1)[:, 0]
        return torch.full_like(bonus, draft_ids.shape[1]), bonus

    monkeypatch.setattr(verify, "rejection_verify", accept_everything)
    dflash_hf.enable(sampling_target, proposal="sample")
    expected = exact_first_three(sampling_target, _processors(temperature=1.0))
    observed, _, _ = sample_first_three(sampling_target, _oracle(sampling_target), {"temperature": 1.0}, samples=500)
    assert cell_pvalue(observed, expected) < ALPHA


def test_same_seed_same_output(sampling_target):
    dflash_hf.enable(sampling_target, proposal="sample", verify_length=None)
    oracle = _oracle(sampling_target, block_size=8)
    outputs = []
    for _ in range(2):
        torch.manual_seed(1234)
        outputs.append(sampling_target.generate(PROMPT, do_sample=True, max_new_tokens=20, assistant_model=oracle))
    assert torch.equal(*outputs)
