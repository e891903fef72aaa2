"""`dflash-hf export`: a folder that stock transformers runs with dflash-hf's decoding, dflash_hf not installed."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from dflash_hf import cli, export
from test_stock_transformers import _all_accept_pair
from tiny import drafter

CUSTOM_RUN = textwrap.dedent(
    """
    import json, sys
    sys.modules["dflash_hf"] = None  # importing dflash_hf fails from here on
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

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
        out = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                              custom_generate=repo, trust_remote_code=True, return_dict_in_generate=True)
        stats, target_forwards = out.dflash_stats, len(forwards)
        torch.manual_seed(0)
        sampled = target.generate(prompt, max_new_tokens=12, do_sample=True, assistant_model=drafter,
                                  custom_generate=repo, trust_remote_code=True)
        results[name] = {
            "identical": bool(torch.equal(out.sequences, plain)), "target_forwards": target_forwards,
            "tau": stats.mean_acceptance_length, "accepted": stats.accepted_tokens,
            "stats_module": type(stats).__module__, "sampled_new": sampled.shape[1] - prompt.shape[1],
            "sampled_in_vocab": bool((sampled >= 0).all() and (sampled < target.config.vocab_size).all()),
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
        assert result["sampled_new"] == 12 and result["sampled_in_vocab"]
    accept = results["all_accept"]
    # blocks of 4: the prefill, then 3 drafts + 1 token of the target's per verification forward
    assert accept["target_forwards"] <= 1 + 24 // 4 and accept["tau"] > 3.5 and accept["accepted"] > 0
    assert results["random"]["target_forwards"] > 12


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
    requirements = (folder / "custom_generate" / "requirements.txt").read_text().split()
    assert requirements == ["torch", f"transformers>={export.MIN_TRANSFORMERS}"]
    generate_py = (folder / "custom_generate" / "generate.py").read_text()
    assert "from ." not in generate_py and "import dflash_hf" not in generate_py and "def generate(" in generate_py


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
    assert cli.main(["export", str(source), str(tmp_path / "out"), "--push", "org/d"]) == 0
    assert calls["create"] == ("org/d", {"private": False, "exist_ok": True})
    assert calls["upload"]["repo_id"] == "org/d" and calls["upload"]["folder_path"] == str(tmp_path / "out")
    assert (tmp_path / "out" / "custom_generate" / "generate.py").is_file()
    loaded = export.DFlashDraftModel.from_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                  export.DFlashDraftModel.from_pretrained(source).state_dict().values()))
