#!/bin/bash
# GPU call for the megatron backend (issue 16), the last of the session: one TP=2 layout sharing the GPU (first
# failure's output), the demo on CUDA (colocate against the torch backend, fully_async), bench trainer at the
# Qwen3-4B shape (2 x 4096). Carry [".whl"].
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONWARNINGS=ignore
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -x --tb=short --basetemp=/tmp/pt1 "tests/test_megatron_tp.py::test_two_ranks_match_hf_and_the_torch_backend[tied-cuda-shared]" > $OUT/tp.txt 2>&1
echo "tp rc=$?"; grep -E "Error|error|passed|failed" $OUT/tp.txt | grep -v Warning | tail -8
timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short --basetemp=/tmp/pt2 tests/test_megatron_colocate.py > $OUT/colocate.txt 2>&1
echo "colocate rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|failed:" $OUT/colocate.txt | tail -6
find /tmp/pt2 -name "*.log" -path "*logs*" | tar czf $OUT/role-logs.tgz -T - 2>/dev/null
timeout 110 python3 -m relax_hpc bench trainer --backend megatron --shape qwen3-4b --batch 2 --seq-len 4096 --iters 3 --json > $OUT/trainer4b.json 2> $OUT/trainer4b.err
echo "bench trainer 4b rc=$?"; grep -E "Error" $OUT/trainer4b.err | tail -3; cat $OUT/trainer4b.json
