#!/bin/bash
# GPU call 1: the gpu-marked tests, then bench step on the Qwen3-0.6B shape with both peers and a profile.
set -o pipefail
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graph_decode.py tests/test_handover.py tests/test_decode.py 2>&1 | tail -40 | tee $OUT/gputests.log
timeout 420 python3 -m relax_hpc bench step --shape qwen3-0.6b --device cuda --steps 3 --peers ${PEERS:-generate,trl} \
  --profile $OUT/prof06 --cache /tmp/bs --json > $OUT/step06.json 2> $OUT/step06.err
echo "bench rc=$?"
grep -v -E "Loading weights|Writing model" $OUT/step06.err | tail -25
cat $OUT/step06.json
