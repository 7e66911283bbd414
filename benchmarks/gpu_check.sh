#!/bin/sh
# The checks of the CUDA paths, on a machine with a CUDA GPU (docs/async.md, "On a GPU"), from the
# repository root:  sh benchmarks/gpu_check.sh [LOG_FOLDER]
#  1. the tests that run on CUDA where it is visible: the example job stopped and resumed on the GPU
#     in every async mode (bit-identical losses, the same HF export bytes), steps moved between the
#     GPU and the CPU, staging on the side stream with the optimizer's step right after save();
#  2. the example job under torchrun on the GPU (NCCL beside gloo), stopped and resumed;
#  3. benchmarks.overhead on one GPU: the checkpoint's cost to training, every path side by side.
# Each part has its own time limit, so one that hangs leaves the others' logs.
# It runs in the package's test environment with its bench extra (pip install -e '.[test,bench]').
# A GPU machine without network access that had torch, pytest and transformers lacked three
# wheels; fetch them where there is network, for its Python:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       torchdata==0.11.0 isal==1.9.1 torch_checkpointing==0.1.1
# and there, before this script:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -u
PY=${PYTHON:-python3}
LOGS=${1:-/tmp/gpu_check}
DUMP=$(mktemp -d)
mkdir -p "$LOGS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
$PY -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'

echo "== 1. tests on CUDA"
PARALLEL=$($PY -c 'import xdist' 2>/dev/null && echo "-n 6")  # pytest-xdist, where installed
timeout 180 $PY -m pytest -q -p no:cacheprovider -rs $PARALLEL tests/test_on_device.py tests/test_zero_overhead.py \
    -k cuda 2>&1 | tee "$LOGS/tests.txt" | tail -15

echo "== 2. the example job under torchrun on the GPU, stopped at step 10 and resumed"
for stop in "--training.stop_at_step 10" ""; do
    timeout 60 $PY -m torch.distributed.run --standalone --nproc_per_node 1 -m torchtitan_ckpt.example.train \
        --config configs/debug_model.toml --job.dump_folder "$DUMP/job" --training.device cuda \
        --checkpoint.async_mode async_with_pinned_mem $stop 2>&1
done > "$LOGS/job.txt"
grep -E "on 1 rank|loaded|saved step|done at|rror" "$LOGS/job.txt" | cut -c1-160

echo "== 3. the checkpoint's cost to training on the GPU"
# a save every 10 steps of ~0.15 s on an H200: each save is durable before the next one starts.
# PyTorch's dcp.async_save runs alone after the others: on torch 2.11 its pinned stager failed on
# this state (KeyError: <class 'type'>), which must not cost the other rows.
for paths in disabled,async,async_with_pinned_mem,torch_checkpointing disabled,dcp; do
    timeout 150 $PY -m benchmarks.overhead --device cuda --ranks 1 --batch 8 --seq 1024 --every 10 --saves 2 \
        --rounds 2 --paths $paths --dir "$DUMP" > "$LOGS/overhead-${paths##*,}.txt" 2>&1
    grep -A12 "^checkpoint cost" "$LOGS/overhead-${paths##*,}.txt" || tail -5 "$LOGS/overhead-${paths##*,}.txt"
done
rm -rf "$DUMP"
