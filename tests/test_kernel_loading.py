"""Loading the DFlash kernel repository with `kernels`, and falling back to the PyTorch reference."""

import importlib.util
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_hf.kernels import loader
from dflash_hf.kernels.attention import ATTENTION_NAME, dflash_block_attention_forward, register_dflash_attention

REPO = Path(__file__).resolve().parents[1] / "kernels" / "dflash-kernels"
LOGGER = "dflash_hf.kernels.loader"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.fixture(autouse=True)
def _fresh_decisions(monkeypatch):
    monkeypatch.delenv(loader.ENV_VAR, raising=False)
    loader.clear_cache()
    yield
    loader.clear_cache()


def _warnings(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_in_repo_kernel_loads_offline_with_get_local_kernel():
    import kernels

    assert loader.local_kernel_repo() == REPO
    pytest.importorskip("triton", reason="the kernel module imports triton")
    module = kernels.get_local_kernel(REPO)
    assert set(loader.KERNEL_API) <= set(module.__all__)
    loaded = {str(k.metadata.name) for k in kernels.get_loaded_kernels()}
    assert "dflash-kernels" in loaded


def test_build_variants_are_in_sync_with_sources():
    spec = importlib.util.spec_from_file_location("build_variants", REPO / "build_variants.py")
    build_variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_variants)
    assert build_variants.stale_files() == [], "run `python kernels/dflash-kernels/build_variants.py`"


def test_torch_backend_forces_the_reference(monkeypatch, caplog):
    monkeypatch.setenv(loader.ENV_VAR, "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernels could run: the switch alone decides
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert loader.load_kernels() is None
    assert not _warnings(caplog)
    assert "PyTorch reference" in caplog.text
    q = torch.randn(1, 2, 4, 16)
    assert loader.kernels_for(q) is None


def test_backend_argument_overrides_the_environment(monkeypatch):
    monkeypatch.setenv(loader.ENV_VAR, "triton")
    assert loader.load_kernels(backend="torch") is None


def test_invalid_backend_is_a_value_error(monkeypatch):
    with pytest.raises(ValueError, match="one of"):
        loader.load_kernels(backend="cuda")
    monkeypatch.setenv(loader.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=loader.ENV_VAR):
        loader.load_kernels()


def test_cpu_without_interpreter_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(loader, "_gpu_available", lambda: False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert loader.load_kernels() is None
        assert loader.load_kernels() is None
        from dflash_hf.kernels import block_attention

        q, k, v = torch.randn(1, 4, 4, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
        # the fallback computes attention: checked against torch's own sdpa (GQA expanded by hand)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), scale=0.25).transpose(1, 2)
        torch.testing.assert_close(block_attention(q, k, v, 0.25), expected, atol=1e-5, rtol=1e-4)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "no GPU" in warnings[0].getMessage()
    with pytest.raises(RuntimeError, match="triton"):
        loader.load_kernels(backend="triton")


def test_missing_kernel_repo_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert loader.load_kernels(tmp_path / "no-such-repo") is None
    assert len(_warnings(caplog)) == 1
    with pytest.raises(RuntimeError, match="cannot load"):
        loader.load_kernels(tmp_path / "no-such-repo", backend="triton")


def _broken_copy(tmp_path, breakage):
    """A copy of the repository's build (links followed), broken by `breakage`. Each variant gets its own
    module id, as a rebuild of changed sources would: `kernels` imports a kernel under its metadata id,
    and an id already imported in this process is not imported again."""
    repo = tmp_path / "dflash-kernels"
    shutil.copytree(REPO / "build", repo / "build")
    for variant in (repo / "build").iterdir():
        metadata = json.loads((variant / "metadata.json").read_text())
        metadata["id"] += f"_{tmp_path.name}"
        (variant / "metadata.json").write_text(json.dumps(metadata))
        breakage(variant)
    return repo


BREAKAGES = {
    "no metadata": lambda variant: (variant / "metadata.json").unlink(),
    "bad metadata": lambda variant: (variant / "metadata.json").write_text("{"),
    "syntax error": lambda variant: (variant / "dflash_kernels" / "__init__.py").write_text("def (:\n"),
    "missing op": lambda variant: (variant / "dflash_kernels" / "__init__.py").write_text("__all__ = []\n"),
}


@needs_triton
@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_broken_kernel_repo_falls_back(monkeypatch, tmp_path, caplog, breakage):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    repo = _broken_copy(tmp_path, BREAKAGES[breakage])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert loader.load_kernels(repo) is None
    assert len(_warnings(caplog)) == 1
    assert "PyTorch reference" in _warnings(caplog)[0].getMessage()


@needs_triton
def test_version_with_a_local_folder_is_a_value_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="Hub"):
        loader.load_kernels(REPO, version=1)


def test_nothing_is_registered_at_import():
    code = (
        "import dflash_hf, dflash_hf.kernels\n"
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
        f"assert {ATTENTION_NAME!r} not in ALL_ATTENTION_FUNCTIONS\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO.parents[1])


def test_registration_is_idempotent_and_never_overrides(monkeypatch):
    from transformers import AttentionInterface

    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    assert register_dflash_attention() == ATTENTION_NAME
    assert register_dflash_attention() == ATTENTION_NAME
    assert AttentionInterface._global_mapping[ATTENTION_NAME] is dflash_block_attention_forward
    AttentionInterface._global_mapping[ATTENTION_NAME] = lambda *args, **kwargs: None
    with pytest.raises(ValueError, match="already registered"):
        register_dflash_attention()


def test_attention_function_falls_back_to_sdpa_with_a_mask(monkeypatch):
    import tiny

    from dflash_hf.kernels import use_dflash_attention

    monkeypatch.setenv(loader.ENV_VAR, "torch")
    drafter = tiny.drafter(block_size=4)
    attention = drafter.layers[0].self_attn
    q, k = torch.randn(1, 4, 4, 16), torch.randn(1, 2, 10, 16)
    mask = torch.zeros(1, 1, 4, 10)
    mask[..., :3] = torch.finfo(torch.float32).min  # padding
    out, weights = dflash_block_attention_forward(attention, q, k, k, mask, scaling=0.25)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), k.repeat_interleave(2, 1),
                                                                attn_mask=mask, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    assert use_dflash_attention(drafter) is drafter and drafter.config._attn_implementation == ATTENTION_NAME
