#!/bin/bash
# GPU call for the decode loop's own 4-D masks (rollout/decode.py, issue 10's ninth pass). Carry [".whl"].
#   1. the GPU tests of the decode paths: the loop against transformers.generate on CUDA, the CUDA-graph loop;
#   2. the loop on CUDA with its own masks against the model's mask building (forced off), Qwen3-0.6B-like layers
#      (hidden 1024, 4 layers, the real vocabulary size), 32 prompts x 8 samples, 64 tokens, bf16: the same tokens
#      and the time of each.
# Writes $OUT/gpu-tests.txt and $OUT/masks.txt.
set -o pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONWARNINGS=ignore
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs --basetemp=/tmp/dec1-pt \
  tests/test_decode.py tests/test_graph_decode.py > "$OUT/gpu-tests.txt" 2>&1
echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|skipped|selected|collected" "$OUT/gpu-tests.txt" | tail -5
timeout 200 python3 tools/gpu/own_masks.py > "$OUT/masks.txt" 2>&1
echo "masks rc=$?"; tail -5 "$OUT/masks.txt"
