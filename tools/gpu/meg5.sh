#!/bin/bash
# GPU call for the megatron backend (issue 16), fifth: megatron's distributed optimizer (the default of
# trainer.megatron.distributed_optimizer) on CUDA, then both backends' training speed at the two shapes of the issue
# with a real warm-up. Carry [".whl"] (megatron_core 0.19.2 and psutil, which dist_checkpointing's writer needs).
# About 5 minutes on one H200. Writes to $OUT: gpu-tests.txt, trainer06b.json/.err, trainer4b.json/.err.
#   1. gpu-marked megatron tests: the varlen kernel, the distributed optimizer in bfloat16 (steps like torch's AdamW
#      within bf16 rounding; dist_checkpointing and the project's checkpoint resume bit for bit), TP=2 as two
#      processes sharing the GPU over gloo (now with the distributed optimizer);
#   2. bench trainer --backend megatron, Qwen3-0.6B 8 x 2048 and Qwen3-4B 2 x 4096, one warm-up step per path.
# DRY_RUN=1: the same commands on this CPU (tests collected only, tiny shape, 1 step), to check that they parse.
set -o pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
if [ "${DRY_RUN:-0}" = 1 ]; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  TESTS=(--co) SHAPE06=(--shape tiny --batch 8 --seq-len 64 --iters 1 --warmup 0) SHAPE4=("${SHAPE06[@]}")
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit
  TESTS=() SHAPE06=(--shape qwen3-0.6b --batch 8 --seq-len 2048 --iters 10 --warmup 1)
  SHAPE4=(--shape qwen3-4b --batch 2 --seq-len 4096 --iters 6 --warmup 1)
fi
export PYTHONWARNINGS=ignore
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short --basetemp=/tmp/meg5-pt "${TESTS[@]}" \
  tests/test_megatron_gpu.py "tests/test_megatron_tp.py::test_two_ranks_match_hf_and_the_torch_backend[tied-cuda-shared]" \
  > "$OUT/gpu-tests.txt" 2>&1
echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|skipped|selected|collected" "$OUT/gpu-tests.txt" | tail -6
timeout 100 python3 -m relax_hpc bench trainer --backend megatron "${SHAPE06[@]}" --json > "$OUT/trainer06b.json" 2> "$OUT/trainer06b.err"
echo "bench trainer 0.6b rc=$?"; grep -E "Error" "$OUT/trainer06b.err" | tail -3; cat "$OUT/trainer06b.json"
timeout 150 python3 -m relax_hpc bench trainer --backend megatron "${SHAPE4[@]}" --json > "$OUT/trainer4b.json" 2> "$OUT/trainer4b.err"
echo "bench trainer 4b rc=$?"; grep -E "Error" "$OUT/trainer4b.err" | tail -3; cat "$OUT/trainer4b.json"
