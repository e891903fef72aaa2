"""The wheel carries the shipped drafter: built, installed into a fresh virtual environment, and the demo
runs offline from it (not from this checkout)."""

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from dflash_hf import embedded

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_ships_the_drafter_and_the_demo_runs_from_it(tmp_path):
    if not embedded.has_shipped_drafter():
        pytest.skip("no drafter is shipped in dflash_hf/assets yet")
    try:
        embedded.smollm2_dir(convert=True)
    except embedded.EmbeddedModelMissing as error:
        pytest.skip(str(error))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(ROOT)], check=True, timeout=600)
    wheel = next(wheels.glob("dflash_hf-*.whl"))
    # torch, transformers and the embedded target come from this environment; dflash_hf only from the wheel
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=600)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    located = subprocess.run([python, "-c", "import dflash_hf, sys; print(dflash_hf.__file__)"], cwd=tmp_path,
                             capture_output=True, text=True, env=env, check=True)
    assert str(env_dir) in located.stdout, located.stdout
    demo = subprocess.run([python, "-m", "dflash_hf.cli", "demo", "--max-new-tokens", "16"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=900)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "tau" in demo.stdout and "identical output to plain" in demo.stdout
