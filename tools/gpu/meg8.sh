#!/bin/bash
# GPU call for the megatron backend (issue 16), eighth: after meg7, the packed boundaries travel as the GPT's
# attention_mask (recompute-safe) and a single replica skips megatron's DP sync on the CPU. Carry [".whl"].
#   1. gpu-marked megatron tests (as meg7) and the GPU colocate demo run against the torch backend;
#   2. bench trainer --backend megatron, eager: Qwen3-0.6B 8 x 2048 (the >= 1.1x target) and Qwen3-4B 2 x 4096
#      (the >= torch's MFU target), two warm-up steps per path.
# Writes $OUT/gpu-tests.txt, trainer06b.json/.err, trainer4b.json/.err. DRY_RUN=1: on this CPU, collection only.
set -o pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
if [ "${DRY_RUN:-0}" = 1 ]; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  TESTS=(--co) S06=(--shape tiny --batch 8 --seq-len 64 --iters 1 --warmup 0) S4=("${S06[@]}")
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit
  TESTS=() S06=(--shape qwen3-0.6b --batch 8 --seq-len 2048 --iters 10 --warmup 2)
  S4=(--shape qwen3-4b --batch 2 --seq-len 4096 --iters 6 --warmup 2)
fi
export PYTHONWARNINGS=ignore
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs --basetemp=/tmp/meg8-pt "${TESTS[@]}" \
  tests/test_megatron_gpu.py "tests/test_megatron_tp.py::test_two_ranks_match_hf_and_the_torch_backend[tied-cuda-shared]" \
  "tests/test_megatron_colocate.py::test_demo_colocate_with_megatron_matches_the_torch_backend[cuda]" \
  > "$OUT/gpu-tests.txt" 2>&1
echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|skipped|selected|collected" "$OUT/gpu-tests.txt" | tail -8
for s in 06b 4b; do
  if [ $s = 06b ]; then args=("${S06[@]}"); else args=("${S4[@]}"); fi
  timeout 200 python3 -m relax_hpc bench trainer --backend megatron "${args[@]}" --json > "$OUT/trainer$s.json" 2> "$OUT/trainer$s.err"
  echo "bench trainer $s rc=$?"; grep -E "Error" "$OUT/trainer$s.err" | tail -3
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: round(v, 4) if isinstance(v, float) else v \
for k, v in d.items() if 'tokens_per_s' in k or 'mfu' in k or 'vs' in k or 'memory' in k})" "$OUT/trainer$s.json"
done
