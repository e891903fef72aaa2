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


def test_plain_decoding_is_timed_in_both_dtypes_on_a_cpu_and_in_half_precision_on_a_gpu(monkeypatch):
    assert hardware.plain_dtypes("cpu") == ["float32", "bfloat16"]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert hardware.plain_dtypes("cuda:0") == ["float16"]
    assert hardware.resolve_dtype("auto", "cuda:0") == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert hardware.plain_dtypes("cuda:0") == ["bfloat16"] and hardware.resolve_dtype("auto", "cuda:0") == "bfloat16"
