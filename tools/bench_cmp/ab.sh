#!/usr/bin/env bash
# Summarise: python3 tools/bench_cmp/summ.py /tmp/ab/MODE-* (per run), python3 tools/bench_cmp/pairs.py /tmp/ab/MODE 12
# (paired differences; /tmp/ab/MODE-TAG with TAG); MODE=pipeline: python3 tools/bench_cmp/pipe_pairs.py /tmp/ab/pipeline-TAG 12
# A/B: base (cb7e445, before the seams) vs new (main), alternating (ABBA order). MODE colocate or fully_async: the demo
# (`submit recipes/demo.yaml`, STEPS steps, a run dir per rep); MODE pipeline: `relax-hpc bench pipeline --json
# --steps STEPS` (colocate against fully_async), its JSON per rep.
# usage: bash tools/bench_cmp/ab.sh MODE REPS STEPS   (START=k resumes at rep k; TAG=x names the outputs
#   MODE-x-SIDE-REP; EXTRA="--set k=v ..." adds settings, e.g. rollout.sampling.temperature=0: greedy decoding
#   gives both trees the same samples at every step, so the same work)
set -u
MODE=${1:-fully_async}; REPS=${2:-3}; STEPS=${3:-400}
OUTD=/tmp/ab; mkdir -p $OUTD
[ -d /tmp/base ] || git -C "$(dirname "$0")/../.." worktree add -f /tmp/base cb7e445 >/dev/null 2>&1
run() {  # run SRC OUT: one rep of one side
  if [ $MODE = pipeline ]; then
    timeout 900 python3 -m relax_hpc bench pipeline --json --steps $STEPS ${EXTRA:-} >$2.json 2>$2.err
  else
    rm -rf $2
    python3 -m relax_hpc submit recipes/demo.yaml --executor local --set mode=$MODE --set num_steps=$STEPS \
      ${EXTRA:-} --run-dir $2 >$2.out 2>&1
  fi
}
for r in $(seq ${START:-1} $REPS); do
  sides="base new"; [ $((r % 2)) = 0 ] && sides="new base"  # ABBA: a drift over the run favours neither side
  for side in $sides; do
    src=$(cd "$(dirname "$0")/../.." && pwd); [ $side = base ] && src=/tmp/base
    t0=$(date +%s.%N)
    (cd $src && export PYTHONPATH=$src && run $src $OUTD/$MODE${TAG:+-$TAG}-$side-$r)
    rc=$?
    t1=$(date +%s.%N)
    echo "$MODE $side $r rc=$rc wall=$(python3 -c "print(round($t1-$t0,1))") load=$(cut -d' ' -f1 /proc/loadavg)"
  done
done
