"""What the machine computes fast: the CPU's features, the dtype DFlash runs in, the dtypes plain decoding is
compared in.

On a CPU the fastest plain decoding may be float32 or bfloat16. Measured for SmolLM2-135M (2 cores, forward
over 1/2/4/8/16 tokens, ms): on an AMD EPYC with AVX2 alone a one-row bfloat16 matmul has a fast path but wider
ones are emulated, 37/49/77/134/253 against float32's 56/94/98/90/108; on a Xeon with AVX512-BF16 one session
measured 64/68/79/84/93 against 90/145/139/146/178, while on another Xeon with AVX512-BF16 and AMX plain
float32 decoded faster than bfloat16 (24.7 against 22.2 tok/s) although its wide bfloat16 forwards stayed far
cheaper. So a speedup is only honest against every plain dtype, each timed (`plain_dtypes`).
"""

from __future__ import annotations

import functools
import platform

import torch

from .generation.policy import native_cpu_bf16

# the /proc/cpuinfo flags that decide how fast bfloat16 and float32 matmuls run
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


@functools.cache  # read once a process: describe_cpu and resolve_dtype both ask
def _cpuinfo() -> tuple[str, list[str]]:
    try:
        with open("/proc/cpuinfo") as info:
            lines = info.read().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU", []
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return name, flags


def cpu_features() -> list[str]:
    """Which of `CPU_FLAGS` this CPU has (from /proc/cpuinfo; torch's probes where that is missing)."""
    _, flags = _cpuinfo()
    if flags:
        return [flag for flag in CPU_FLAGS if flag in flags]
    found = []
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        found.append("avx2")
    if native_cpu_bf16():
        found.append("avx512_bf16")
    return found


def describe_cpu() -> str:
    """`"<model name> (avx2, avx512_bf16; 2 threads)"`: what every speed figure should be quoted with."""
    name, _ = _cpuinfo()
    return f"{name} ({', '.join(cpu_features()) or 'no avx2'}; {torch.get_num_threads()} threads)"


def describe_device(device: torch.device) -> str:
    """`describe_cpu()` on a CPU, else the accelerator's name: what a speed figure is quoted with."""
    return describe_cpu() if device.type == "cpu" else torch.cuda.get_device_name(device)


def resolve_dtype(dtype: str, device: str | None = None, for_training: bool = False) -> str:
    """The dtype DFlash (and a target loaded for it) runs in; `"auto"` picks it by the hardware:

    - CUDA: `"bfloat16"` where the GPU has it, else `"float32"`.
    - a CPU with AVX512-BF16 or AMX: `"bfloat16"` (native: a verify forward over several tokens costs little
      more than one; on a Xeon whose plain float32 decoding was the faster, DFlash still ran 1.62x over it in
      bfloat16 against 1.38x in float32 on code).
    - a CPU with AVX2 alone: `"bfloat16"` too. Its one-token steps are the fastest plain decoding there, and
      DFlash's adaptive verify length prices the emulated wider forwards as such (`generation.policy.cost_prior`)
      and learns what they cost, so that it falls back to those one-token steps where drafting does not pay:
      the default is never far below the fastest plain configuration. In float32 every step, drafted or not,
      costs 1.5x a bfloat16 token there.
    - any other CPU: `"float32"`.

    `for_training`: training runs forwards over whole sequences, which a CPU with AVX2 alone emulates in
    bfloat16, so there it gets `"float32"`.
    """
    if dtype != "auto":
        return dtype
    if (device or "cpu").startswith("cuda") or (device is None and torch.cuda.is_available()):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if native_cpu_bf16() or ("avx2" in cpu_features() and not for_training):
        return "bfloat16"
    return "float32"


def plain_dtypes(device: str | None = None) -> list[str]:
    """The dtypes plain `generate` is timed in (besides DFlash's own) to find the fastest plain configuration:
    float32 and bfloat16 on a CPU (either can be the faster there); on a GPU its half-precision type alone
    (float32 is never the fast one there, and a second copy of a large target in float32 may not fit)."""
    if (device or "cpu").startswith("cuda") or (device is None and torch.cuda.is_available()):
        return ["bfloat16" if torch.cuda.is_bf16_supported() else "float16"]
    return ["float32", "bfloat16"]


__all__ = ["CPU_FLAGS", "cpu_features", "describe_cpu", "describe_device", "plain_dtypes", "resolve_dtype"]
