"""scripts/train_smollm2_drafter.py: the committed response cache."""

import gzip
import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "train_smollm2_drafter", Path(__file__).parent.parent / "scripts" / "train_smollm2_drafter.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def test_saved_responses_round_trip_and_are_deterministic(tmp_path, monkeypatch):
    monkeypatch.setattr(script, "RESPONSES", tmp_path / "responses.jsonl.gz")
    cache = tmp_path / "responses.jsonl"
    records = [{"input_ids": [1, 2, 7], "loss_mask": [0, 0, 1]}, {"input_ids": [3, 8, 9], "loss_mask": [0, 1, 1]}]
    # an older record of the same prompt, a cut last line: the newest complete record of each prompt is kept
    lines = [json.dumps({"index": 0, "input_ids": [1, 2, 5], "loss_mask": [0, 0, 1]})]
    lines += [json.dumps(r) for r in records] + ['{"input_ids": [4, 4']
    cache.write_text("\n".join(lines))
    assert script.save_responses(cache) == 2
    saved = script.RESPONSES.read_bytes()
    assert [json.loads(line) for line in gzip.decompress(saved).decode().splitlines()] == records
    script.save_responses(cache)
    assert script.RESPONSES.read_bytes() == saved  # no diff when nothing changed


def test_held_out_prose_keeps_clear_of_every_topic_the_drafter_trained_on():
    # The shipped drafter trained on the emoji and city requests clear of the first 20 held-out requests;
    # a later held-out request sharing a word with one of those topics would drop it from the training
    # prompts, which hides that training but does not undo it.
    first = script.held_out_words(script.PROSE_REQUESTS[:20])
    assert len(script.PROSE_REQUESTS) > 20
    for seed, templates in ((0, {}), (1, {"templates": script.MORE_PROSE_TEMPLATES,
                                          "city_templates": script.MORE_CITY_TEMPLATES})):
        assert (script.prose_requests(seed=seed, exclude_words=script.held_out_words(), **templates)
                == script.prose_requests(seed=seed, exclude_words=first, **templates))


def test_vocabulary_word_requests_leave_out_the_held_out_words(monkeypatch):
    words = ["kettle", "forest", "lighthouse", "printing", "saddle"]
    monkeypatch.setattr(script, "smollm2_tokenizer", lambda: None)
    monkeypatch.setattr(script, "vocabulary_words", lambda tokenizer: words)
    monkeypatch.setattr(script, "docstring_prompts", lambda seed: [])
    prompts = script.training_prompts()
    # "forest" and "lighthouse" are in the first held-out requests, "printing" in a later one
    assert [next(w for w in words if w in request) for request in prompts[-2:]] == ["kettle", "saddle"]
    assert not any(word in prompt for prompt in prompts for word in ("forest", "lighthouse", "printing"))


def test_a_run_keeps_its_best_round_although_checkpoints_rotate(tmp_path, monkeypatch):
    rounds = iter([(2.0, 1.3), (2.1, 1.4), (2.1, 1.3)])  # HumanEval, prose tau: the second round is best
    prose = {}

    def train(argv):  # what `dflash-hf train` leaves in the output directory
        out, step = Path(argv[argv.index("--output-dir") + 1]), int(argv[argv.index("--stop-after-steps") + 1])
        tau, prose["tau"] = next(rounds)
        (out / "checkpoints" / f"step-{step}").mkdir(parents=True)
        for name in ("config.json", "modeling_dflash.py", "training_args.json"):
            (out / name).write_text(name)
        (out / "model.safetensors").write_text(f"weights of step {step}")
        (out / "training_metrics.json").write_text(json.dumps({"global_step": step, "eval": {"mean_tau": tau}}))
        return 0

    monkeypatch.setattr(script, "cli_main", train)
    def prose_tau(folder, target, max_new_tokens):  # the round's prose tau, measured on the run's own target
        assert target == "smollm2" and max_new_tokens == 128
        return {"mean_tau": prose["tau"]}

    monkeypatch.setattr(script, "prose_tau", prose_tau)
    monkeypatch.setattr(script, "training_prompts", lambda: ["a prompt"])
    monkeypatch.setattr(script, "save_responses", lambda cache, *args, **kwargs: 0)
    monkeypatch.setattr(script, "RESPONSES", tmp_path / "no-responses.jsonl.gz")
    run = tmp_path / "run"
    assert script.main(["--output-dir", str(run), "--rounds", "3", "--steps-per-round", "10"]) == 0
    assert (run / "model.safetensors").read_text() == "weights of step 30"
    assert (run / "best" / "model.safetensors").read_text() == "weights of step 20"
    assert script.held_out_score(run / "best") == 2.1 + 1.4
    assert {p.name for p in (run / "best").iterdir()} == set(script.BEST_FILES)


def test_source_examples_are_written_once_per_setting_and_passed_to_training(tmp_path, monkeypatch):
    import tiny
    from dflash_hf.training import data

    source = tmp_path / "src"
    source.mkdir()
    (source / "mod.py").write_text("".join(f"value_{i} = {i}\n" for i in range(200)))
    monkeypatch.setattr(data, "source_files", lambda: [source / "mod.py"])
    monkeypatch.setattr(script, "smollm2_tokenizer", tiny.tokenizer)
    folder = tmp_path / "run" / "data"
    path = script.write_source_examples(folder, 3, chunk_tokens=40)
    examples = data.load_examples(path)
    assert len(examples) == 3 and all(sum(e["loss_mask"]) >= 40 for e in examples)
    stamp = path.stat().st_mtime_ns
    assert script.write_source_examples(folder, 3, chunk_tokens=40) == path and path.stat().st_mtime_ns == stamp
    assert len(data.load_examples(script.write_source_examples(folder, 5, chunk_tokens=40))) == 5  # new settings

    calls = []

    def train(argv):
        calls.append(argv)
        return 1  # stop after the first round's training call

    monkeypatch.setattr(script, "cli_main", train)
    monkeypatch.setattr(script, "training_prompts", lambda: ["a prompt"])
    monkeypatch.setattr(script, "RESPONSES", tmp_path / "no-responses.jsonl.gz")
    assert script.main(["--output-dir", str(tmp_path / "run"), "--source-examples", "5",
                        "--source-chunk-tokens", "40"]) == 1
    argv = calls[0]
    assert argv[argv.index("--extra-examples") + 1] == str(path)


def test_responses_of_the_second_set_stay_out_of_the_first_file(tmp_path, monkeypatch):
    monkeypatch.setattr(script, "RESPONSES", tmp_path / "first.jsonl.gz")
    records = [{"input_ids": [1, 2, 7], "loss_mask": [0, 0, 1]}, {"input_ids": [3, 8, 9], "loss_mask": [0, 1, 1]}]
    cache = tmp_path / "responses.jsonl"
    cache.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "more.jsonl").write_text(json.dumps(records[1]) + "\n")
    assert script.save_responses(tmp_path / "more.jsonl", tmp_path / "more.jsonl.gz") == 1
    assert script.save_responses(cache, exclude=tmp_path / "more.jsonl.gz") == 1
    assert [json.loads(line) for line in gzip.decompress(script.RESPONSES.read_bytes()).decode().splitlines()] \
        == records[:1]
    assert set(script.load_responses_gz(tmp_path / "more.jsonl.gz")) == {(3,)}


def _fake_sources(monkeypatch):
    monkeypatch.setattr(script, "smollm2_tokenizer", lambda: None)
    monkeypatch.setattr(script, "vocabulary_words", lambda tokenizer: [f"word{i}" for i in range(3000)] + ["forest"])
    monkeypatch.setattr(script, "docstring_prompts", lambda seed, modules=None: [
        f"doc {m} {seed} {i}" for m in (modules or ["base"]) for i in range(10)])


def test_more_prompts_are_new_mixed_reproducible_and_clear_of_the_held_out_set(monkeypatch):
    _fake_sources(monkeypatch)
    first = script.training_prompts()
    more = script.more_prompts()
    assert more == script.more_prompts() and len(more) == len(set(more)) > 2000
    assert not set(more) & set(first)
    assert "forest" in script.held_out_words() and not any("forest" in prompt.lower() for prompt in more)
    assert {prompt.split()[0] for prompt in more if prompt.startswith("doc ")} == {"doc"}
    assert f"doc {script.MORE_STDLIB_MODULES[0]} 0 0" in more and f"doc {script.STDLIB_MODULES[0]} 2 0" in more
    assert any("word2999" in prompt for prompt in more) and not any("word0 " in p or p.endswith("word0.") for p in more)
    head = more[:400]  # any prefix mixes the kinds
    assert any("word" in p for p in head) and any(p.startswith("doc") for p in head) and \
        any(topic in p for p in head for topic in ("Write", "Describe", "Explain"))


def test_generate_more_answers_greedily_resumes_and_writes_the_committed_file(tmp_path, monkeypatch):
    import tiny
    import torch
    from dflash_hf import embedded

    target, tokenizer = tiny.qwen3_target(), tiny.tokenizer()
    target.generation_config.eos_token_id = None
    loads = []

    def load_target(name, **kwargs):
        loads.append(kwargs)
        return target, tokenizer

    monkeypatch.setattr(embedded, "load_target", load_target)
    monkeypatch.setattr(script, "smollm2_tokenizer", lambda: tokenizer)
    prompts = ["abc", "de f", "ghij", "k"]
    monkeypatch.setattr(script, "more_prompts", lambda first=None: prompts)
    monkeypatch.setattr(script, "MORE_RESPONSES", tmp_path / "more.jsonl.gz")
    assert script.generate_more(tmp_path / "run", 2, batch_size=1, max_new_tokens=5) == 2
    assert loads == [{"dtype": "bfloat16", "packed": True, "device": None}]
    saved = script.load_responses_gz(script.MORE_RESPONSES)
    from dflash_hf.evaluation import encode_prompt

    for prompt in prompts[:2]:
        ids = encode_prompt(tokenizer, prompt)
        greedy = target.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)[0].tolist()
        assert saved[tuple(ids)]["input_ids"] == greedy
    lines = (tmp_path / "run" / "data" / "more_responses.jsonl").read_text().splitlines()
    assert script.generate_more(tmp_path / "run", 2, batch_size=1, max_new_tokens=5) == 2 and len(loads) == 1
    assert script.generate_more(tmp_path / "run", 4, batch_size=1, max_new_tokens=5) == 4  # two more generated
    assert (tmp_path / "run" / "data" / "more_responses.jsonl").read_text().splitlines()[:2] == lines
    # a fresh machine starts from the committed file
    assert script.generate_more(tmp_path / "fresh", 4, batch_size=1, max_new_tokens=5) == 4 and len(loads) == 2


def test_more_prompts_join_the_first_set_cut_by_num_prompts(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(script, "training_prompts", lambda: ["p1", "p2", "p3"])
    monkeypatch.setattr(script, "more_prompts", lambda first=None: ["m1", "m2", "m3"])
    monkeypatch.setattr(script, "generate_more", lambda output_dir, count, **kw: calls.append(("generate", count, kw)))
    monkeypatch.setattr(script, "cli_main", lambda argv: calls.append(argv) or 1)
    monkeypatch.setattr(script, "RESPONSES", tmp_path / "none.jsonl.gz")
    run = tmp_path / "run"
    assert script.main(["--output-dir", str(run), "--more-prompts", "2", "--num-prompts", "2", "--device", "cuda",
                        "--generation-batch-size", "256"]) == 1
    assert calls[0] == ("generate", 2, {"target": "smollm2", "device": "cuda", "batch_size": 256})
    assert "--num-prompts" not in calls[1] and calls[1][calls[1].index("--device") + 1] == "cuda"
    assert [json.loads(line)["prompt"] for line in (run / "prompts.jsonl").read_text().splitlines()] \
        == ["p1", "p2", "m1", "m2"]


def test_answers_brought_back_merge_into_the_committed_file(tmp_path, monkeypatch):
    monkeypatch.setattr(script, "MORE_RESPONSES", tmp_path / "more.jsonl.gz")
    old = [{"input_ids": [1, 5], "loss_mask": [0, 1]}, {"input_ids": [2, 6], "loss_mask": [0, 1]}]
    new = [{"input_ids": [2, 7], "loss_mask": [0, 1]}, {"input_ids": [3, 8], "loss_mask": [0, 1]}]
    for path, records in ((script.MORE_RESPONSES, old), (tmp_path / "back.jsonl.gz", new)):
        path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    assert script.main(["--output-dir", str(tmp_path / "run"), "--merge-more", str(tmp_path / "back.jsonl.gz")]) == 0
    merged = script.load_responses_gz(script.MORE_RESPONSES)
    assert merged == {(1,): old[0], (2,): new[0], (3,): new[1]}  # the prompt answered twice keeps the newer answer


def test_save_responses_of_a_generation_run_writes_the_second_file_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(script, "RESPONSES", tmp_path / "first.jsonl.gz")
    monkeypatch.setattr(script, "MORE_RESPONSES", tmp_path / "more.jsonl.gz")
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    record = {"input_ids": [4, 5, 6], "loss_mask": [0, 1, 1]}
    (run / "data" / "more_responses.jsonl").write_text(json.dumps(record) + "\n")
    assert script.main(["--output-dir", str(run), "--save-responses"]) == 0
    assert script.load_responses_gz(script.MORE_RESPONSES) == {(4,): record}
    assert not script.RESPONSES.exists()
