#!/usr/bin/env bash
# The test suite on a fresh machine: install, start a single-machine Slurm cluster (as root), run pytest.
#   bash tools/test.sh [pytest args]
# Without root (no Slurm install possible), Slurm tests are skipped unless RELAX_REQUIRE_SLURM=1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/install.sh
if [ "$(id -u)" = 0 ] && [ "${RELAX_NO_SLURM:-0}" != 1 ]; then
  bash tools/slurm_local.sh start
  export RELAX_SLURM_ENV=${RELAX_SLURM_DIR:-/tmp/relax-slurm}/slurm.env
fi
exec python3 -m pytest -q "$@"
