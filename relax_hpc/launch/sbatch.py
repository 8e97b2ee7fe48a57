"""Render a recipe's sbatch scripts from the Jinja templates in ``sbatch/`` (packaged as ``relax_hpc/sbatch``).

The jobs follow the mode's roles in the role table (:mod:`relax_hpc.roles.spec`); one template per job shape
(``job``: one role, every rank a task; ``array``: an elastic role, one array task per rank; ``hetjob``; ``sweep``),
none per role. With today's table, the placements (``mode`` and ``launch.placement``) are:

* ``colocate`` mode: one job, ``trainer.num_ranks`` tasks, every rank runs ``role colocate``;
* ``fully_async`` + ``hetjob``: ONE heterogeneous job, het group 0 the trainer (``trainer.num_ranks`` tasks), het
  group 1 the rollout workers (``rollout.num_workers`` tasks); each role is its own ``srun --het-group=K`` step;
* ``fully_async`` + ``separate``: a trainer job plus a job array with one task per rollout worker (task id = rank),
  linked only through the run dir (so workers can be added or removed later).

Resources come from each role's ``launch`` section (``launch.trainer`` / ``launch.rollout``). In ``separate``
placement each array task is ONE rollout worker (one task on one node): ``nodes``/``tasks_per_node`` of
``launch.rollout`` shape the het group only.
Nothing here submits anything; :mod:`relax_hpc.launch.slurm` does.
"""

from __future__ import annotations

import math
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from relax_hpc.config.schema import RecipeConfig, RoleResources
from relax_hpc.errors import UserError
from relax_hpc.launch.slurm_params import directive, extra_directives
from relax_hpc.roles import spec as roles
from relax_hpc.roles.spec import RoleSpec
from relax_hpc.rundir import RunDir, SweepDir

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class JobScript:
    """One rendered sbatch script: its file stem under ``RUN_DIR/slurm``, what it runs and its text."""

    name: str
    kind: str
    """``hetjob`` | ``trainer`` | ``rollout_array`` | ``colocate`` | ``sweep_array``."""
    roles: tuple[str, ...]
    text: str
    ranks: tuple[int, ...] = field(default=())
    """Rollout ranks this job runs (array task ids, or the het group's ranks)."""


def templates_dir() -> Path:
    """Folder of the templates: ``relax_hpc/sbatch`` (a link to ``sbatch/`` in a checkout, real files in a wheel)."""
    import relax_hpc

    pkg = Path(relax_hpc.__file__).resolve().parent
    for cand in (pkg / "sbatch", pkg.parent / "sbatch"):
        if (cand / "_base.sbatch.j2").is_file():
            return cand
    raise FileNotFoundError(f"relax-hpc's sbatch templates are missing (looked in {pkg / 'sbatch'})")


@lru_cache(maxsize=1)
def _env() -> Any:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda v: shlex.quote(str(v))
    return env


def render_template(name: str, **context: Any) -> str:
    """Render ``sbatch/<name>.sbatch.j2`` with ``context``."""
    return _env().get_template(f"{name}.sbatch.j2").render(**context)


# ------------------------------------------------------------------------------------------------ building blocks
def _check_path(path: Path, what: str) -> str:
    text = str(path)
    if "\n" in text or "\r" in text:
        raise UserError(f"{what} {text!r} contains a newline, which an sbatch script cannot express")
    return text


def _mem(mem_gb: float) -> str:
    return f"{int(mem_gb)}G" if float(mem_gb).is_integer() else f"{math.ceil(mem_gb * 1024)}M"


def _env_vars(res: RoleResources, where: str) -> dict[str, str]:
    for key in res.env:
        if not _ENV_NAME.match(key):
            raise UserError(f"{where}.env: {key!r} is not a valid environment variable name")
    return dict(res.env)


def _extra_lines(res: RoleResources, where: str) -> list[str]:
    out = []
    for line in res.extra_sbatch:
        line = line.strip()
        if line.startswith("#SBATCH"):
            line = line[len("#SBATCH"):].strip()
        if "\n" in line or "\r" in line or not line:
            raise UserError(f"{where}.extra_sbatch: {line!r} must be one non-empty line such as --reservation=rl")
        out.append(line)
    return out


def _directives(cfg: RecipeConfig, res: RoleResources, where: str, *, job_name: str, ntasks: int, nodes: int,
                tasks_per_node: int, head: list[str], time_min: int) -> list[str]:
    """The #SBATCH options of one job (or het component): job-wide ``head`` first, then this role's resources."""
    launch = cfg.launch
    if ntasks < nodes:
        raise UserError(f"{where}.nodes={nodes} but the role has only {ntasks} task(s): at least one task per node")
    if tasks_per_node > 1 and nodes * tasks_per_node < ntasks:
        raise UserError(f"{where}: nodes x tasks_per_node = {nodes * tasks_per_node} cannot hold {ntasks} tasks")
    d = [directive("job_name", job_name), *head,
         # USR2, not USR1: NCCL may catch USR1. Sent to the job steps (no B:), signal_delay_s before the limit.
         directive("signal", f"USR2@{launch.signal_delay_s}"), directive("time", time_min)]
    partition = res.partition or launch.partition
    if partition:
        d.append(directive("partition", partition))
    if launch.account:
        d.append(directive("account", launch.account))
    if launch.qos:
        d.append(directive("qos", launch.qos))
    d += [directive("nodes", nodes), directive("ntasks", ntasks)]
    if tasks_per_node > 1:
        d.append(directive("ntasks_per_node", tasks_per_node))
    d.append(directive("cpus_per_task", res.cpus_per_task))
    if res.gpus_per_node:
        d.append(directive("gpus_per_node", res.gpus_per_node))
    if res.mem_gb is not None:
        d.append(directive("mem", _mem(res.mem_gb)))
    if res.constraint:
        d.append(directive("constraint", res.constraint))
    try:
        d += extra_directives(res.slurm)
    except UserError as exc:
        raise UserError(f"{where}.slurm: {exc}") from None
    return d + _extra_lines(res, where)


def _job_head(chdir: Path, output_name: str, *, array: str | None = None) -> list[str]:
    head = [directive("chdir", _check_path(chdir, "folder")), directive("output", output_name),
            directive("open_mode", "append"), directive("requeue")]
    if array:
        head.append(directive("array", array))
    return head


def _step(res: RoleResources, where: str, srun_args: list[str]) -> dict[str, Any]:
    return {"srun_args": ["--unbuffered", *srun_args], "env": _env_vars(res, where)}


def _context(cfg: RecipeConfig, run_dir: str, *, title: str, python: str, pythonpath: str | None,
             components: list[list[str]], **more: Any) -> dict[str, Any]:
    return {"title": title, "components": components, "run_dir": run_dir, "python": python,
            "pythonpath": pythonpath, "setup": list(cfg.launch.setup), "max_requeues": cfg.launch.max_requeues,
            "role_names": roles.role_names(), **more}


def default_python() -> str:
    """The interpreter the jobs run (``RELAX_HPC_PYTHON``, else the one running this code, as submitit does)."""
    import os

    return os.environ.get("RELAX_HPC_PYTHON") or sys.executable


def default_pythonpath() -> str | None:
    """The source checkout holding ``relax_hpc`` when it is not installed (jobs need it on PYTHONPATH)."""
    import relax_hpc

    root = Path(relax_hpc.__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and "site-packages" not in root.parts:
        return str(root)
    return None


def as_run_dir(run_dir: RunDir | Path | str) -> RunDir:
    """A :class:`RunDir` from a RunDir or a path."""
    return run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5`` (a Slurm array spec)."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    start = prev = rs[0]
    for r in [*rs[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)


# ------------------------------------------------------------------------------------------------ per placement
def _prepare(run_dir: RunDir | Path | str, python: str | None, pythonpath: str | None
             ) -> tuple[RunDir, str, str, str | None]:
    rd = as_run_dir(run_dir)
    rd_text = _check_path(rd.root, "run dir")
    if pythonpath == "auto":
        pythonpath = default_pythonpath()
    return rd, rd_text, python or default_python(), pythonpath


def _role_directives(cfg: RecipeConfig, role: RoleSpec, *, job_name: str, ntasks: int, head: list[str],
                     one_per_task: bool = False) -> list[str]:
    """The #SBATCH options of ``role``: its resources, ``ntasks`` tasks (``one_per_task``: one task on one node)."""
    res = roles.resources(cfg, role)
    nodes, per_node = (1, 1) if one_per_task else (res.nodes, res.tasks_per_node)
    if res.launcher == "torchrun":  # one task per node: torchrun starts the node's ranks
        _check_torchrun(res, roles.resources_where(role), ntasks)
        res = res.model_copy(update={"cpus_per_task": res.cpus_per_task * res.tasks_per_node})
        ntasks, per_node = res.nodes, 1
    return _directives(cfg, res, roles.resources_where(role), job_name=job_name, ntasks=ntasks, nodes=nodes,
                       tasks_per_node=per_node, head=head, time_min=roles.time_limit_min(cfg, role))


def _check_torchrun(res: RoleResources, where: str, ranks: int) -> None:
    if res.nodes * res.tasks_per_node != ranks:
        raise UserError(f"{where}.launcher=torchrun: nodes x tasks_per_node = {res.nodes * res.tasks_per_node} "
                        f"processes but the role has {ranks} ranks; set tasks_per_node to the ranks per node")


def _role_step(cfg: RecipeConfig, role: RoleSpec, srun_args: list[str]) -> dict[str, Any]:
    """The srun arguments and environment of ``role``'s step, and the torchrun launch (None: srun starts every
    rank as a task)."""
    res = roles.resources(cfg, role)
    step = _step(res, roles.resources_where(role), srun_args)
    step["torchrun"] = None
    if res.launcher == "torchrun":
        step["srun_args"].append("--ntasks-per-node=1")
        step["torchrun"] = {"nnodes": res.nodes, "nproc_per_node": res.tasks_per_node, "port": res.torchrun_port,
                            "shutdown_timeout_s": cfg.launch.signal_delay_s}
    return step


def render_run(run_dir: RunDir | Path | str, cfg: RecipeConfig, *, python: str | None = None,
               pythonpath: str | None = "auto", rollout_ranks: Sequence[int] | None = None) -> list[JobScript]:
    """The sbatch scripts of a whole run, in submission order (the jobs follow the mode's roles in the role table).

    ``rollout_ranks`` (the elastic role's ranks) defaults to ``0 .. N - 1``; ``resume`` passes the ranks that were
    running. ``pythonpath="auto"`` adds the source checkout when relax-hpc is not installed.
    """
    mode = roles.mode_spec(cfg)
    if mode.single_job:
        return [render_role_job(run_dir, cfg, mode.main, python=python, pythonpath=pythonpath)]
    elastic = mode.elastic
    ranks: list[int] = []
    if elastic is not None:
        ranks = list(range(roles.num_ranks(cfg, elastic))) if rollout_ranks is None else sorted(set(rollout_ranks))
        if not ranks:
            raise UserError(f"a {mode.name} run needs at least one {elastic.noun}")
    if cfg.launch.placement == "hetjob":
        return [_render_hetjob(run_dir, cfg, mode, list(range(len(ranks))), python=python, pythonpath=pythonpath)]
    scripts = [render_role_job(run_dir, cfg, r, python=python, pythonpath=pythonpath, separate=True)
               for r in mode.roles if not r.elastic]
    if elastic is not None:
        scripts.append(render_role_array(run_dir, cfg, elastic, ranks, python=python, pythonpath=pythonpath))
    return scripts


def render_role_job(run_dir: RunDir | Path | str, cfg: RecipeConfig, role: RoleSpec, *, python: str | None = None,
                    pythonpath: str | None = "auto", separate: bool = False) -> JobScript:
    """One job running every rank of ``role`` (a single-role mode, or a fixed role of placement ``separate``)."""
    rd, rd_text, python, pythonpath = _prepare(run_dir, python, pythonpath)
    mode = roles.mode_spec(cfg)
    head = _job_head(rd.slurm, rd.slurm_output(role.name).name)
    comp = _role_directives(cfg, role, job_name=f"{cfg.name}-{role.name}" if separate else cfg.name,
                            ntasks=roles.num_ranks(cfg, role), head=head)
    where = f"{mode.name}, placement separate" if separate else f"mode {mode.name}"
    ctx = _context(cfg, rd_text, title=f"run {cfg.name!r}, {where}: {role.summary}", python=python,
                   pythonpath=pythonpath, components=[comp], role=role.name, note=role.sbatch_note.splitlines(),
                   main=_role_step(cfg, role, ["--kill-on-bad-exit=1"] if separate else []))
    return JobScript(role.name, role.name, (role.name,), render_template("job", **ctx))


def _render_hetjob(run_dir: RunDir | Path | str, cfg: RecipeConfig, mode: roles.ModeSpec, ranks: list[int], *,
                   python: str | None, pythonpath: str | None) -> JobScript:
    """ONE heterogeneous job: het group 0 the trainer-side role, het group 1 the other role (its ranks = task ids)."""
    rd, rd_text, python, pythonpath = _prepare(run_dir, python, pythonpath)
    main = mode.main
    others = [r for r in mode.roles if r is not main]
    if len(others) != 1:
        raise UserError(f"placement hetjob runs a trainer-side role and one more role; mode {mode.name} has "
                        f"{len(mode.roles)} roles: use launch.placement=separate")
    (helper,) = others
    n_helper = len(ranks) if helper.elastic else roles.num_ranks(cfg, helper)
    head = _job_head(rd.slurm, rd.slurm_output("hetjob").name)
    comp0 = _role_directives(cfg, main, job_name=cfg.name, ntasks=roles.num_ranks(cfg, main), head=head)
    comp1 = _role_directives(cfg, helper, job_name=cfg.name, ntasks=n_helper, head=[])
    title = (f"run {cfg.name!r}, {mode.name}, placement hetjob: het group 0 = {main.name}, "
             f"het group 1 = {n_helper} {helper.noun}(s)")
    ctx = _context(cfg, rd_text, title=title, python=python, pythonpath=pythonpath, components=[comp0, comp1],
                   rollout_grace_s=math.ceil(roles.rollout_grace_s(cfg)), main_role=main.name, helper_role=helper.name,
                   helper_noun=helper.noun,
                   main=_role_step(cfg, main, ["--het-group=0", "--kill-on-bad-exit=1"]),
                   helper=_role_step(cfg, helper, ["--het-group=1", "--kill-on-bad-exit=0"]))
    return JobScript("hetjob", "hetjob", (main.name, helper.name), render_template("hetjob", **ctx),
                     ranks=tuple(ranks) if helper.elastic else ())


def render_role_array(run_dir: RunDir | Path | str, cfg: RecipeConfig, role: RoleSpec, ranks: Sequence[int], *,
                      python: str | None = None, pythonpath: str | None = "auto") -> JobScript:
    """A job array of an elastic role, one task per rank (``--array`` = the ranks), for placement separate."""
    rd, rd_text, python, pythonpath = _prepare(run_dir, python, pythonpath)
    ranks = sorted(set(int(r) for r in ranks))
    if not ranks or ranks[0] < 0:
        raise UserError(f"{role.name} ranks must be >= 0, got {ranks}")
    spec = _ranges(ranks)
    head = _job_head(rd.slurm, rd.slurm_output(role.name, "%A_%a").name, array=spec)
    comp = _role_directives(cfg, role, job_name=f"{cfg.name}-{role.name}", ntasks=1, head=head, one_per_task=True)
    ctx = _context(cfg, rd_text, title=f"run {cfg.name!r}, {cfg.mode}, placement separate: {role.summary} "
                   f"{spec} (one array task each)", python=python, pythonpath=pythonpath, components=[comp],
                   role=role.name, note=role.sbatch_note.splitlines(),
                   main=_role_step(cfg, role, ["--ntasks=1"]))
    return JobScript(f"{role.name}-{ranks[0]}-{ranks[-1]}", f"{role.name}_array", (role.name,),
                     render_template("array", **ctx), ranks=tuple(ranks))


def render_rollout_array(run_dir: RunDir | Path | str, cfg: RecipeConfig, ranks: Sequence[int], *,
                         python: str | None = None, pythonpath: str | None = "auto") -> JobScript:
    """A job array of the mode's elastic role (the rollout workers), one task per rank, for placement separate."""
    elastic = roles.mode_spec(cfg).elastic
    if elastic is None:
        raise UserError(f"mode {cfg.mode} has no role whose ranks can be added")
    return render_role_array(run_dir, cfg, elastic, ranks, python=python, pythonpath=pythonpath)


def sweep_mode_problem(cfg: RecipeConfig) -> str | None:
    """Why a sweep cannot run ``cfg``'s mode as one job per combination (None: it can)."""
    if roles.mode_spec(cfg).sweepable:
        return None
    ok = [m.name for m in roles.MODES.values() if m.sweepable]
    return (f"a Slurm sweep runs each combination as one job of a single role: set mode: {ok[0]} "
            f"(or --set mode={ok[0]})")


def render_sweep(sweep_dir: SweepDir | Path | str, cfg: RecipeConfig, num_runs: int, *, parallel: int,
                 python: str | None = None, pythonpath: str | None = "auto") -> JobScript:
    """ONE job array for a sweep: task i runs combination i as one complete single-role run (at most ``parallel``
    at once).

    ``cfg`` is the first combination's config: resources, time and setup are the same for every task.
    """
    sd = sweep_dir if isinstance(sweep_dir, SweepDir) else SweepDir(sweep_dir)
    _check_path(sd.root, "sweep dir")
    problem = sweep_mode_problem(cfg)
    if problem:
        raise UserError(problem)
    if cfg.launch.trainer.launcher != "srun":
        raise UserError("a sweep starts its runs with srun: set launch.trainer.launcher: srun")
    if num_runs < 1:
        raise UserError("a sweep needs at least one combination")
    python = python or default_python()
    if pythonpath == "auto":
        pythonpath = default_pythonpath()
    role = roles.mode_spec(cfg).main
    array = f"0-{num_runs - 1}%{max(1, min(parallel, num_runs))}"
    head = _job_head(sd.slurm, sd.slurm_output().name, array=array)
    comp = _role_directives(cfg, role, job_name=f"{cfg.name}-sweep", ntasks=roles.num_ranks(cfg, role), head=head)
    ctx = _context(cfg, "", title=f"sweep {cfg.name!r}: {num_runs} combination(s), one array task each, "
                   f"at most {max(1, min(parallel, num_runs))} at once", python=python, pythonpath=pythonpath,
                   components=[comp], manifest=str(sd.manifest), role=role.name,
                   main=_role_step(cfg, role, []))
    return JobScript("sweep", "sweep_array", (role.name,), render_template("sweep", **ctx),
                     ranks=tuple(range(num_runs)))


def render_eval_array(run_dir: RunDir | Path | str, cfg: RecipeConfig, versions: Sequence[int], *,
                      extra_args: Sequence[str] = (), python: str | None = None,
                      pythonpath: str | None = "auto") -> JobScript:
    """``relax-hpc eval --executor slurm``: a job array over stored snapshots (array task id = version), each task
    one ``relax-hpc eval RUN_DIR --snapshots vN`` with the resources of the role that generates (``launch.rollout``
    in fully_async, ``launch.trainer`` in colocate). ``extra_args`` (``--set``/``--force``) go to every task."""
    rd, rd_text, python, pythonpath = _prepare(run_dir, python, pythonpath)
    if not versions or min(versions) < 0:
        raise UserError(f"snapshot versions must be >= 0, got {list(versions)}")
    spec = _ranges(versions)
    from relax_hpc.roles.spec import mode_spec, resources, resources_where

    generating = next(r for r in mode_spec(cfg).roles if r.generates)  # rollout (fully_async), colocate
    res, where = resources(cfg, generating), resources_where(generating)
    head = _job_head(rd.slurm, rd.slurm_output("eval", "%A_%a").name, array=spec)
    comp = _directives(cfg, res, where, job_name=f"{cfg.name}-eval", ntasks=1, nodes=1, tasks_per_node=1, head=head,
                       time_min=cfg.launch.time_min)
    ctx = _context(cfg, rd_text, title=f"run {cfg.name!r}: evaluation of snapshots {spec} (one array task each)",
                   python=python, pythonpath=pythonpath, components=[comp], extra_args=list(extra_args),
                   main=_step(res, where, ["--ntasks=1"]))
    return JobScript(f"eval-{spec.replace(',', '_')}"[:120], "eval_array", ("eval",),
                     render_template("eval_array", **ctx), ranks=tuple(sorted(set(versions))))
