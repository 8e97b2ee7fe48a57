#!/bin/bash
# GPU call for the megatron backend (issue 16), after the first two: the gpu-marked tests again (role logs of
# failed runs kept), `bench step --backend megatron` at the Qwen3-0.6B shape, `bench trainer --backend megatron`
# at the Qwen3-4B shape (4 x 4096). Carry [".whl"].
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONWARNINGS=ignore
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider --basetemp=/tmp/pt tests/test_megatron_gpu.py tests/test_backend_cuda.py \
  tests/test_megatron_tp.py tests/test_megatron_colocate.py > $OUT/tests.txt 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests.txt | tail -12
find /tmp/pt -name "*.log" -path "*logs*" | tar czf $OUT/role-logs.tgz -T - 2>/dev/null
timeout ${STEP_S:-170} python3 -m relax_hpc bench step --backend megatron --device cuda --cache /tmp/bs --json --shape qwen3-0.6b --steps 3 --peers none > $OUT/step06-megatron.json 2> $OUT/step06.err
echo "bench step rc=$?"; grep -E "Error|error:" $OUT/step06.err | tail -4
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: (round(v,4) if isinstance(v,float) else v) for k,v in r.items() if k not in ('machine','per_step')}); print(r.get('per_step'))" $OUT/step06-megatron.json
timeout ${BENCH_S:-180} python3 -m relax_hpc bench trainer --backend megatron --shape qwen3-4b --batch 4 --seq-len 4096 --iters 3 --json > $OUT/trainer4b.json 2> $OUT/trainer4b.err
echo "bench trainer 4b rc=$?"; grep -E "Error" $OUT/trainer4b.err | tail -3; cat $OUT/trainer4b.json
