"""OpenMP settings of the local launcher's role processes (relax_hpc.launch.local.thread_env)."""

from __future__ import annotations

from relax_hpc.launch.local import thread_env


def test_a_role_alone_gets_its_cpus_and_spinning_threads() -> None:
    assert thread_env({}, cpus_per_task=2, num_procs=1, cores=2) == {"OMP_NUM_THREADS": "2"}


def test_processes_share_the_cores_and_sleep_when_they_still_oversubscribe() -> None:
    # the fully_async demo: a trainer and two workers on two cores
    assert thread_env({}, cpus_per_task=2, num_procs=3, cores=2) == {"OMP_NUM_THREADS": "1",
                                                                   "OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_env({}, cpus_per_task=4, num_procs=2, cores=8) == {"OMP_NUM_THREADS": "4"}


def test_the_users_settings_stand() -> None:
    env = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
    assert thread_env(env, cpus_per_task=1, num_procs=3, cores=2) == {"OMP_NUM_THREADS": "3"}
    assert thread_env({"OMP_NUM_THREADS": "2"}, cpus_per_task=1, num_procs=2, cores=2)["OMP_WAIT_POLICY"] == "PASSIVE"
