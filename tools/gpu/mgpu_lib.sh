#!/bin/bash
# Shared by tools/gpu/x2.sh and tools/gpu/x8.sh (sourced): the wheels, the dry-run switch, one pipeline run.
# On the GPU machine: carry .whl (the wheels of tools/gpu/run6.sh, plus megatron_core for x2.sh's megatron part:
#   pip download megatron-core==0.16.1 --no-deps --only-binary=:all: --python-version 3.12 -d .whl).
# DRY_RUN=1: on a CPU machine, tiny shapes, --device cpu (gloo): the command lines parse and the JSON comes out;
# no figure of a dry run means anything.
set -o pipefail
: "${OUT:?set OUT to the folder for the results}"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
cd "$REPO" || exit 1
SCRATCH=${SCRATCH:-/tmp/relax-mgpu}
mkdir -p "$SCRATCH" "$OUT"
ERR=$OUT/err.log
if [ -n "$DRY_RUN" ]; then
    DEV=cpu
    TINY=(--set rollout.prompts_per_step=2 --set rollout.batch_prompts=2 --set rollout.n_samples=2
          --set rollout.sampling.max_new_tokens=4 --set trainer.micro_batch_tokens=2048 --alone-iters 1)
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
else
    DEV=cuda
    TINY=()
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site:$REPO
    else
        export PYTHONPATH=$REPO
    fi
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader >> "$ERR" 2>&1
fi

# shape: the dry run's tiny stand-in for a real shape
shape_of() { if [ -n "$DRY_RUN" ]; then echo qwen3-tiny; else echo "$1"; fi; }

# pipeline NAME LIMIT_S STEPS ARGS...: one `bench pipeline --json` run -> $OUT/NAME.json and a figures line
# (ARGS after the dry run's tiny settings: a script's own --set wins)
pipeline() {
    local name=$1 limit=$2 steps=$3
    shift 3
    if [ -n "$DRY_RUN" ]; then steps=2; fi
    echo "== $name: bench pipeline --device $DEV --steps $steps $*" >> "$ERR"
    timeout "$limit" python3 -m relax_hpc bench pipeline --json --device "$DEV" --steps "$steps" \
        --cache "$SCRATCH/cache" --timeout-s "$limit" "${TINY[@]}" "$@" > "$OUT/$name.json" 2>> "$ERR"
    echo "{\"run\": \"$name\", \"rc\": $?}" >> "$OUT/figures.jsonl"
    python3 "$HERE/figures.py" "$name" "$OUT/$name.json" | tee -a "$OUT/figures.jsonl"
}

# parity LAYOUT: tests/megatron_tp_worker.py on two ranks (NCCL on two GPUs; gloo in the dry run) -> a figures line
# with the largest differences of logits, log-probs and gradients against the HF model / the torch backend
parity() {
    local layout=$1 dir=$SCRATCH/parity-$1
    rm -rf "$dir" && mkdir -p "$dir"
    echo "== megatron parity $layout on $DEV" >> "$ERR"
    MEGATRON_TP_DEVICE=$DEV PYTHONPATH=$PYTHONPATH:$REPO/tests timeout 300 python3 -m torch.distributed.run \
        --standalone --nproc-per-node 2 tests/megatron_tp_worker.py "$dir" "$layout" >> "$ERR" 2>&1
    local rc=$?
    python3 - "$layout" "$rc" "$dir" <<'PY' | tee -a "$OUT/figures.jsonl"
import json, sys
from pathlib import Path
layout, rc, d = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
ranks = [json.loads(p.read_text()) for p in sorted(d.glob("rank*.json"))]
keys = ("logits", "logprobs", "entropy", "grads", "weights_after")
line = {"run": f"megatron-parity-{layout}", "rc": rc, "ranks": len(ranks),
        **{f"max_{k}": max((r[k] for r in ranks if k in r), default=None) for k in keys},
        "tp_size": ranks[0]["tp_size"] if ranks else None, "dp_size": ranks[0]["dp_size"] if ranks else None,
        "loss_megatron": ranks[0]["loss_megatron"] if ranks else None,
        "loss_torch": ranks[0]["loss_torch"] if ranks else None}
print(json.dumps(line))
PY
}
