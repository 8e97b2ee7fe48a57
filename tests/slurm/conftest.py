"""Fixtures of the Slurm tier: the local cluster (skipped, or failed under RELAX_REQUIRE_SLURM=1, when none
answers) and run dirs whose jobs are cancelled by id at teardown."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from relax_hpc.fsio import read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.rundir import RunDir


@pytest.fixture(scope="module")
def cluster() -> None:
    from relax_hpc.bench.slurm import use_local_cluster

    use_local_cluster()  # SLURM_CONF of tools/slurm_local.sh's cluster, when unset
    problem = slurm_cli.slurm_problem(timeout_s=10)
    if problem is None:
        return
    msg = f"no Slurm cluster answers ({problem}); start one with: tools/slurm_local.sh start"
    if os.environ.get("RELAX_REQUIRE_SLURM") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture
def submitted(cluster: None) -> Iterator[list[RunDir]]:
    """Run dirs whose recorded jobs are cancelled (by id) at teardown, whatever happened."""
    rds: list[RunDir] = []
    yield rds
    ids = [e["job_id"] for rd in rds for e in (read_json(rd.launch_record, default={}) or {}).get("jobs", [])]
    slurm_cli.scancel(ids)
