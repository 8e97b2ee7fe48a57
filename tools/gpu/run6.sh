#!/bin/bash
# GPU call 6 (after the seams: the colocate engine runs its batches on the trainer's thread): the gpu-marked tests,
# then bench step on the Qwen3-0.6B shape (3 timed steps, no peers).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graph_decode.py tests/test_handover.py tests/test_decode.py 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
timeout 110 python3 -m relax_hpc bench step --device cuda --cache /tmp/bs --json --shape qwen3-0.6b --steps 3 --peers none > $OUT/step06.json 2> $OUT/err.log
echo "rc=$?"; grep -E "Error|error:" $OUT/err.log | tail -4
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: (round(v,4) if isinstance(v,float) else v) for k,v in r.items() if k not in ('machine','per_step')}); print(r.get('per_step'))" $OUT/step06.json
