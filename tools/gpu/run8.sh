#!/bin/bash
# GPU call 8 (issue 12): the gpu tests of the compiled paths (fused LM head, compiled training layers in the CUDA
# backend suite, compiled decode layers inside the CUDA graphs), then bench step on the Qwen3-0.6B shape with all
# three on, and plain, on one warm machine (6 timed steps each, no peers). Carry [".whl"].
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONWARNINGS=ignore
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=line tests/test_logprobs.py tests/test_graph_decode.py \
  "tests/test_backend_cuda.py" -k "not megatron" > $OUT/tests.txt 2>&1
echo "tests rc=$?"; grep -E "passed|failed|^FAILED|Error" $OUT/tests.txt | tail -8
summ() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: (round(v,4) if isinstance(v,float) else v) for k,v in r.items() if k not in ('machine','per_step')}); [print({k: round(v,3) for k,v in s.items()}) for s in r['per_step']]" $1; }
for v in all plain; do
  flag=""; [ $v = all ] && flag="--fused-head --compile-layers --compiled-decode"
  timeout ${T:-200} python3 -m relax_hpc bench step --device cuda --cache /tmp/bs --json --shape qwen3-0.6b --steps 6 \
    --peers none $flag > $OUT/step06-$v.json 2> $OUT/err-$v.log
  echo "$v rc=$?"; grep -E "Error|error:|torch.compile failed|Traceback" $OUT/err-$v.log | tail -4
  summ $OUT/step06-$v.json
done
