#!/bin/bash
# GPU call 9 (issue 12): bench step with the compiled paths (fused head, compiled training layers, compiled decode)
# past their compilation (3 warm-up steps): Qwen3-0.6B at micro_batch_tokens 16384 (recompile reasons logged) and
# 40960 (one micro-batch per step), then the Qwen3-4B shape at the default 4096. Carry [".whl"].
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONWARNINGS=ignore
ALL="--fused-head --compile-layers --compiled-decode"
summ() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: (round(v,4) if isinstance(v,float) else v) for k,v in r.items() if k not in ('machine','per_step')}); [print({k: round(v,3) for k,v in s.items()}) for s in r['per_step']]" $1; }
one() {  # name timeout args...
  local name=$1 t=$2; shift 2
  timeout $t python3 -m relax_hpc bench step --device cuda --cache /tmp/bs --json --peers none "$@" > $OUT/$name.json 2> $OUT/err-$name.log
  echo "$name rc=$?"; grep -E "Error|error:|torch.compile failed|Traceback" $OUT/err-$name.log | tail -4
  summ $OUT/$name.json
}
TORCH_LOGS=recompiles one step06-all-mbt16k 200 --shape qwen3-0.6b --warmup-steps 3 --steps 8 $ALL
grep -A3 "Recompiling" $OUT/err-step06-all-mbt16k.log | cut -c1-250 | head -40
one step06-all-mbt40k 150 --shape qwen3-0.6b --warmup-steps 3 --steps 6 --micro-batch-tokens 40960 $ALL
one step4b-all-mbt4k 220 --shape qwen3-4b --warmup-steps 2 --steps 3 --micro-batch-tokens 4096 $ALL
