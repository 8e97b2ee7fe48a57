#!/bin/bash
# GPU call 2: gpu tests, decode-attention micro-benchmark, bench step at 0.6B and at 4B (micro-batch 16384 and 4096).
set -o pipefail
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graph_decode.py tests/test_handover.py tests/test_decode.py 2>&1 | tail -15 | tee $OUT/gputests.log
timeout 60 python3 tools/gpu/attn_micro.py 2>&1 | tee $OUT/attn_micro.txt
bench() {  # name, args...
  local name=$1; shift
  timeout ${LIMIT:-200} python3 -m relax_hpc bench step --device cuda --cache /tmp/bs --json "$@" > $OUT/$name.json 2> $OUT/$name.err
  echo "$name rc=$?"; grep -E "Error|error|Traceback" $OUT/$name.err | tail -5
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: (round(v,4) if isinstance(v,float) else v) for k,v in r.items() if k not in ('machine',)})" $OUT/$name.json
}
bench step06 --shape qwen3-0.6b --steps 3 --peers none --profile $OUT/p06
LIMIT=260 bench step4b --shape qwen3-4b --steps 3 --peers none --profile $OUT/p4b
LIMIT=160 bench step4b_4096 --shape qwen3-4b --steps 2 --peers none --micro-batch-tokens 4096
