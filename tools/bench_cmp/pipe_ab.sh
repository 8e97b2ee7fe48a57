#!/usr/bin/env bash
# A/B of `relax-hpc bench pipeline` (colocate against fully_async on the demo): base (cb7e445, before the seams)
# against new (this tree), in ABBA order. Summarise: python3 tools/bench_cmp/pipe_pairs.py /tmp/ab/pipe-TAG REPS
# usage: TAG=x bash tools/bench_cmp/pipe_ab.sh REPS STEPS   (EXTRA="--set k=v ..." adds settings to both sides)
set -u
REPS=${1:-6}; STEPS=${2:-60}
OUTD=/tmp/ab; mkdir -p $OUTD
[ -d /tmp/base ] || git -C "$(dirname "$0")/../.." worktree add -f /tmp/base cb7e445 >/dev/null 2>&1
for r in $(seq ${START:-1} $REPS); do
  sides="base new"; [ $((r % 2)) = 0 ] && sides="new base"
  for side in $sides; do
    src=$(cd "$(dirname "$0")/../.." && pwd); [ $side = base ] && src=/tmp/base
    out=$OUTD/pipe${TAG:+-$TAG}-$side-$r
    (cd $src && PYTHONPATH=$src timeout 900 python3 -m relax_hpc bench pipeline --json --steps $STEPS ${EXTRA:-} \
       >$out.json 2>$out.err)
    echo "pipeline $side $r rc=$? load=$(cut -d' ' -f1 /proc/loadavg)"
  done
done
