#!/bin/bash
# GPU call for megatron's dist_checkpointing as the run loop's checkpoint format (trainer.megatron.checkpoint_format:
# dist, the default with the distributed optimizer), on megatron-core 0.19.2 and the GPU machine's torch. Carry
# [".whl"].
#   1. the bf16 distributed-optimizer test (its dist_checkpointing load now goes through the allow-list unpickler);
#   2. the demo in colocate on CUDA with the megatron backend: 2 steps (a dist checkpoint at step 2), then the run
#      extended to 4 steps and resumed from it through `relax-hpc resume`; the resumed event, the layout of both
#      checkpoints, and no helper process of megatron's writer left behind.
# Writes $OUT/gpu-tests.txt, $OUT/run.txt. DRY_RUN=1: on this CPU, the test is collected and the run is on the CPU.
set -o pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
DEV=cuda TESTS=()
if [ "${DRY_RUN:-0}" = 1 ]; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  DEV=cpu TESTS=(--co)
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit
fi
export PYTHONWARNINGS=ignore
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs --basetemp=/tmp/meg9-pt "${TESTS[@]}" \
  "tests/test_megatron_gpu.py::test_distributed_optimizer_in_bfloat16_steps_and_resumes_bitwise" \
  > "$OUT/gpu-tests.txt" 2>&1
echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|skipped|selected|collected" "$OUT/gpu-tests.txt" | tail -5
RUN=/tmp/meg9-run
rm -rf "$RUN"
before=$(pgrep -fc "multiprocessing.spawn")
{
  timeout 240 python3 -m relax_hpc submit recipes/demo.yaml --executor local --run-dir "$RUN" --set num_steps=2 \
    --set warmup.steps=0 --set trainer.checkpoint_every=2 --set trainer.backend=megatron \
    --set trainer.device=$DEV --set rollout.device=$DEV
  echo "first run rc=$?"
  python3 - "$RUN" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
cfg = json.loads((run / "config.json").read_text())
cfg["num_steps"] = 4
(run / "config.json").write_text(json.dumps(cfg))
(run / "STATUS.json").unlink()
EOF
  timeout 240 python3 -m relax_hpc resume "$RUN" --wait
  echo "resumed run rc=$?"
  python3 - "$RUN" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
for step in (2, 4):
    d = run / "checkpoints" / f"step_{step:08d}"
    state = json.loads((d / "state.json").read_text())
    print(step, sorted(p.name for p in d.iterdir()), state.get("sharded", {}).get("format"),
          len(state.get("sharded", {}).get("files", {})), "files")
ev = [json.loads(x) for x in (run / "logs/events/colocate-0.jsonl").read_text().splitlines() if x.strip()]
print("resumed:", [e.get("message") for e in ev if e.get("event") == "resumed"])
print("status:", json.loads((run / "STATUS.json").read_text()))
EOF
} > "$OUT/run.txt" 2>&1
sleep 3
echo "writer helper processes: before $before, after $(pgrep -fc 'multiprocessing.spawn')" >> "$OUT/run.txt"
grep -E "rc=|^[24] |resumed:|status:|helper|Error" "$OUT/run.txt" | tail -12
