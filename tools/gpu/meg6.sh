#!/bin/bash
# GPU call for the megatron backend (issue 16), sixth: only the gpu tests that failed in meg5 (about 60-90 s on one
# H200, no bench). Carry [".whl"] (megatron_core 0.19.2 and psutil, which dist_checkpointing's writer needs).
#   tests/test_megatron_gpu.py: the varlen kernel; the distributed optimizer in bfloat16 (meg5: its
#     dist_checkpointing save failed, megatron's state map pointed at the wrong main weights because the RMSNorm
#     weights were float32 beside bfloat16 ones; now every parameter is in the model dtype);
#   test_megatron_tp.py [tied-cuda-shared]: TP=2 as two processes sharing the GPU over gloo (meg5: SIGSEGV with the
#     distributed optimizer; now the backend turns it off there with one warning, torch's AdamW as before).
# Writes $OUT/gpu-tests.txt. DRY_RUN=1: the same pytest command with --co on this CPU (collection only).
set -o pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
if [ "${DRY_RUN:-0}" = 1 ]; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  TESTS=(--co)
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit
  TESTS=()
fi
export PYTHONWARNINGS=ignore
python3 -c "import sys, torch, importlib.metadata as m; print(sys.version.split()[0], torch.__version__, \
'megatron-core', m.version('megatron-core'), 'cuda', torch.cuda.is_available())"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs --basetemp=/tmp/meg6-pt "${TESTS[@]}" \
  tests/test_megatron_gpu.py "tests/test_megatron_tp.py::test_two_ranks_match_hf_and_the_torch_backend[tied-cuda-shared]" \
  > "$OUT/gpu-tests.txt" 2>&1
rc=$?
echo "gpu tests rc=$rc"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|skipped|selected|collected|Error" "$OUT/gpu-tests.txt" | tail -12
exit $rc
