"""The DFlash Triton kernels against their PyTorch references, in Triton's CPU interpreter.

TRITON_INTERPRET must be set before the kernel module is imported (`@triton.jit` reads it when it
decorates), so it is set here at collection time and restored when this module's tests finish.
"""

import os

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install --no-deps triton); kernel tests need it")

import tiny  # noqa: E402

import dflash_hf  # noqa: E402
from dflash_hf.generation.verification import sampling_noise  # noqa: E402
from dflash_hf.kernels import (  # noqa: E402
    block_attention_reference,
    greedy_verify_reference,
    load_kernels,
    rejection_verify_reference,
    use_dflash_attention,
)
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
        return torch.randn(*shape, generator=generator).to(dtype)

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


def _greedy_case(batch, k, vocab, seed, mismatch_at=None, ties=False):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=generator)
    if ties:  # two equal maxima per row: both paths must pick the lower index
        logits = logits.round(decimals=0)
    drafts = logits[:, :k].argmax(dim=-1)
    if mismatch_at is not None:
        drafts[:, mismatch_at] = (drafts[:, mismatch_at] + 1) % vocab
    return drafts, logits


GREEDY_CASES = {
    "all accepted": (2, 7, 300, 0, None, False),
    "first rejected": (1, 15, 1030, 1, 0, False),
    "middle rejected": (3, 5, 2049, 2, 3, False),
    "ties": (2, 6, 64, 3, None, True),
    "no drafts": (2, 0, 50, 4, None, False),
}


@pytest.mark.parametrize("name", list(GREEDY_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_verify_matches_reference(kernels, name, dtype):
    drafts, logits = _greedy_case(*GREEDY_CASES[name])
    logits = logits.to(dtype)
    accepted, next_token = kernels.greedy_verify(drafts, logits)
    expected_accepted, expected_next = greedy_verify_reference(drafts, logits)
    assert accepted.dtype == next_token.dtype == torch.long
    assert torch.equal(accepted, expected_accepted) and torch.equal(next_token, expected_next)


def _rejection_case(batch, k, vocab, seed, dtype=torch.float32, one_hot=False, equal=False):
    generator = torch.Generator().manual_seed(seed)
    p = (torch.randn(batch, k + 1, vocab, generator=generator) * 2).softmax(dim=-1).to(dtype)
    q = (torch.randn(batch, k, vocab, generator=generator) * 2).softmax(dim=-1).to(dtype)
    if equal:  # p == q: no residual anywhere, the next token comes from p
        q = p[:, :k].clone()
    drafts = torch.multinomial(q.float().reshape(-1, vocab), 1, generator=generator).reshape(batch, k)
    if one_hot:  # the candidate generator's argmax proposal
        q = torch.nn.functional.one_hot(drafts, vocab).to(dtype)
    uniform, exponential = sampling_noise(batch, k, vocab, generator=generator)
    return drafts, q, p, uniform, exponential


REJECTION_CASES = {
    "random": dict(batch=4, k=7, vocab=1500, seed=0),
    "long block": dict(batch=1, k=15, vocab=3000, seed=1),
    "one-hot q": dict(batch=3, k=5, vocab=700, seed=2, one_hot=True),
    "p equals q": dict(batch=2, k=4, vocab=300, seed=3, equal=True),
    "bfloat16": dict(batch=3, k=6, vocab=1100, seed=4, dtype=torch.bfloat16),
    "float16 one-hot": dict(batch=2, k=3, vocab=500, seed=5, dtype=torch.float16, one_hot=True),
    "no drafts": dict(batch=2, k=0, vocab=100, seed=6),
}


@pytest.mark.parametrize("name", list(REJECTION_CASES))
def test_rejection_verify_matches_reference_exactly(kernels, name):
    inputs = _rejection_case(**REJECTION_CASES[name])
    accepted, next_token = kernels.rejection_verify(*inputs)
    expected_accepted, expected_next = rejection_verify_reference(*inputs)
    assert torch.equal(accepted, expected_accepted) and torch.equal(next_token, expected_next)
    again = kernels.rejection_verify(*inputs)
    assert torch.equal(again[0], accepted) and torch.equal(again[1], next_token)


def test_rejection_verify_matches_over_many_draws(kernels):
    # Many independent draws in one batch: partial acceptances at every position occur.
    inputs = _rejection_case(batch=64, k=5, vocab=40, seed=7)
    accepted, next_token = kernels.rejection_verify(*inputs)
    expected_accepted, expected_next = rejection_verify_reference(*inputs)
    assert len(set(expected_accepted.tolist())) > 2
    assert torch.equal(accepted, expected_accepted) and torch.equal(next_token, expected_next)


def test_verification_rejects_bad_shapes(kernels):
    drafts, logits = _greedy_case(2, 4, 50, 0)
    with pytest.raises(ValueError):
        kernels.greedy_verify(drafts, logits[:, :4])
    with pytest.raises(ValueError):
        kernels.greedy_verify(drafts.int(), logits)
    drafts, q, p, uniform, exponential = _rejection_case(batch=2, k=4, vocab=50, seed=0)
    with pytest.raises(ValueError):
        kernels.rejection_verify(drafts, q[:, :3], p, uniform, exponential)
    with pytest.raises(ValueError):
        kernels.rejection_verify(drafts, q, p, uniform, exponential[:, :10])


def _drafter_inputs(drafter, context, seed=0):
    generator = torch.Generator().manual_seed(seed)
    block = drafter.config.block_size
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    return dict(
        block_embeds=torch.randn(1, block, drafter.config.hidden_size, generator=generator),
        target_hidden=torch.randn(1, context, width, generator=generator),
        position_ids=torch.arange(context + block)[None],
    )


def test_drafter_forward_with_kernel_attention_matches_sdpa(kernels):
    drafter = tiny.drafter(block_size=8)
    inputs = _drafter_inputs(drafter, context=13)
    with torch.no_grad():
        expected = drafter(**inputs).last_hidden_state
        use_dflash_attention(drafter, backend="triton")
        assert drafter.config._attn_implementation == "dflash_block"
        out = drafter(**inputs).last_hidden_state
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_generate_with_kernel_attention_equals_plain_generate(kernels):
    target = dflash_hf.enable(tiny.qwen3_target(), verify_length=None)
    prompt = torch.randint(0, tiny.VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(0))
    expected = target.generate(prompt, max_new_tokens=8, do_sample=False)

    sdpa_drafter = tiny.drafter()
    sdpa_out = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=sdpa_drafter)
    kernel_drafter = use_dflash_attention(tiny.drafter(), backend="triton")
    kernel_out = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=kernel_drafter)

    assert torch.equal(kernel_out, expected) and torch.equal(sdpa_out, expected)
    # Same drafts as with sdpa attention, not just the same (lossless) output.
    assert kernel_drafter.last_stats.acceptance_lengths == sdpa_drafter.last_stats.acceptance_lengths


@pytest.mark.slow
def test_generate_with_kernel_attention_on_sliding_layers(kernels):
    target = dflash_hf.enable(tiny.qwen3_target(), verify_length=None)
    prompt = torch.randint(0, tiny.VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(1))
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    config = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    drafter = use_dflash_attention(tiny.drafter(**config), backend="triton")
    assert torch.equal(target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter), expected)
