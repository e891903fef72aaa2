"""`dflash_hf.hardware`: the dtype DFlash runs in per device kind, and the dtypes plain decoding is timed in."""

import pytest
import torch

from dflash_hf import hardware


@pytest.mark.parametrize(("flags", "native", "expected"), [
    (["avx2", "avx512f", "avx512_bf16", "amx_bf16"], True, "bfloat16"),  # native bf16 (Xeon, EPYC Zen 4)
    (["avx2"], False, "bfloat16"),  # one-token bf16 is the fastest plain step there; the policy prices wider ones
    ([], False, "float32"),  # no fast bf16 path known
])
def test_auto_dtype_by_cpu_kind(monkeypatch, flags, native, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("Some CPU", [*flags, "sse4_2"]))
    monkeypatch.setattr(hardware, "native_cpu_bf16", lambda: native)
    assert hardware.resolve_dtype("auto") == expected
    # training's forwards span whole sequences: bfloat16 only where it is native
    assert hardware.resolve_dtype("auto", for_training=True) == ("bfloat16" if native else "float32")
    assert hardware.resolve_dtype("float16") == "float16"  # what the user names is kept
    assert hardware.cpu_features() == flags
    assert hardware.describe_cpu().startswith("Some CPU (")


def test_describe_device_names_accelerators_other_than_cuda(monkeypatch):
    class FakeXpu:
        @staticmethod
        def get_device_name(device):
            return "Intel Data Center GPU Max 1100"

    monkeypatch.setattr(torch, "xpu", FakeXpu, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: pytest.fail("asked CUDA about an XPU"))
    assert hardware.describe_device(torch.device("xpu:0")) == "Intel Data Center GPU Max 1100"
    assert hardware.describe_device("meta") == "meta device"  # a device type torch names no device of


# Figures measured by earlier sessions (SmolLM2-135M, 2 cores, ms over 1 and 8 tokens): see the module docstring.
AVX2_EPYC = {"float32": {"eager": [56, 90]}, "bfloat16": {"eager": [37, 134]}}
AVX512F_XEON = {"float32": {"eager": [40, 92], "packed": [31, 45]}, "bfloat16": {"eager": [42, 123]}}


def _calibrated(monkeypatch, tmp_path, ms, width=8):
    """A calibration file holding `ms` for the tiny Llama's shape on this machine; returns the target."""
    from tiny import TARGETS

    target = TARGETS["llama"](seed=0)
    entry = {"width": width, "ms": ms, "seconds": 1.0}
    path = hardware.calibration_file()
    path.write_text(__import__("json").dumps({hardware.machine_key(): {hardware.target_key(target.config): entry}}))
    return target


@pytest.mark.parametrize("native", (True, False))
def test_a_calibration_decides_the_dtype_and_path_whatever_the_flags_say(monkeypatch, tmp_path, native):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware, "native_cpu_bf16", lambda: native)
    target = _calibrated(monkeypatch, tmp_path, AVX512F_XEON)
    # float32 was faster at every width on that Xeon: DFlash and plain both run it there, packed
    assert hardware.resolve_dtype("auto", config=target.config) == "float32"
    assert hardware.fastest_paths(hardware.cached_calibration(target.config)) == {
        "plain": ("float32", "packed"), "dflash": ("float32", "packed")}
    assert hardware.use_packed("float32", target.config)
    # training is not decided by decoding's figures
    assert hardware.resolve_dtype("auto", for_training=True, config=target.config) == (
        "bfloat16" if native else "float32")
    # the AVX2-only EPYC: one-token bfloat16 steps are the fastest, and at tau 2 its 8-token bf16 forward does not
    # pay, so DFlash runs where the plain steps it falls back to are cheapest
    target = _calibrated(monkeypatch, tmp_path, AVX2_EPYC)
    assert hardware.fastest_paths(hardware.cached_calibration(target.config)) == {
        "plain": ("bfloat16", "eager"), "dflash": ("bfloat16", "eager")}
    assert hardware.resolve_dtype("auto", config=target.config) == "bfloat16"


def test_the_calibrated_prior_prices_what_was_measured(monkeypatch, tmp_path):
    target = _calibrated(monkeypatch, tmp_path, AVX2_EPYC).to(torch.bfloat16)
    prior = hardware.cost_prior(target)
    # the EPYC's 16-token figures (37/253 ms) had given 0.38 a verified row; its 8-token ones give about the same
    assert prior["per_draft"] == pytest.approx(hardware.EMULATED_PER_DRAFT, abs=0.02)
    assert prior["draft"] == pytest.approx(hardware.EMULATED_DRAFT, abs=0.1)
    # nothing calibrated for float32 packed: the flags' prior, the native one
    from dflash_hf.packed import pack_linears

    assert hardware.cost_prior(pack_linears(target.float())) == {"draft": hardware.DRAFT,
                                                                 "per_draft": hardware.PER_DRAFT}


def test_calibrate_times_each_dtype_and_path_and_caches_the_figures(monkeypatch, tmp_path):
    from tiny import TARGETS

    config = TARGETS["qwen3"](seed=0).config
    loaded, said = [], []
    entry = hardware.calibrate(config, lambda dtype: loaded.append(dtype) or TARGETS["qwen3"](seed=0).to(
        getattr(torch, dtype)), width=4, repeats=2, say=said.append)
    assert loaded == ["float32", "bfloat16"]
    modes = ["eager", "packed"] if hardware.packed_ops_available() else ["eager"]
    assert all(list(entry["ms"][dtype]) == modes for dtype in loaded)
    assert all(0 < ms < 10_000 for paths in entry["ms"].values() for pair in paths.values() for ms in pair)
    assert hardware.cached_calibration(config) == entry  # read back from the file
    assert len(said) == 2 and "calibrated in" in said[1]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # another machine key: not this calibration
    assert hardware.cached_calibration(config) is None
