#!/usr/bin/env bash
# The test suite on a fresh machine: install, start a single-machine Slurm cluster (as root), run pytest.
#   bash tools/test.sh [pytest args]
# Without root (no Slurm install possible), Slurm tests are skipped unless RELAX_REQUIRE_SLURM=1; likewise the
# network-filesystem tests unless RELAX_REQUIRE_NETFS=1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/install.sh --vllm  # with the vLLM server venv: the vllm engine tests run real servers
if [ "$(id -u)" = 0 ] && [ "${RELAX_NO_SLURM:-0}" != 1 ]; then
  bash tools/slurm_local.sh start
  export RELAX_SLURM_ENV=${RELAX_SLURM_DIR:-/tmp/relax-slurm}/slurm.env
fi
# The network-filesystem tier (tests/test_netfs.py): sshfs over loopback, as root (FUSE + a private sshd).
if [ "$(id -u)" = 0 ] && [ "${RELAX_NO_NETFS:-0}" != 1 ]; then
  bash tools/netfs.sh start
fi
exec python3 -m pytest -q "$@"
