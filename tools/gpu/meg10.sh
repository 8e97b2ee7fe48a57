#!/bin/bash
# GPU call for the megatron backend (issue 16), tenth: everything of the issue not yet run on a GPU, in one call
# (about 8 minutes on one H200). Carry [".whl"].
#   1. tools/gpu/meg9.sh: the bf16 dist_checkpointing test and a CUDA colocate run resumed from a dist checkpoint;
#   2. the GPU cases of the end-to-end tests: the colocate demo against the torch backend (first step within
#      low-precision noise, every step's reward), fully_async with the hf engine, PP = 2 as two processes sharing
#      the GPU over gloo (test_megatron_pp.py [tied-cuda-shared]).
# Writes $OUT/gpu-tests.txt, $OUT/run.txt (meg9) and $OUT/e2e-tests.txt. DRY_RUN=1: on this CPU, collection only.
set -o pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
bash "$(dirname "$0")/meg9.sh"
TESTS=()
if [ "${DRY_RUN:-0}" = 1 ]; then TESTS=(--co); else export PYTHONPATH=/tmp/site:$PWD; fi
export PYTHONWARNINGS=ignore
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs --basetemp=/tmp/meg10-pt "${TESTS[@]}" \
  "tests/test_megatron_colocate.py" "tests/test_megatron_pp.py" > "$OUT/e2e-tests.txt" 2>&1
echo "e2e gpu tests rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|skipped|selected|collected" "$OUT/e2e-tests.txt" | tail -8
