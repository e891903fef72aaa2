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
