#!/bin/bash
# Issue 18 on nvidia-h200-x8 (or x4). Prepared and dry-run on the CPU; not yet run on GPUs.
#   tools/gpu/x8.sh [x8|x4] [STALENESS ...]   default: x8 1 2
#   device calls (each <= 10 min): 1) `bash tools/gpu/x8.sh x8 1`  2) `bash tools/gpu/x8.sh x8 2` (carry [".whl"]);
#   on nvidia-h200-x4 the same with x4. DRY_RUN=1 OUT=/tmp/x bash tools/gpu/x8.sh x4 1: on the CPU, tiny shapes.
# Qwen3-4B shape (random weights, real vocabulary), 64 prompts x 8 samples, 1024 new tokens per step:
#   colocate on all GPUs (trainer.num_ranks = GPUs, FSDP2, each rank generating its slice) against fully_async with
#   the trainer (FSDP2) on the first half of the GPUs and one hf rollout worker per GPU of the other half, fast path
#   auto (NCCL from trainer rank 0 to every worker), max_staleness as given. t_gen / t_train come from the
#   fully_async run itself (a trainer of several ranks has no single-process stand-in).
# Not prepared: scaling the rollout from 2 to 4 workers mid-run (relax-hpc scale) with step times before/after.
# Figures: $OUT/figures.jsonl, raw results $OUT/<run>.json, stderr $OUT/err.log.
source "$(dirname "$0")/mgpu_lib.sh"
KIND=${1:-x8}
shift
case $KIND in x8) N=8 ;; x4) N=4 ;; *) echo "error: first argument x8 or x4, not $KIND" >&2; exit 2 ;; esac
STALE=("$@")
[ ${#STALE[@]} -eq 0 ] && STALE=(1 2)
BATCH=(--set rollout.prompts_per_step=64 --set rollout.batch_prompts=16 --set rollout.n_samples=8
       --set rollout.sampling.max_new_tokens=1024 --set trainer.micro_batch_tokens=16384)
# the dry run's tiny batch (mgpu_lib.sh), with a prompt for every colocate rank (a rank with none has nothing to train)
[ -n "$DRY_RUN" ] && BATCH=(--set rollout.prompts_per_step=$N)
for s in "${STALE[@]}"; do
    case $s in 1|2) ;; *) echo "error: max_staleness $s: give 1 or 2" >&2; exit 2 ;; esac
    pipeline "$KIND-qwen3-4b-staleness$s" 570 4 --gpus $N --shape "$(shape_of qwen3-4b)" \
        --set max_staleness=$s "${BATCH[@]}"
done
