#!/bin/bash
# GPU call 3 (figures for docs/benchmarks.md): gpu tests; bench step at 0.6B (5 timed steps, profile), at 4B with
# micro_batch_tokens 4096 (default; profile) and 16384 (gradient checkpointing). At most 8 files come back.
set -o pipefail
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graph_decode.py tests/test_handover.py tests/test_decode.py 2>&1 | tail -4
bench() {  # name, limit, args...
  local name=$1 limit=$2; shift 2
  echo "=== $name $*" >> $OUT/err.log
  timeout $limit python3 -m relax_hpc bench step --device cuda --cache /tmp/bs --json "$@" > $OUT/$name.json 2>> $OUT/err.log
  echo "$name rc=$?"; grep -E "Error|error:" $OUT/err.log | tail -3
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: (round(v,4) if isinstance(v,float) else v) for k,v in r.items() if k not in ('machine','per_step')}); print(r.get('per_step'))" $OUT/$name.json
}
bench step06 150 --shape qwen3-0.6b --steps 5 --peers none --profile $OUT/p06
bench step4b 200 --shape qwen3-4b --steps 3 --peers none --micro-batch-tokens 4096 --profile $OUT/p4b
bench step4b16 150 --shape qwen3-4b --steps 2 --peers none --micro-batch-tokens 16384 --gradient-checkpointing
