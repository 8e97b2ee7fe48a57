#!/usr/bin/env bash
# Install relax-hpc (editable, from this checkout) and what its demo and tests need, on a fresh machine (CPU).
# Idempotent: where everything is already there, pip only re-points the package at this checkout.
#   bash tools/install.sh            # package + train/monitor/dev extras, CPU torch pinned
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
echo "[install] pip install -e .[train,monitor,dev] (constraints: tools/constraints-cpu.txt)"
"$PY" -m pip install -q --disable-pip-version-check -c tools/constraints-cpu.txt -e ".[train,monitor,dev]"
(cd / && "$PY" -c "import torch, relax_hpc; print(f'[install] relax-hpc {relax_hpc.__version__} from \
{relax_hpc.__path__[0]}, torch {torch.__version__}')")
