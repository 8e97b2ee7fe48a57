#!/bin/bash
# GPU call 7 (issue 12, the fused LM head): the compiled-vs-eager head test, then bench step on the Qwen3-0.6B
# shape without and with trainer.fused_head (6 timed steps each, no peers), on one warm machine.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_logprobs.py 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
for v in plain fused; do
  flag=""; [ $v = fused ] && flag="--fused-head"
  timeout 200 python3 -m relax_hpc bench step --device cuda --cache /tmp/bs --json --shape qwen3-0.6b --steps 6 \
    --peers none $flag > $OUT/step06-$v.json 2> $OUT/err-$v.log
  echo "$v rc=$?"; grep -E "Error|error:|torch.compile failed" $OUT/err-$v.log | tail -4
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: (round(v,4) if isinstance(v,float) else v) for k,v in r.items() if k not in ('machine','per_step')})" $OUT/step06-$v.json
done
