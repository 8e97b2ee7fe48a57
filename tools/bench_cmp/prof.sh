#!/usr/bin/env bash
set -e
# cProfile of 200 colocate demo steps, base (cb7e445 worktree at /tmp/base, see ab.sh) or new: bash prof.sh base|new
# -> /tmp/ab/prof-SIDE.pstats
side=$1; src=$(cd "$(dirname "$0")/../.." && pwd); [ $side = base ] && src=/tmp/base
rd=/tmp/ab/prof-$side; rm -rf $rd
cd $src
PYTHONPATH=$src python3 -m relax_hpc submit recipes/demo.yaml --executor local --set mode=colocate --set num_steps=200 ${EXTRA:-} --run-dir $rd --dry-run >/dev/null
mod=relax_hpc.roles.entry; [ $side = base ] && mod=relax_hpc.roles
PYTHONPATH=$src python3 -c "
import cProfile, pstats, sys
from $mod import run_role
cProfile.run('run_role(\"$rd\", \"colocate\", 0)', '/tmp/ab/prof-$side.pstats')
" > /tmp/ab/prof-$side.out 2>&1
