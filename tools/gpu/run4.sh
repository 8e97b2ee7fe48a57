#!/bin/bash
# GPU call 4: gpu tests, then bench step at 0.6B with the final decoder (SDPA, one graph per stop-check interval).
set -o pipefail
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graph_decode.py tests/test_handover.py tests/test_decode.py 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
timeout 170 python3 -m relax_hpc bench step --device cuda --cache /tmp/bs --json --shape qwen3-0.6b --steps 4 --peers none --profile $OUT/p06 > $OUT/step06.json 2> $OUT/err.log
echo "rc=$?"; grep -E "Error|error:" $OUT/err.log | tail -3
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: (round(v,4) if isinstance(v,float) else v) for k,v in r.items() if k not in ('machine','per_step')}); print(r.get('per_step'))" $OUT/step06.json
