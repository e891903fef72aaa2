"""DFlash on a batch of prompts (generation/batched.py): every row's output is its own, greedy and sampled,
with rows of different lengths accepting different numbers of drafts and finishing at different steps."""

import pytest
import torch
from transformers import StoppingCriteriaList, pipeline
from transformers.generation.stopping_criteria import EosTokenCriteria
from transformers.generation.streamers import BaseStreamer

import dflash_hf
import tiny
from dflash_hf.generation.policy import StepCosts

NEW_TOKENS = 30


def _batch(lengths, seed=0):
    """Left-padded prompts of the given lengths (pad id 0) and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, n - length :] = torch.randint(1, tiny.VOCAB - 3, (length,), generator=generator)
        mask[row, n - length :] = 1
    return ids, mask


def _target(family):
    target = dflash_hf.enable({**tiny.TARGETS, **_sliding_targets()}[family]())
    target.generation_config.pad_token_id = 0
    return target


def _scripts(target, ids, mask, new_tokens):
    """Each row's greedy continuation generated alone, indexed by the row's own positions."""
    scripts = []
    for row in range(ids.shape[0]):
        prompt = ids[row : row + 1, int((mask[row] == 0).sum()) :]
        scripts.append(target.generate(prompt, max_new_tokens=new_tokens + 20, do_sample=False)[0])
    return scripts


def _plain_and_scripts(target, ids, mask, new_tokens=NEW_TOKENS):
    """Plain batched greedy output and each row's continuation alone, asserting the oracle's premise: the plain
    batched rows are the rows alone."""
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    scripts = _scripts(target, ids, mask, new_tokens)
    for row, script in enumerate(scripts):
        assert plain[row, ids.shape[1]:].tolist() == script[-new_tokens - 20 :][:new_tokens].tolist()
    return plain, scripts


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma4", "gemma4-kv-shared", "qwen3-window", "mistral"])
@pytest.mark.parametrize("lengths", [(9, 4), (5, 12, 8), (3, 9, 6, 11, 7, 10, 4, 8)])
def test_greedy_rows_equal_plain_batched_and_alone(family, lengths):
    """Also on sliding-window targets (windows of 5-8 tokens, 30 new tokens: every row's window slides past its
    prompt while ragged acceptance leaves holes; each row still sees exactly the window it sees alone)."""
    target = _target(family)
    ids, mask = _batch(lengths)
    plain, scripts = _plain_and_scripts(target, ids, mask)
    # row r drafts a wrong token at slot 1 + (step + r) % 8 on two steps of three: ragged acceptance, 0 to 7 drafts
    # (the whole block verified; the adaptive length is tested below)
    oracle = tiny.drafter(0, cls=tiny.BatchOracleDrafter, block_size=8).arm(
        scripts, target, wrong=lambda row, step: 1 + (step + row) % 8 if (step + row) % 3 else None)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                          assistant_model=oracle, return_dict_in_generate=True, dflash_verify_length=None)
    assert torch.equal(out.sequences, plain)
    lengths_seen = {n for row in out.dflash_stats.rows for n in row.acceptance_lengths}
    assert min(lengths_seen) <= 2 and max(lengths_seen) >= 6  # rows rejected early and accepted most of a block
    assert all(sum(row.acceptance_lengths) == NEW_TOKENS - 1 for row in out.dflash_stats.rows)  # + the prefill's
    random_drafter = tiny.drafter(1, block_size=4)
    assert torch.equal(target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                       assistant_model=random_drafter), plain)
    oracle.arm(scripts, target, wrong=lambda row, step: 1 + (step + row) % 8 if (step + row) % 3 else None)
    assert torch.equal(target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                       assistant_model=oracle), plain)  # the default: adaptive verify length


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_adaptive_verify_length_of_a_batch(family, monkeypatch):
    """The default verify length of a batch is one for all rows, from their pooled acceptance: a drafter whose
    drafts are all right keeps the whole block; one whose drafts are always wrong soon leaves the drafter out
    (plain steps, with a probe now and then). Either way every row is its own greedy output. The step costs stay
    at the hardware's prior (measured seconds of tiny forwards on a shared CPU made the lengths vary by a draft)."""
    monkeypatch.setattr(StepCosts, "observe", lambda self, num_drafts, seconds: None)
    target = _target(family)
    ids, mask = _batch((5, 12, 8, 3, 9, 6, 11, 7))
    new_tokens = NEW_TOKENS
    plain, scripts = _plain_and_scripts(target, ids, mask)
    for wrong, expect in ((lambda row, step: None, "whole blocks"), (lambda row, step: 1, "plain steps")):
        oracle = tiny.drafter(0, cls=tiny.BatchOracleDrafter, block_size=8).arm(scripts, target, wrong=wrong)
        with tiny.ForwardCounter(oracle) as drafted, tiny.ForwardCounter(target) as forwards:
            out = target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                  assistant_model=oracle, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain), expect
        if expect == "whole blocks":  # every step drafts; after the first (priced short: 8 rows) the whole block
            lengths = out.dflash_stats.rows[0].verify_lengths
            assert drafted.count >= forwards.count - 2 and forwards.count <= 7 and set(lengths[1:-1]) == {7}, lengths
        else:  # the first step drafts the whole block, then plain steps; at most a few probes
            assert forwards.count >= new_tokens - 3 and drafted.count <= 5, (forwards.count, drafted.count)


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma4"])
def test_rows_finish_at_their_own_eos(family):
    target = _target(family)
    ids, mask = _batch((6, 10, 8))
    free = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)[:, ids.shape[1]:]
    # an EOS id that row 0 generates early and the other rows later or never
    eos = free[0, 4].item()
    target.generation_config.eos_token_id = eos
    stops = [next((i for i, t in enumerate(row) if t == eos), None) for row in free.tolist()]
    assert len(set(stops)) > 1, stops
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    scripts = _scripts(target, ids, mask, NEW_TOKENS)
    oracle = tiny.drafter(0, cls=tiny.BatchOracleDrafter, block_size=8).arm(
        scripts, target, wrong=lambda row, step: 2 if step % 2 else None)
    with tiny.ForwardCounter(target) as forwards:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              assistant_model=oracle, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)  # the finished rows padded as plain generate pads them
    # each row's steps stop at its EOS: a finished row is not carried along
    steps = [len(row.acceptance_lengths) for row in out.dflash_stats.rows]
    assert forwards.count == 1 + max(steps) and min(steps) < max(steps)


def test_finished_rows_pad_with_the_first_eos_id():
    """Without a pad token the finished rows are padded with the first EOS id, as plain generate pads them (the EOS ids
    here come from an `EosTokenCriteria`, so the call's own fallback pads; it used to take whichever id a set gave)."""
    target = _target("qwen3")
    target.generation_config.pad_token_id = None
    ids, mask = _batch((6, 10, 8))
    free = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)[:, ids.shape[1]:]
    first = free[0, 4].item()  # row 0 stops early, the others later or never
    unused = set(range(tiny.VOCAB - 3)) - set(free.flatten().tolist())
    second = next(t for t in sorted(unused) if t % 8 < first % 8)  # a set of the two ids yields `second` first
    target.generation_config.eos_token_id = [first, second]
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert (plain[0, ids.shape[1] + 5 :] == first).all()  # plain generate pads with the first
    target.generation_config.eos_token_id = None
    actual = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             stopping_criteria=StoppingCriteriaList([EosTokenCriteria([first, second])]),
                             assistant_model=tiny.drafter(0, block_size=4))
    assert torch.equal(actual, plain)


def _pair_distance(target, ids, mask, runs, stats=None, **kwargs):
    """Per row, the total-variation distance between the empirical distribution of its first two sampled tokens
    (`runs` calls of three new tokens, seeds 0..runs-1) and the target's exact one (from its own forwards on the row
    alone); each call's `dflash_stats` appended to `stats` when given."""
    distances = []
    exact = []
    for row in range(ids.shape[0]):
        prompt = ids[row : row + 1, int((mask[row] == 0).sum()) :]
        with torch.no_grad():
            first = target(prompt).logits[0, -1].div(TEMPERATURE).softmax(-1)
            pairs = {}
            for t1 in torch.nonzero(first > 1e-5).flatten().tolist():
                second = target(torch.cat([prompt, torch.tensor([[t1]])], -1)).logits[0, -1].div(TEMPERATURE).softmax(-1)
                for t2 in torch.nonzero(second > 1e-5).flatten().tolist():
                    pairs[(t1, t2)] = float(first[t1] * second[t2])
        exact.append(pairs)
    counts = [{} for _ in range(ids.shape[0])]
    for seed in range(runs):
        torch.manual_seed(seed)
        # three new tokens: the step after the prefill verifies one draft per row, which the second token comes from
        out = target.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, temperature=TEMPERATURE,
                              top_k=0, return_dict_in_generate=True, **kwargs)
        if stats is not None:
            stats.append(out.dflash_stats)
        out = out.sequences[:, ids.shape[1] : ids.shape[1] + 2].tolist()
        for row, pair in enumerate(out):
            counts[row][tuple(pair)] = counts[row].get(tuple(pair), 0) + 1
    for row in range(ids.shape[0]):
        keys = set(exact[row]) | set(counts[row])
        distances.append(0.5 * sum(abs(exact[row].get(k, 0.0) - counts[row].get(k, 0) / runs) for k in keys))
    return distances


TEMPERATURE = 0.5


def test_sampling_each_row_is_distributed_as_the_target():
    """Rows of different lengths, sampled: each row's first two tokens distributed as the target's own. The drafter
    proposes the greedy continuation with a spread q, and the step after the prefill verifies one draft per row, so
    that drafts are accepted, rejected and resampled (about a third accepted); a row accepting its draft and its
    neighbour not is the ragged case the holes serve. A sampled check, end to end at the default proposal: the exact
    proof on a ragged batch is test_exact_sampling.py's enumeration."""
    target = _target("qwen3")
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)  # peaked distributions: a few likely tokens per step
    ids, mask = _batch((7, 3), seed=3)
    oracle = tiny.drafter(0, cls=tiny.BatchOracleDrafter, block_size=4)
    oracle.logit_scale = 3.0
    oracle.arm(_scripts(target, ids, mask, 3), target)
    runs, stats = 1500, []
    distances = _pair_distance(target, ids, mask, runs, stats, assistant_model=oracle)
    for row in range(2):  # every call verified a draft in each row; some were accepted, some not
        assert sum(s.rows[row].drafted_tokens for s in stats) == runs
        assert 0.2 * runs < sum(s.rows[row].accepted_tokens for s in stats) < 0.5 * runs
    # at 1,500 runs plain batched sampling's own distances (the noise floor) were 0.031 and 0.044, DFlash's 0.035 and
    # 0.031; a residual drawn from p instead of max(p - q, 0) (the classic bias) gave 0.039 and 0.124: row 1 shows it,
    # row 0's share of it is below this noise
    assert max(distances) < 0.065, distances


def test_pipeline_with_batch_size_equals_plain():
    tok = tiny.tokenizer()
    tok.padding_side = "left"
    target = dflash_hf.enable(tiny.qwen3_target())
    target.generation_config.pad_token_id = tok.pad_token_id
    pipe = pipeline("text-generation", model=target, tokenizer=tok)
    prompts = ["x = 1", "def f(a, b):", "ab", "print(f(2, 3)) # a longer one"]
    expected = pipe(prompts, max_new_tokens=12, do_sample=False, batch_size=4)
    drafter = tiny.drafter(0, block_size=4)
    with tiny.ForwardCounter(drafter) as drafted:
        actual = pipe(prompts, max_new_tokens=12, do_sample=False, batch_size=4, assistant_model=drafter)
    assert actual == expected
    assert drafted.count >= 1 and drafted.count <= 11  # one drafter forward per step for the whole batch


class BatchStreamer(BaseStreamer):
    """A streamer that takes batches (transformers' TextStreamer refuses them itself)."""

    def put(self, value):
        pass

    def end(self):
        pass


@pytest.mark.parametrize("case, match", [
    ("stop strings", "StopStringCriteria"),
    ("streamer", "streamers"),
    ("repetition penalty", "RepetitionPenaltyLogitsProcessor"),
    ("lookup", "does not copy from the context"),
    ("scores", "output_scores"),
])
def test_what_a_batch_refuses_names_the_fix(case, match):
    target = _target("qwen3")
    ids, mask = _batch((4, 6))
    kwargs = {
        "stop strings": dict(stop_strings=["ab"], tokenizer=tiny.tokenizer()),
        "streamer": dict(streamer=BatchStreamer()),
        "repetition penalty": dict(repetition_penalty=1.3),
        "lookup": dict(prompt_lookup_num_tokens=5),
        "scores": dict(return_dict_in_generate=True, output_scores=True),
    }.get(case, {})
    with pytest.raises(ValueError, match=match) as error:
        target.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant_model=tiny.drafter(0),
                        **kwargs)
    assert "one prompt at a time" in str(error.value)


def test_hybrid_target_in_a_batch_is_refused():
    from test_hybrid import hybrid_target

    ids, mask = _batch((4, 6))
    target = hybrid_target()
    with pytest.raises(ValueError, match="linear_attention"):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                 assistant_model=tiny.drafter(0))


def _mistral(seed=0):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**tiny._common(sliding_window=6))).eval()


def _sliding_targets():
    """Targets with sliding-window layers: Gemma-4 (alternating, also with shared keys/values), Qwen3 windows on
    its upper layers, Mistral (one window over every layer, no `layer_types`)."""
    return {"gemma4": tiny.gemma4_target, "gemma4-kv-shared": lambda: tiny.gemma4_target(num_kv_shared_layers=2),
            "qwen3-window": lambda: tiny.qwen3_target(use_sliding_window=True, sliding_window=5, max_window_layers=2),
            "mistral": _mistral}


def test_sliding_window_target_with_flash_attention_in_a_batch_is_refused():
    target = dflash_hf.enable(tiny.gemma4_target())
    target.config._attn_implementation = "flash_attention_2"  # refused before any forward, so no kernel is needed
    ids, mask = _batch((4, 6))
    with pytest.raises(ValueError, match='attn_implementation="sdpa"'):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant_model=tiny.drafter(0),
                        pad_token_id=0)
