#!/bin/bash
# GPU call for the megatron backend (issue 16), seventh: the packed micro-batch reaches the attention and RoPE
# through a Packing (no per-sequence RoPE loop, no host copy of the boundaries per layer), and trainer.compile_layers
# compiles megatron's TransformerLayers. Carry [".whl"] (megatron_core 0.19.2, psutil). About 6-8 minutes.
#   1. gpu-marked megatron tests: the varlen kernel; packed log-probs = the HF model's per sequence (bf16); compiled
#      layers train like the eager ones; the bf16 distributed optimizer + checkpoints; TP=2 as two processes sharing
#      the GPU over gloo (meg6's CPU-resume fix, never run on the GPU).
#   2. bench trainer --backend megatron at Qwen3-0.6B 8 x 2048: eager (with --profile: one profiled step of each
#      backend, tables in $OUT/prof06b/), then both backends with --compile-layers --fused-head.
# Writes $OUT/gpu-tests.txt, trainer06b-eager.json/.err, trainer06b-compiled.json/.err, prof06b/.
# DRY_RUN=1: the same commands on this CPU (tests collected only, tiny shape, 1 step), to check that they parse.
set -o pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
if [ "${DRY_RUN:-0}" = 1 ]; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  TESTS=(--co) SHAPE=(--shape tiny --batch 8 --seq-len 64 --iters 1 --warmup 0) WARM=(--warmup 0)
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit
  TESTS=() SHAPE=(--shape qwen3-0.6b --batch 8 --seq-len 2048 --iters 10 --warmup 2) WARM=(--warmup 4)
fi
export PYTHONWARNINGS=ignore
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs --basetemp=/tmp/meg7-pt "${TESTS[@]}" \
  tests/test_megatron_gpu.py "tests/test_megatron_tp.py::test_two_ranks_match_hf_and_the_torch_backend[tied-cuda-shared]" \
  > "$OUT/gpu-tests.txt" 2>&1
echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|skipped|selected|collected" "$OUT/gpu-tests.txt" | tail -8
for variant in eager compiled; do
  extra=(--profile "$OUT/prof06b"); [ $variant = compiled ] && extra=(--compile-layers --fused-head "${WARM[@]}")
  timeout 170 python3 -m relax_hpc bench trainer --backend megatron "${SHAPE[@]}" "${extra[@]}" --json \
    > "$OUT/trainer06b-$variant.json" 2> "$OUT/trainer06b-$variant.err"
  echo "bench trainer 0.6b $variant rc=$?"; grep -E "Error|warning" "$OUT/trainer06b-$variant.err" | tail -4
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: round(v, 4) if isinstance(v, float) else v \
for k, v in d.items() if 'tokens_per_s' in k or 'mfu' in k or 'vs' in k or 'memory' in k or 'busy' in k})" \
    "$OUT/trainer06b-$variant.json"
done
for f in "$OUT"/prof06b/*.txt; do [ -f "$f" ] && { echo "== $f"; head -30 "$f" | cut -c1-150; tail -1 "$f"; }; done
