#!/usr/bin/env bash
# The checks that need a GPU, in one run of at most ~9.5 minutes (the device tool lends a GPU for
# 15 minutes a session, 10 minutes a command): the kernel tests on CUDA, where a step's time goes on a
# random Qwen3-8B-shaped target in bf16 (forwards vs the rest, syncs per step, eager vs compiled),
# DFlash greedy equality on CUDA with tiny in-process targets, kernel-vs-PyTorch timings, and the batch table.
# Results go to $OUT (default ./device-check).
#
#     bash scripts/device_check.sh            # from the repository root, on a machine with CUDA
#     python benchmarks/device_step.py --shape tiny --device cpu --compile-layers 0   # its step part, dry run
#     python benchmarks/device_batch.py --shape tiny --device cpu                       # its batch part, dry run
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-device-check}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 DFLASH_TEST_DEVICE=cuda TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

python - <<'PY' 2>&1 | tee "$OUT/environment.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__,
      "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))
PY

# 1. The kernel against its reference per dtype, and the drafter/generate paths through it, on CUDA.
timeout 130 python -m pytest -q tests/test_kernels.py tests/test_kernel_loading.py -p no:cacheprovider \
    --junitxml="$OUT/kernel-tests.xml" 2>&1 | tee "$OUT/kernel-tests.txt" || status=1

# 2. A step on an 8B-shaped target, bf16: the share outside the forwards (goal <= 5 %), syncs per step,
#    eager (36 layers) and eager vs compiled static (4 layers, so that compiling fits the minutes).
timeout 170 python benchmarks/device_step.py --json "$OUT/step.json" 2>&1 | tee "$OUT/step.txt" || status=1

# 3. Greedy DFlash equals plain greedy generate on CUDA, tiny targets of each family, fp32 and bf16.
timeout 90 python - <<'PY' 2>&1 | tee "$OUT/greedy-equality.txt" || status=1
import sys, torch
sys.path.insert(0, "tests")
import tiny, dflash_hf
failures = 0
for name in ("qwen3_target", "llama_target"):
    for dtype in (torch.float32, torch.bfloat16):
        target = dflash_hf.enable(getattr(tiny, name)().to("cuda", dtype))
        for seed in range(4):
            prompt = torch.randint(0, tiny.VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(seed)).cuda()
            plain = target.generate(prompt, max_new_tokens=40, do_sample=False)
            script = target.generate(prompt, max_new_tokens=48, do_sample=False)
            oracle = tiny.drafter(seed, cls=tiny.OracleDrafter, block_size=8).arm(script, target.get_output_embeddings())
            oracle = oracle.to("cuda", dtype)
            for drafter in (tiny.drafter(seed, block_size=8).to("cuda", dtype), oracle):
                out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter,
                                      return_dict_in_generate=True)
                same = torch.equal(out.sequences, plain)
                failures += not same and dtype == torch.float32  # bf16 may round a k-token verify differently
                print(f"{name} {dtype} seed {seed} {type(drafter).__name__}: identical={same} "
                      f"tau={out.dflash_stats.mean_acceptance_length:.2f}")
print("fp32 failures:", failures)
sys.exit(1 if failures else 0)
PY

# 4. Kernel vs PyTorch timings at the published drafters' shapes (block attention and verification).
timeout 100 python benchmarks/kernel_timings.py --json "$OUT/kernel_timings.json" 2>&1 | tee "$OUT/kernel-timings.txt" || status=1

# 5. Batches on the 8B-shaped target: plain batched generate vs DFlash (full block, adaptive) at B = 1, 4, 8, 16,
#    and the tau per row each batch size needs for DFlash to pay (last: a cut-off run keeps sections 1-4).
timeout 100 python benchmarks/device_batch.py --json "$OUT/batch.json" 2>&1 | tee "$OUT/batch.txt" || status=1

echo "device check finished with status $status; results in $OUT"
exit $status
