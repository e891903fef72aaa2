"""`dflash-hf export`: a folder that stock transformers runs with dflash-hf's decoding, dflash_hf not installed."""

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import dflash_hf
from dflash_hf import DFlashConfig, DFlashDraftModel, cli, embedded, export
from test_stock_transformers import _all_accept_pair
from tiny import drafter, qwen3_target, tokenizer

CUSTOM_RUN = textwrap.dedent(
    """
    import json, sys, warnings
    sys.modules["dflash_hf"] = None  # importing dflash_hf fails from here on
    import torch
    from transformers import AutoModel, AutoModelForCausalLM


    def chat_warnings(call):  # call()'s result and how many chat-mode warnings it gave
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = call()
        return result, sum("enable_thinking" in str(w.message) for w in caught)

    folder = sys.argv[1]
    target = AutoModelForCausalLM.from_pretrained(folder + "/target").eval()
    forwards = []
    target.register_forward_hook(lambda module, args, output: forwards.append(1))
    prompt = torch.tensor([[5, 6, 7, 8]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    results = {}
    for name in ("random", "all_accept"):
        repo = folder + "/" + name
        drafter = AutoModel.from_pretrained(repo, trust_remote_code=True).eval()
        forwards.clear()
        out, greedy_warnings = chat_warnings(lambda: target.generate(
            prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter, custom_generate=repo,
            trust_remote_code=True, return_dict_in_generate=True, dflash_lookup=None))  # the drafts alone
        stats, target_forwards = out.dflash_stats, len(forwards)
        torch.manual_seed(0)
        sampled = target.generate(prompt, max_new_tokens=12, do_sample=True, assistant_model=drafter,
                                  custom_generate=repo, trust_remote_code=True)
        # the same prompt ending with the empty think block of a non-thinking chat template: <think> x </think> x
        _, block_warnings = chat_warnings(lambda: target.generate(
            torch.tensor([[5, 6, 7, 8, 60, 9, 61, 9]]), max_new_tokens=4, do_sample=False, assistant_model=drafter,
            custom_generate=repo, trust_remote_code=True))
        results[name] = {
            "identical": bool(torch.equal(out.sequences, plain)), "target_forwards": target_forwards,
            "tau": stats.mean_acceptance_length, "accepted": stats.accepted_tokens,
            "stats_module": type(stats).__module__, "sampled_new": sampled.shape[1] - prompt.shape[1],
            "sampled": sampled[0].tolist(),
            "chat_warnings": [greedy_warnings, block_warnings],
        }
    # without a DFlash drafter the exported generate is plain generate
    again = target.generate(prompt, max_new_tokens=24, do_sample=False, custom_generate=folder + "/random",
                            trust_remote_code=True)
    results["plain_identical"] = bool(torch.equal(again, plain))
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("exported")
    target, all_accept = _all_accept_pair()
    target.save_pretrained(folder / "target")
    # trained on non-thinking prompts; tokens 60 and 61 play <think> and </think> (a mode already in the config is kept)
    all_accept.config.set_chat_mode({"enable_thinking": False}, think_token_ids=[60, 61])
    export.export(all_accept, folder / "all_accept", base_model="org/tiny-target")
    export.export(drafter(1, block_size=4), folder / "random")
    return folder


def test_custom_generate_runs_the_exported_decoding_without_dflash_hf(exported):
    run = subprocess.run([sys.executable, "-c", CUSTOM_RUN, str(exported)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert results.pop("plain_identical")
    for name, result in results.items():
        assert result["identical"], (name, result)
        assert "dflash_hf" not in result["stats_module"]  # the exported file's own classes
        assert result["sampled_new"] == 12
        # the exported file samples what dflash_hf samples: the same draws from the same seed
        target = AutoModelForCausalLM.from_pretrained(exported / "target").eval()
        ours = DFlashDraftModel.from_pretrained(exported / name).eval()
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the chat-mode warning, counted above
            again = dflash_hf.generate(target, torch.tensor([[5, 6, 7, 8]]), max_new_tokens=12, do_sample=True,
                                       assistant_model=ours)
        assert again[0].tolist() == result["sampled"], name
    accept = results["all_accept"]
    # blocks of 4: the prefill, then 3 drafts + 1 token of the target's per verification forward
    assert accept["target_forwards"] <= 1 + 24 // 4 and accept["tau"] > 3.5 and accept["accepted"] > 0
    assert results["random"]["target_forwards"] > 12
    # the non-thinking drafter warns once about a prompt without the empty think block, never with it
    assert accept["chat_warnings"] == [1, 0] and results["random"]["chat_warnings"] == [0, 0]


def test_exported_folder_layout_card_and_requirements(exported):
    folder = exported / "all_accept"
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert {"config.json", "model.safetensors", "modeling_dflash.py", "README.md", "custom_generate/generate.py",
            "custom_generate/requirements.txt"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3" and "auto_map" in config and "dflash_config" in config  # z-lab keys
    card = (folder / "README.md").read_text()
    front = card.split("---")[1]
    assert "library_name: transformers" in front and "pipeline_tag: text-generation" in front
    assert "base_model: org/tiny-target" in front and "dflash" in front
    assert 'speculation_type="dflash"' in card and "custom_generate=" in card and "vllm serve" in card
    assert "sglang.launch_server" in card and '"num_speculative_tokens": 3' in card  # block 4
    assert "enable_thinking=False" in card and "warns once per call" in card  # the recorded chat mode
    assert config["dflash_config"]["chat_template_kwargs"] == {"enable_thinking": False}
    requirements = (folder / "custom_generate" / "requirements.txt").read_text().split()
    assert requirements == ["torch", f"transformers>={export.MIN_TRANSFORMERS}"]
    generate_py = (folder / "custom_generate" / "generate.py").read_text()
    assert "from ." not in generate_py and "import dflash_hf" not in generate_py and "def generate(" in generate_py
    assert "Generated by `dflash-hf export`" in generate_py and "dflash_hf/generation/decoding.py" in generate_py
    # imports merged at the top: one statement per module, none left in the body at module level
    header, body = generate_py.split("# " + "-" * 30, 1)
    assert header.count("from transformers import") == 1 and header.splitlines().count("import torch") == 1
    assert not [line for line in body.splitlines() if line.startswith(("import ", "from "))]


def test_generate_py_defines_every_name_it_uses():
    """Every global name the exported file reads is defined or imported in it: an intra-package import of a module
    left out of `GENERATE_SOURCES` is dropped at export, and its names would fail only on the path that reads them
    (the step-cost prior and the packed CPU path had moved to hardware.py and packed.py)."""
    import builtins
    import symtable

    table = symtable.symtable(export.build_generate_py(), "generate.py", "exec")
    defined = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    missing, scopes = set(), [table]
    while scopes:
        scope = scopes.pop()
        missing |= {s.get_name() for s in scope.get_symbols()
                    if s.is_global() and s.is_referenced() and s.get_name() not in defined
                    and not hasattr(builtins, s.get_name())}
        scopes += scope.get_children()
    assert not missing, sorted(missing)


def test_generate_py_is_built_from_the_package_sources(monkeypatch, tmp_path):
    """Edits to the package's decoding modules reach the exported file; a name defined twice is refused."""
    package = tmp_path / "dflash_hf"
    for relative in export.GENERATE_SOURCES:
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text((export.PACKAGE / relative).read_text())
    (package / "generation" / "policy.py").write_text(
        (package / "generation" / "policy.py").read_text() + "\n\nMARKER = 'edited'\n")
    monkeypatch.setattr(export, "PACKAGE", package)
    assert "MARKER = 'edited'" in export.build_generate_py()
    (package / "generation" / "decoding.py").write_text(
        (package / "generation" / "decoding.py").read_text() + "\n\ndef text_config():\n    pass\n")
    with pytest.raises(RuntimeError, match="text_config is defined in both"):
        export.build_generate_py()


def test_cli_export_and_push(monkeypatch, tmp_path):
    source = tmp_path / "drafter"
    drafter(0, block_size=4).save_pretrained(source)
    calls = {}
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: calls.setdefault("create", (repo_id, kw)))
    monkeypatch.setattr(huggingface_hub, "upload_folder",
                        lambda **kw: calls.setdefault("upload", kw) and "https://hf.co/org/d/commit/1")
    think_tokenizer = tokenizer()
    think_tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    think_tokenizer.save_pretrained(tmp_path / "tokenizer")
    assert cli.main(["export", str(source), str(tmp_path / "out"), "--push", "org/d", "--chat-mode", "non-thinking",
                     "--tokenizer", str(tmp_path / "tokenizer")]) == 0
    assert calls["create"] == ("org/d", {"private": False, "exist_ok": True})
    dflash_config = json.loads((tmp_path / "out" / "config.json").read_text())["dflash_config"]
    assert dflash_config["chat_template_kwargs"] == {"enable_thinking": False}
    assert dflash_config["think_token_ids"] == think_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert calls["upload"]["repo_id"] == "org/d" and calls["upload"]["folder_path"] == str(tmp_path / "out")
    assert (tmp_path / "out" / "custom_generate" / "generate.py").is_file()
    loaded = export.DFlashDraftModel.from_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                  export.DFlashDraftModel.from_pretrained(source).state_dict().values()))


def _chat_warnings(target, model, prompt) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dflash_hf.generate(target, torch.tensor([prompt]), assistant_model=model, max_new_tokens=3, do_sample=False)
    return sum("enable_thinking" in str(w.message) for w in caught)


def test_a_prompt_in_the_other_chat_mode_warns_once():
    """Token ids 60/61 play <think>/</think>: a non-thinking template ends the prompt with `<think> x </think> x`."""
    target, model = qwen3_target(), drafter(0, block_size=4)
    plain, empty_block, open_block = [5, 6, 7, 8], [5, 6, 60, 9, 61, 9], [5, 6, 7, 60, 9]
    assert _chat_warnings(target, model, plain) == 0  # no chat mode recorded: nothing checked
    model.config.set_chat_mode({"enable_thinking": False})
    assert _chat_warnings(target, model, plain) == 0  # without the think ids nothing is checked either
    model.config.set_chat_mode({"enable_thinking": False}, think_token_ids=[60, 61])
    assert [_chat_warnings(target, model, p) for p in (plain, empty_block, open_block)] == [1, 0, 1]
    model.config.set_chat_mode({"enable_thinking": True}, think_token_ids=[60, 61])
    assert [_chat_warnings(target, model, p) for p in (plain, empty_block, open_block)] == [0, 1, 0]
    # only the end of the prompt counts: an empty block long before the generation prompt is another turn's
    assert _chat_warnings(target, model, empty_block + [7] * 16) == 0


def test_chat_mode_round_trip_and_checks(tmp_path):
    think_tokenizer = tokenizer()
    think_tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    model = drafter(0, block_size=4)
    model.config.set_chat_mode({"enable_thinking": True}, think_tokenizer)
    model.save_pretrained(tmp_path / "d")
    config = DFlashConfig.from_pretrained(tmp_path / "d")
    assert config.chat_template_kwargs == {"enable_thinking": True}
    assert config.think_token_ids == think_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    config.set_chat_mode({"enable_thinking": False}, tokenizer())  # a tokenizer without think tokens: no ids
    assert config.chat_template_kwargs == {"enable_thinking": False} and config.think_token_ids is None
    config.set_chat_mode(None)
    assert config.chat_template_kwargs == {} and set(config.dflash_config) == {"mask_token_id", "target_layer_ids"}
    with pytest.raises(ValueError, match="think_token_ids"):
        config.set_chat_mode({"enable_thinking": False}, think_token_ids=[1])
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        DFlashConfig(**{**config.to_dict(), "dflash_config": {**config.dflash_config, "chat_template_kwargs": "no"}})
    fresh = DFlashConfig.from_target(qwen3_target(), num_draft_layers=1, mask_token_id=63, tokenizer=think_tokenizer,
                                     chat_template_kwargs={"enable_thinking": False})
    assert fresh.chat_template_kwargs == {"enable_thinking": False}
    assert fresh.think_token_ids == think_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    # export records a mode on its copy of the config; the drafter passed in is unchanged
    export.export(model, tmp_path / "out", chat_template_kwargs={"enable_thinking": False}, tokenizer=think_tokenizer)
    assert model.config.chat_template_kwargs == {"enable_thinking": True}
    saved = json.loads((tmp_path / "out" / "config.json").read_text())["dflash_config"]
    assert saved["chat_template_kwargs"] == {"enable_thinking": False} and len(saved["think_token_ids"]) == 2


SHIPPED_RUN = textwrap.dedent(
    """
    import json, sys
    sys.modules["dflash_hf"] = None  # importing dflash_hf fails from here on
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    repo, target_dir = sys.argv[1:]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    drafter = AutoModel.from_pretrained(repo, trust_remote_code=True, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = target.generate(**inputs, max_new_tokens=32, do_sample=False)
    out = target.generate(**inputs, max_new_tokens=32, do_sample=False, assistant_model=drafter, custom_generate=repo,
                          trust_remote_code=True, return_dict_in_generate=True)
    print(json.dumps({"identical": bool(torch.equal(out.sequences, plain)),
                      "tau": out.dflash_stats.mean_acceptance_length}))
    """
)


@pytest.mark.slow
def test_export_the_shipped_drafter(tmp_path):
    """The shipped SmolLM2 drafter, exported, runs through custom_generate next to its target, dflash_hf not importable."""
    if not embedded.has_shipped_drafter():
        pytest.skip("no drafter is shipped in dflash_hf/assets")
    try:
        target_dir = embedded.smollm2_dir(convert=True)
    except embedded.EmbeddedModelMissing as error:
        pytest.skip(str(error))
    out = tmp_path / "smollm2-dflash-hub"
    assert cli.main(["export", str(embedded.DRAFTER_DIR), str(out), "--base-model",
                     "HuggingFaceTB/SmolLM2-135M-Instruct"]) == 0
    card = (out / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and '"num_speculative_tokens": 7' in card
    run = subprocess.run([sys.executable, "-c", SHIPPED_RUN, str(out), str(target_dir)], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["identical"] and result["tau"] > 1.0, result
