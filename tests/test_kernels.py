"""The DFlash Triton kernel against its PyTorch reference, in Triton's CPU interpreter, or on a GPU
with `DFLASH_TEST_DEVICE=cuda TRITON_INTERPRET=0` (what scripts/device_check.sh runs).

TRITON_INTERPRET must be set before the kernel module is imported (`@triton.jit` reads it when it
decorates), so it is set here at collection time and restored when this module's tests finish.
"""

import os

DEVICE = os.environ.get("DFLASH_TEST_DEVICE", "cpu")
_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install --no-deps triton); kernel tests need it")

import tiny  # noqa: E402

import dflash_hf  # noqa: E402
from dflash_hf.kernels import block_attention_reference, load_kernels, use_dflash_attention  # noqa: E402
from dflash_hf.kernels.loader import clear_cache  # noqa: E402

# Tolerances of the attention kernel against the fp32 reference, per input dtype, in one place.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


@pytest.fixture(scope="module", autouse=True)
def _restore_interpret():
    yield
    if _PREVIOUS_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET


@pytest.fixture(scope="module")
def kernels():
    clear_cache()
    module = load_kernels(backend="triton")  # raises, rather than skips, if the repo cannot load
    yield module
    clear_cache()


def _attention_inputs(batch, heads, kv_heads, block, context, head_dim, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    kv_len = context + block

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    # q arrives transposed from [b, Lq, H, D], as DFlashAttention hands it over (non-contiguous).
    q = randn(batch, block, heads, head_dim).transpose(1, 2)
    return q, randn(batch, kv_heads, kv_len, head_dim), randn(batch, kv_heads, kv_len, head_dim)


# (batch, heads, kv_heads, block, context, head_dim, sliding_window, num_splits): GQA 1/2/4/8,
# blocks 2..16, contexts 0 and odd, windows shorter and longer than the block, KV splits.
ATTENTION_CASES = [
    (1, 4, 4, 2, 0, 16, None, None),
    (2, 4, 2, 4, 7, 16, None, None),
    (1, 8, 2, 16, 33, 32, None, 3),
    (1, 8, 1, 8, 129, 64, None, 2),
    (2, 16, 2, 5, 61, 24, None, None),
    (1, 4, 4, 16, 0, 16, 5, None),
    (1, 8, 2, 3, 50, 16, 4, None),
    (1, 8, 8, 16, 19, 32, 24, 2),
    (2, 8, 1, 7, 100, 16, 64, 3),
    (1, 4, 1, 16, 64, 128, 40, None),
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda case: "b{}-h{}-kv{}-q{}-ctx{}-d{}-w{}-s{}".format(*case))
def test_block_attention_matches_reference(kernels, case):
    *shape, window, splits = case
    q, k, v = _attention_inputs(*shape, seed=sum(case[:6]))
    scale = shape[-1] ** -0.5
    out = kernels.block_attention(q, k, v, scale, window, num_splits=splits)
    expected = block_attention_reference(q, k, v, scale, window)
    assert out.shape == expected.shape == (shape[0], shape[3], shape[1], shape[5])
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 6])
def test_block_attention_half_precision(kernels, dtype, window):
    q, k, v = _attention_inputs(1, 8, 2, 8, 45, 32, dtype=dtype, seed=3)
    out = kernels.block_attention(q, k, v, 32**-0.5, window, num_splits=2)
    assert out.dtype == dtype
    torch.testing.assert_close(out, block_attention_reference(q, k, v, 32**-0.5, window), **TOLERANCES[dtype])


def test_block_attention_is_deterministic(kernels):
    q, k, v = _attention_inputs(1, 8, 2, 16, 77, 32, seed=5)
    first = kernels.block_attention(q, k, v, 0.2, 30, num_splits=3)
    assert torch.equal(first, kernels.block_attention(q, k, v, 0.2, 30, num_splits=3))


def test_block_attention_dispatch_uses_kernel(kernels):
    from dflash_hf.kernels import block_attention

    q, k, v = _attention_inputs(1, 4, 2, 4, 9, 16, seed=7)
    torch.testing.assert_close(
        block_attention(q, k, v, 0.25, backend="triton"), block_attention(q, k, v, 0.25, backend="torch"),
        **TOLERANCES[torch.float32],
    )


def _bad_attention_inputs():
    q, k, v = _attention_inputs(1, 4, 2, 4, 3, 16)
    return {
        "3d query": (q[0], k, v, 0.25, None),
        "k/v shapes differ": (q, k, v[:, :, :-1], 0.25, None),
        "heads not a multiple": (q[:, :3], k, v, 0.25, None),
        "head_dim differs": (q[..., :8], k, v, 0.25, None),
        "block longer than keys": (q, k[:, :, :2], v[:, :, :2], 0.25, None),
        "mixed dtypes": (q.half(), k, v, 0.25, None),
        "integer tensors": (q.long(), k.long(), v.long(), 0.25, None),
        "zero window": (q, k, v, 0.25, 0),
        "negative scale": (q, k, v, -1.0, None),
    }


@pytest.mark.parametrize("name", list(_bad_attention_inputs()))
def test_block_attention_rejects_bad_inputs(kernels, name):
    args = _bad_attention_inputs()[name]
    with pytest.raises(ValueError):
        kernels.block_attention(*args)
    with pytest.raises(ValueError):
        block_attention_reference(*args)


def _drafter_inputs(drafter, context, seed=0):
    generator = torch.Generator().manual_seed(seed)
    block = drafter.config.block_size
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    return dict(
        noise_embeds=torch.randn(1, block, drafter.config.hidden_size, generator=generator).to(DEVICE),
        context_hidden_states=torch.randn(1, context, width, generator=generator).to(DEVICE),
        position_ids=torch.arange(context + block, device=DEVICE)[None],
    )


def test_drafter_forward_with_kernel_attention_matches_sdpa(kernels):
    drafter = tiny.drafter(block_size=8).to(DEVICE)
    inputs = _drafter_inputs(drafter, context=13)
    with torch.no_grad():
        expected = drafter(**inputs).last_hidden_state
        use_dflash_attention(drafter, backend="triton")
        assert drafter.config._attn_implementation == "diffusion_block"
        out = drafter(**inputs).last_hidden_state
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_generate_with_kernel_attention_equals_plain_generate(kernels):
    target = dflash_hf.enable(tiny.qwen3_target().to(DEVICE), verify_length=None)
    prompt = torch.randint(0, tiny.VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    expected = target.generate(prompt, max_new_tokens=8, do_sample=False)

    sdpa_drafter = tiny.drafter().to(DEVICE)
    sdpa_out = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=sdpa_drafter)
    kernel_drafter = use_dflash_attention(tiny.drafter().to(DEVICE), backend="triton")
    kernel_out = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=kernel_drafter)

    assert torch.equal(kernel_out, expected) and torch.equal(sdpa_out, expected)
    # Same drafts as with sdpa attention, not just the same (lossless) output.
    assert kernel_drafter.last_stats.acceptance_lengths == sdpa_drafter.last_stats.acceptance_lengths


@pytest.mark.slow
def test_generate_with_kernel_attention_on_sliding_layers(kernels):
    target = dflash_hf.enable(tiny.qwen3_target().to(DEVICE), verify_length=None)
    prompt = torch.randint(0, tiny.VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    config = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    drafter = use_dflash_attention(tiny.drafter(**config).to(DEVICE), backend="triton")
    assert torch.equal(target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter), expected)


# --- The verification kernel: a block's acceptance in one launch, against the accept rules it replaces.

from dflash_hf.generation import verify as accept_rules  # noqa: E402

# (batch, drafts, vocab): one tile and several (the kernel tiles the vocabulary by 1024), no drafts, long blocks
VERIFY_CASES = [(1, 7, 100), (3, 15, 2500), (2, 0, 50), (4, 3, 1030), (2, 31, 300)]


def _verify_inputs(batch, k, vocab, seed, agree=0.7):
    """Target scores, drafts that mostly equal their argmax (so acceptance runs deep), and the drafter's scores."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=generator) * 3
    drafts = torch.where(torch.rand(batch, k, generator=generator) < agree, target[:, :-1].argmax(-1),
                         torch.randint(0, vocab, (batch, k), generator=generator))
    draft_scores = target[:, :-1] + torch.randn(batch, k, vocab, generator=generator)
    return drafts.to(DEVICE), target.to(DEVICE), draft_scores.to(DEVICE), generator


@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda case: "b{}-k{}-v{}".format(*case))
def test_greedy_verify_kernel_matches_reference(kernels, case):
    for seed in range(3):
        drafts, target, _, _ = _verify_inputs(*case, seed)
        accepted, next_token = kernels.greedy_verify(drafts, target)
        expected_accepted, expected_next = accept_rules.greedy_verify(drafts, target)
        assert torch.equal(accepted, expected_accepted) and torch.equal(next_token, expected_next)


def test_greedy_verify_kernel_breaks_ties_as_torch_argmax(kernels):
    # Every score equal but a few: the argmax is the first index of the maximum, also across vocabulary tiles.
    target = torch.zeros(2, 3, 2100, device=DEVICE)
    target[0, :, [5, 1500]] = 1.0
    target[1, :, [1030, 2099]] = 1.0
    target[1, 1] = 0.0  # slot 1 of row 1: all tied, index 0
    drafts = torch.tensor([[5, 1500], [1030, 0]], device=DEVICE)
    accepted, next_token = kernels.greedy_verify(drafts, target)
    assert accepted.tolist() == [1, 2] and next_token.tolist() == [5, 1030]
    assert (accepted.tolist(), next_token.tolist()) == tuple(t.tolist() for t in accept_rules.greedy_verify(drafts, target))


@pytest.mark.parametrize("case", [c for c in VERIFY_CASES if c[1] > 0], ids=lambda case: "b{}-k{}-v{}".format(*case))
def test_rejection_verify_kernel_matches_reference(kernels, case):
    """Same drafts, scores and random draws: the kernel accepts as many drafts and samples the same token, so it
    is exact wherever the reference is (tests/test_exact_sampling.py)."""
    batch, k, vocab = case
    accepted_counts = set()
    for seed in range(6):
        drafts, target, draft_scores, generator = _verify_inputs(*case, seed)
        uniform, exponential = (t.to(DEVICE) for t in accept_rules.sampling_noise(batch, k, vocab, generator=generator))
        got = kernels.rejection_verify(drafts, draft_scores, target, uniform, exponential)
        expected = accept_rules.rejection_verify(drafts, draft_scores.softmax(-1), target.softmax(-1), uniform, exponential)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        accepted_counts.update(got[0].tolist())
    assert len(accepted_counts) > 1  # the cases reach more than one branch (a rejection, or all accepted)


def test_rejection_verify_kernel_with_one_hot_drafts_and_top_k_target(kernels):
    """An argmax proposal or a copy (q one-hot: -inf off the draft) against a top-k target (-inf off its top k):
    a draft outside the target's top k is never accepted, and the residual is p itself off the draft."""
    batch, k, vocab = 3, 5, 1200
    drafts, target, _, generator = _verify_inputs(batch, k, vocab, seed=4, agree=0.5)
    top = target.topk(4, dim=-1).indices
    target = torch.full_like(target, float("-inf")).scatter(-1, top, target.gather(-1, top))
    # Row 0 drafts the target's favourite at slot 0 in the second vocabulary tile: q's first tile is all -inf.
    target[0, 0, 1100] = 30.0
    drafts[0, 0] = 1100
    one_hot = torch.full((batch, k, vocab), float("-inf"), device=DEVICE).scatter(-1, drafts[..., None], 0.0)
    for seed in range(8):
        uniform, exponential = (t.to(DEVICE) for t in accept_rules.sampling_noise(batch, k, vocab,
                                                                                 generator=torch.Generator().manual_seed(seed)))
        got = kernels.rejection_verify(drafts, one_hot, target, uniform, exponential)
        expected = accept_rules.rejection_verify(drafts, one_hot.softmax(-1), target.softmax(-1), uniform, exponential)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert bool(target.gather(-1, got[1][:, None, None].expand(-1, k + 1, 1)).isfinite().any())
        assert got[0][0] >= 1  # p(1100) ~ 1: accepted


def _assert_rejection_agrees(kernels, drafts, draft_scores, target, uniform, exponential):
    """The kernel and the reference, given the same draws, accept as many drafts and take the same token."""
    got = kernels.rejection_verify(drafts, draft_scores, target, uniform, exponential)
    expected = accept_rules.rejection_verify(drafts, draft_scores.softmax(-1), target.softmax(-1), uniform, exponential)
    assert (got[0].tolist(), got[1].tolist()) == (expected[0].tolist(), expected[1].tolist())
    return got


def test_rejection_verify_with_exponential_draws_of_zero(kernels):
    """`exponential_` returns an exact 0 now and then: a token whose residual is 0 (outside the target's top 4, or the
    rejected draft) must not win the race through 0 / 0 = NaN, in the kernel or in the reference."""
    batch, k, vocab = 3, 2, 1500
    drafts, target, draft_scores, generator = _verify_inputs(batch, k, vocab, seed=7)
    top = target.topk(4, dim=-1).indices
    target = torch.full_like(target, float("-inf")).scatter(-1, top, target.gather(-1, top))
    drafts[:, 0] = target[:, 0].argmin(-1)  # a first draft of p 0: rejected, the residual at slot 0 decides
    uniform = torch.full((batch, k), 0.5, device=DEVICE)
    exponential = torch.ones(batch, vocab, device=DEVICE)
    exponential[:, ::3] = 0.0  # zeros on tokens of residual 0, in both vocabulary tiles
    exponential[0, top[0, 0, 0]] = 0.0  # and on one of positive residual: row 0's race is won by a zero draw
    accepted, next_token = _assert_rejection_agrees(kernels, drafts, draft_scores, target, uniform, exponential)
    assert accepted.tolist() == [0, 0, 0]
    residual = (target[:, 0].softmax(-1) - draft_scores[:, 0].softmax(-1)).clamp_min(0)
    assert bool((residual.gather(1, next_token[:, None]) > 0).all()), next_token
    assert exponential[0, next_token[0]] == 0.0


def test_rejection_verify_breaks_ties_in_the_race_as_the_reference(kernels):
    """Equal residuals and equal draws: the race is a tie, won by the first index, also across vocabulary tiles."""
    vocab = 2100
    target = torch.full((2, 2, vocab), float("-inf"), device=DEVICE)
    target[0, 0, [7, 900, 1500]] = 0.0  # row 0: a tie inside the first tile
    target[1, 0, [1100, 2000]] = 0.0  # row 1: inside the second
    target[:, 1] = 0.0
    drafts = torch.tensor([[3], [5]], device=DEVICE)  # q one-hot at a token of p 0: rejected, residual = p
    one_hot = torch.full((2, 1, vocab), float("-inf"), device=DEVICE).scatter(-1, drafts[..., None], 0.0)
    uniform, exponential = torch.zeros(2, 1, device=DEVICE), torch.ones(2, vocab, device=DEVICE)
    accepted, next_token = _assert_rejection_agrees(kernels, drafts, one_hot, target, uniform, exponential)
    assert accepted.tolist() == [0, 0] and next_token.tolist() == [7, 1100]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_verify_kernels_with_non_finite_scores_agree_with_the_reference(kernels, value):
    """NaN and infinite target scores (a broken model, an overflow): the kernels rank them as `torch.argmax` does
    (NaN above everything, the first of them winning), so kernel and reference still commit the same tokens."""
    batch, k, vocab = 3, 3, 1100
    for seed in range(3):
        drafts, target, draft_scores, generator = _verify_inputs(batch, k, vocab, seed)
        target[0, 1, [40, 1050]] = float(value)  # row 0, slot 1, both tiles
        target[1, 0, 1090] = float(value)  # row 1, slot 0, the second tile only
        target[2, :, :] = float(value) if seed == 2 else target[2]  # a whole row of them
        greedy = kernels.greedy_verify(drafts, target)
        expected = accept_rules.greedy_verify(drafts, target)
        assert (greedy[0].tolist(), greedy[1].tolist()) == (expected[0].tolist(), expected[1].tolist())
        uniform, exponential = (t.to(DEVICE) for t in accept_rules.sampling_noise(batch, k, vocab, generator=generator))
        _assert_rejection_agrees(kernels, drafts, draft_scores, target, uniform, exponential)


def test_verify_kernels_reject_mismatched_shapes(kernels):
    drafts, target, draft_scores, _ = _verify_inputs(2, 4, 64, seed=0)
    with pytest.raises(ValueError, match="do not cover"):
        kernels.greedy_verify(drafts, target[:, :-1])
    with pytest.raises(ValueError, match="uniform must be"):
        kernels.rejection_verify(drafts, draft_scores, target, torch.rand(2, 3, device=DEVICE), torch.ones(2, 64, device=DEVICE))


def test_sampling_generate_runs_the_verify_kernel_and_samples_as_the_reference(kernels, monkeypatch):
    """With DFLASH_KERNELS=triton (on an accelerator: by default) the decoding loop verifies through the kernel;
    with the same seed it commits exactly the tokens the PyTorch accept rules commit (same draws in, same tokens out)."""
    calls = []
    greedy, rejection = kernels.greedy_verify, kernels.rejection_verify
    monkeypatch.setattr(kernels, "greedy_verify", lambda *a: calls.append("greedy") or greedy(*a))
    monkeypatch.setattr(kernels, "rejection_verify", lambda *a: calls.append("rejection") or rejection(*a))
    target = dflash_hf.enable(tiny.qwen3_target().to(DEVICE))
    drafter = tiny.drafter(block_size=4).to(DEVICE)
    prompt = torch.randint(0, tiny.VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    runs = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("DFLASH_KERNELS", backend)
        torch.manual_seed(3)
        runs[backend] = target.generate(prompt, max_new_tokens=12, do_sample=True, top_k=20, assistant_model=drafter,
                                        dflash_verify_length=3)
        if backend == "triton":
            assert "rejection" in calls
            calls.clear()
    assert not calls  # DFLASH_KERNELS=torch: the reference
    assert torch.equal(runs["triton"], runs["torch"])
    monkeypatch.setenv("DFLASH_KERNELS", "triton")
    assert torch.equal(target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter),
                       target.generate(prompt, max_new_tokens=12, do_sample=False))
    assert "greedy" in calls
