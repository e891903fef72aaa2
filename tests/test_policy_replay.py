"""benchmarks/policy_replay.py: the package's policies replayed on a recorded answer."""

import importlib.util
import math
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("policy_replay", Path(__file__).parent.parent / "benchmarks" / "policy_replay.py")
policy_replay = importlib.util.module_from_spec(spec)
spec.loader.exec_module(policy_replay)


def _answer(length: int, drafts: int, copy_from: int | None):
    """An answer of `length` tokens after a 4-token prompt: every block has its first `drafts` drafts right;
    from position `copy_from` on, a copy of 10 tokens is found there and is right throughout."""
    text = list(range(4 + length))
    anchors = range(4, len(text) - 1)
    copies = [text[a + 1 : a + 11] if copy_from is not None and a >= copy_from else [] for a in anchors]
    proposed = [[text[a + 1 + k] if k < drafts and a + 1 + k < len(text) else -1 for k in range(7)] for a in anchors]
    return {"set": "t", "start": 4, "text": text, "drafts": proposed, "accepted_drafts": [drafts] * len(anchors),
            "copies": copies, "accepted_copies": [len(c) for c in copies]}


def test_plain_costs_one_step_a_token_and_the_full_block_what_its_drafts_earn():
    costs = policy_replay.COSTS["bf16"]
    tokens, cost = policy_replay.replay(_answer(64, 0, None), "plain", costs)
    assert (tokens, cost) == (64, pytest.approx(63.0))  # the first token comes from the prefill
    _, cost = policy_replay.replay(_answer(64, 3, None), "full block", costs)
    steps = math.ceil(63 / 4)  # 3 drafts and the target's own token a step
    assert cost == pytest.approx(steps * (costs["draft"] + policy_replay.forward_cost(costs["forward"], 8)))


def test_adaptive_stops_drafting_a_useless_drafter_and_copies_where_the_text_repeats():
    costs = policy_replay.COSTS["bf16"]
    useless = _answer(128, 0, None)
    _, plain = policy_replay.replay(useless, "plain", costs)
    _, adaptive = policy_replay.replay(useless, "adaptive", costs)
    _, full = policy_replay.replay(useless, "full block", costs)
    assert plain < adaptive < 1.1 * plain < full
    repeating = _answer(128, 0, copy_from=40)
    _, lookup = policy_replay.replay(repeating, "lookup", costs)
    _, combined = policy_replay.replay(repeating, "adaptive+lookup", costs)
    assert combined < 0.5 * plain and lookup < 0.5 * plain


def test_forward_cost_interpolates_the_table():
    table = {1: 1.0, 2: 1.2, 4: 1.4}
    assert policy_replay.forward_cost(table, 3) == pytest.approx(1.3)
    assert policy_replay.forward_cost(table, 6) == pytest.approx(1.6)  # extrapolated


def _disagreeing(length: int):
    """Every block's drafts all wrong from the first, every copy (10 tokens) right: the two disagree."""
    answer = _answer(length, 0, copy_from=4)
    answer["drafts"] = [[-1] * 7 for _ in answer["drafts"]]
    return answer


def test_oracle_takes_the_best_proposal_of_each_step():
    costs = policy_replay.COSTS["bf16"]
    answer = _disagreeing(67)  # 11 tokens a step from the copy
    tokens, cost = policy_replay.replay(answer, "oracle", costs)
    # the anchor is the first answer token: 66 tokens to go, 11 per copied step (the copy and the target's own)
    assert cost == pytest.approx(6 * policy_replay.forward_cost(costs["forward"], 11))
    drafting = _answer(65, 7, None)
    _, cost = policy_replay.replay(drafting, "oracle", costs)
    _, full = policy_replay.replay(drafting, "full block", costs)
    assert cost == pytest.approx(full)  # all 7 drafts right: the full block is the best step


def test_two_branches_pay_for_both_and_commit_the_longer():
    costs = policy_replay.COSTS["bf16"]
    answer = _answer(128, 7, None)  # every draft right, and a copy found everywhere that is wrong at once
    answer["copies"] = [[-2] * 10 for _ in answer["copies"]]
    answer["accepted_copies"] = [0] * len(answer["copies"])
    tokens, combined = policy_replay.replay(answer, "adaptive+lookup", costs)
    _, both = policy_replay.replay(answer, "two branches", costs)
    _, oracle = policy_replay.replay(answer, "oracle", costs)
    # once the copies have failed they are passed over: the two branches commit the same tokens as the
    # drafts alone, each step paying for a forward over the copy too
    assert oracle <= combined < both
    steps_after_learning = tokens // 8 - 4
    extra = policy_replay.forward_cost(costs["forward"], 18) - policy_replay.forward_cost(costs["forward"], 8)
    assert both - combined >= steps_after_learning * extra
