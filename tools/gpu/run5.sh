#!/bin/bash
# GPU call 5: the gpu tests (background GPU checkpoint included); bench step at 0.6B with a background checkpoint
# every 2 steps.
set -o pipefail
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_handover.py tests/test_graph_decode.py 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
timeout 150 python3 -m relax_hpc bench step --device cuda --cache /tmp/bs --json --shape qwen3-0.6b --steps 4 --peers none --checkpoint-every 2 --async-checkpoint > $OUT/step06ck.json 2> $OUT/err.log
echo "rc=$?"; grep -E "Error|error:|checkpoint step" $OUT/err.log | tail -6
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: (round(v,4) if isinstance(v,float) else v) for k,v in r.items() if k not in ('machine','per_step')}); print(r.get('per_step'))" $OUT/step06ck.json
