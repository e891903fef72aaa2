"""`dflash_hf.packed`: linears on oneDNN-packed weights compute what `F.linear` computes, on every path (packed,
and the eager fallback where the ops are missing or gradients are needed), and a packed target decodes plain and
DFlash alike with greedy output equal to the unpacked target's."""

import pytest
import torch
import torch.nn.functional as F

import dflash_hf
from dflash_hf import packed
from dflash_hf.packed import PackedLinear, is_packed, pack_linears, unpack_linears
from test_hybrid import hybrid_target
from tiny import MASK_ID, TARGETS, OracleDrafter, drafter

needs_ops = pytest.mark.skipif(not packed.packed_ops_available(), reason="this torch has no oneDNN packed linears")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@needs_ops
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows", (1, 3, 8, 17))
def test_packed_linear_computes_f_linear(dtype, rows):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 160, bias=rows % 2 == 1).to(dtype)
    layer = PackedLinear.from_linear(linear, rows=8)
    x = torch.randn(2, rows, 96).to(dtype)  # (batch, tokens, features): the shape a decoder layer passes
    expected = F.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == dtype and out.shape == (2, rows, 160)
    assert not torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype] * 10, rtol=TOLERANCE[dtype])
    assert layer._packed is not None  # the packed op ran, not the fallback


@needs_ops
def test_the_packed_copy_follows_the_weight():
    linear = torch.nn.Linear(32, 48, bias=False)
    layer = PackedLinear.from_linear(linear)
    x = torch.randn(4, 32)
    with torch.no_grad():
        layer(x)
        linear.weight.mul_(-2.0)  # in place, as an optimizer step: the same storage, a new version
        torch.testing.assert_close(layer(x), F.linear(x, linear.weight), atol=1e-5, rtol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn(48, 32))  # replaced, as `.to()` does
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


def test_without_the_private_ops_or_with_gradients_a_packed_linear_is_f_linear(monkeypatch):
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48)
    layer = PackedLinear.from_linear(linear)
    x = torch.randn(5, 32, requires_grad=True)
    # training needs gradients, which the packed op has no formula for: the eager path, exactly
    out = layer(x)
    assert torch.equal(out, F.linear(x, linear.weight, linear.bias))
    out.sum().backward()
    assert linear.weight.grad is not None and x.grad is not None
    # a torch release without the ops: eager, and packing nothing
    monkeypatch.setattr(packed, "packed_ops_available", lambda: False)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, linear.weight, linear.bias))
    assert layer._packed is None


def test_pack_and_unpack_keep_the_parameters_and_their_ties():
    target = TARGETS["llama"](seed=0)
    target.config.tie_word_embeddings = True
    target.tie_weights()
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    linears = sum(type(module) is torch.nn.Linear for module in target.modules())
    pack_linears(target)
    assert is_packed(target) and sum(isinstance(m, PackedLinear) for m in target.modules()) == linears
    if packed.packed_ops_available():  # packed now, once: one more copy of every linear weight (the tied head's too)
        weights = sum(m.weight.nbytes for m in target.modules() if isinstance(m, PackedLinear))
        assert weights <= packed.packed_bytes(target) <= 1.25 * weights  # (a blocked layout may pad)
    assert target.get_output_embeddings().weight is target.get_input_embeddings().weight  # still tied
    after = target.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)
    unpack_linears(target)
    assert not is_packed(target) and sum(type(m) is torch.nn.Linear for m in target.modules()) == linears
    assert target.get_output_embeddings().weight is target.get_input_embeddings().weight
    with pytest.raises(TypeError, match="nn.Module"):
        pack_linears("Qwen/Qwen3-8B")


@pytest.mark.parametrize("ops", (True, False), ids=("packed", "eager-fallback"))
@pytest.mark.parametrize("family", ("qwen3", "llama", "gemma4", "qwen3.5-hybrid"))
def test_a_packed_target_decodes_as_the_unpacked_one(monkeypatch, family, ops):
    """Every family, sliding windows (Gemma-4) and linear-attention layers (the hybrid) included: their linears
    pack; attention, convolutions and recurrent states stay eager."""
    if ops and not packed.packed_ops_available():
        pytest.skip("this torch has no oneDNN packed linears")
    if not ops:
        monkeypatch.setattr(packed, "packed_ops_available", lambda: False)
    prompt = torch.randint(0, MASK_ID, (1, 12), generator=torch.Generator().manual_seed(1))
    target = dflash_hf.enable(hybrid_target(0) if family == "qwen3.5-hybrid" else TARGETS[family](seed=0))
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
    oracle = drafter(0, cls=OracleDrafter).arm(expected, target.get_output_embeddings(), wrong_every=3)
    cut = drafter(1)
    cut.config.dflash_config["draft_vocab"] = list(range(0, MASK_ID, 2))  # its rows of the lm_head are packed too
    pack_linears(target)  # the drafters follow their packed target on their own
    widths = []
    forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: widths.append(self.out_features) or forward(self, x))
    with torch.inference_mode():
        assert torch.equal(target.generate(prompt, max_new_tokens=24, do_sample=False), expected)
        for model in (oracle, cut):
            dflash = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=model)
            assert torch.equal(dflash, expected), type(model).__name__
    assert oracle.last_stats.num_target_forwards < 16  # drafts were verified, several tokens a forward
    assert is_packed(oracle) and is_packed(cut)
    assert len(cut.config.draft_vocab) in widths  # the drafter's head ran packed (on its draft vocabulary)


def test_a_packed_target_compiles_on_a_static_cache():
    """Inside a torch.compile graph a packed linear computes F.linear (inductor cannot lower the packed op on a
    weight it did not pack): compiled decoding of a packed target equals its eager decoding."""
    from transformers import CompileConfig

    target = pack_linears(TARGETS["llama"](seed=0))
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True  # transformers' switch for compiling decoding on a CPU
    prompt = torch.randint(0, MASK_ID, (1, 10), generator=torch.Generator().manual_seed(2))
    expected = target.generate(prompt, max_new_tokens=8, do_sample=False)
    compiled = target.generate(prompt, max_new_tokens=8, do_sample=False, cache_implementation="static",
                               compile_config=config)
    assert torch.equal(compiled, expected)
