#!/bin/bash
# Issue 17 on nvidia-h200-x2 (2 GPUs). Prepared and dry-run on the CPU; not yet run on GPUs.
#   tools/gpu/x2.sh [PART ...]     PART: p06 (Qwen3-0.6B), p4b (Qwen3-4B), megatron; default: p06 megatron
#   device calls (each <= 10 min): 1) `bash tools/gpu/x2.sh p06 megatron`  2) `bash tools/gpu/x2.sh p4b`
#   with carry [".whl"]; DRY_RUN=1 OUT=/tmp/x bash tools/gpu/x2.sh p06: the same commands on the CPU, tiny shapes.
# p06 / p4b (runs 1 and 2): colocate = trainer.num_ranks=2, FSDP2 over both GPUs, each rank generating its half of
#   the prompts; fully_async = trainer on GPU 0, one hf rollout worker on GPU 1, weights.fast_path=auto (NCCL);
#   then a fully_async run with weights.fast_path=off (the snapshot files) for the hand-over against NCCL.
#   Same steps, same seeds, bench step's batch (16 prompts x 8 samples, 256 new tokens).
# megatron (run 3): parity of TP=2 and of TP=1 x DP=2 over NCCL against HF and the torch backend
#   (tests/megatron_tp_worker.py, tiny fp32 model); the same pair with trainer.backend=megatron at TP=2 (trainer ranks on GPUs 0,1, the rollout
#   worker beside rank 1) and at TP=1 x DP=2: tokens/s and MFU of the trainer, both modes.
# Figures: $OUT/figures.jsonl (one JSON line per run), raw results $OUT/<run>.json, stderr $OUT/err.log.
source "$(dirname "$0")/mgpu_lib.sh"
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(p06 megatron)
for part in "${PARTS[@]}"; do
    case $part in
        p06) pipeline x2-qwen3-0.6b 280 12 --gpus 2 --shape "$(shape_of qwen3-0.6b)" --handover-files ;;
        p4b) pipeline x2-qwen3-4b 560 6 --gpus 2 --shape "$(shape_of qwen3-4b)" --handover-files --alone-iters 3 ;;
        megatron)
            parity tied  # TP=2 (logits, log-probs, gradients vs HF and the torch backend, tiny model, fp32)
            parity dp2   # TP=1 x DP=2
            for tp in 2 1; do
                pipeline "x2-megatron-tp$tp" 150 4 --gpus 2 --trainer-gpus 0,1 --rollout-gpus 1 \
                    --shape "$(shape_of qwen3-0.6b)" --set trainer.backend=megatron --set trainer.megatron.tp=$tp
            done ;;
        *) echo "error: unknown part $part (p06, p4b, megatron)" >&2; exit 2 ;;
    esac
done
