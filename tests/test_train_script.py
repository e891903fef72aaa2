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
    def prose_tau(folder, target):  # the round's prose tau, measured on the run's own target
        assert target == "smollm2"
        return {"mean_tau": prose["tau"]}

    monkeypatch.setattr(script, "prose_tau", prose_tau)
    monkeypatch.setattr(script, "training_prompts", lambda: ["a prompt"])
    monkeypatch.setattr(script, "save_responses", lambda cache: 0)
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
