#!/bin/bash
# GPU call for the megatron backend (issue 16), part 1: the gpu-marked megatron and backend tests (the conformance
# suite of both backends on CUDA, TP=2 as two processes sharing the GPU over gloo, the demo on CUDA in colocate
# against the torch backend and in fully_async, the varlen kernel), then `bench trainer --backend megatron` at the
# Qwen3-0.6B shape. Carry [".whl"] (megatron-core 0.19.2 and the project's pure-Python dependencies).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONWARNINGS=ignore
timeout ${TEST_S:-300} python3 -m pytest -q -m gpu -p no:cacheprovider --basetemp=/tmp/pt tests/test_megatron_gpu.py tests/test_backend_cuda.py \
  tests/test_megatron_tp.py tests/test_megatron_colocate.py > $OUT/tests.txt 2>&1
echo "tests rc=$?"; grep -E "passed|failed|error" $OUT/tests.txt | tail -3
timeout ${BENCH_S:-150} python3 -m relax_hpc bench trainer --backend megatron --shape qwen3-0.6b --json > $OUT/trainer06.json 2> $OUT/trainer06.err
echo "bench trainer 0.6b rc=$?"; tail -3 $OUT/trainer06.err; cat $OUT/trainer06.json
