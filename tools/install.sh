#!/usr/bin/env bash
# Install relax-hpc and what its demo and tests need, on a fresh machine (CPU). Idempotent.
#   bash tools/install.sh            # package + train/monitor/dev extras, CPU torch pinned
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import relax_hpc, torch, transformers, h5py, pytest" >/dev/null 2>&1 \
   || ! "$PY" -m pip show relax-hpc >/dev/null 2>&1; then
  echo "[install] pip install -e .[train,monitor,dev] (constraints: tools/constraints-cpu.txt)"
  "$PY" -m pip install -q --disable-pip-version-check -c tools/constraints-cpu.txt -e ".[train,monitor,dev]"
fi
"$PY" -c "import torch, relax_hpc; print(f'[install] relax-hpc {relax_hpc.__version__}, torch {torch.__version__}')"
