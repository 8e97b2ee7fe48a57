#!/usr/bin/env bash
# The demo on a fresh machine: install, then run recipes/demo.yaml locally (no Slurm, no GPU, no downloads).
#   bash tools/demo.sh                          # colocate
#   bash tools/demo.sh --set mode=fully_async   # trainer + 2 rollout workers
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/install.sh --demo  # the package and its train extra (torch CPU, transformers): nothing for tests
exec "${PYTHON:-python3}" -m relax_hpc submit recipes/demo.yaml --executor local "$@"
