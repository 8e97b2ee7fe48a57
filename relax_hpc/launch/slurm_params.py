"""Slurm parameter names: submitit's ``_make_sbatch_string`` signature is the single source of truth.

A recipe's ``launch.<role>.slurm`` mapping holds extra Slurm parameters by those names (``exclude``, ``gres``,
``nodelist`` ...). Parameters that the recipe already sets through typed fields (``nodes``, ``partition``, ``time``
...) and submitit's non-Slurm arguments (``folder``, ``setup``, ``srun_args`` ...) are refused here with a pointer to
the field to use. An unknown name is an error that lists the valid names with their defaults, as submitit does.

Only the *signature* of submitit's function is read; nothing is ever pickled.
"""

from __future__ import annotations

import inspect
import re
from functools import lru_cache
from typing import Any

from relax_hpc.errors import UserError

# Set through typed recipe fields instead: name -> the field to use.
MANAGED: dict[str, str] = {
    "job_name": "name", "partition": "launch.<role>.partition or launch.partition", "time": "launch.time_min",
    "nodes": "launch.<role>.nodes", "ntasks_per_node": "launch.<role>.tasks_per_node",
    "cpus_per_task": "launch.<role>.cpus_per_task", "gpus_per_node": "launch.<role>.gpus_per_node",
    "num_gpus": "launch.<role>.gpus_per_node", "qos": "launch.qos", "account": "launch.account",
    "mem": "launch.<role>.mem_gb", "constraint": "launch.<role>.constraint",
    "signal_delay_s": "launch.signal_delay_s", "setup": "launch.setup", "array_parallelism": "sweep --parallel",
}
# submitit's own arguments that are not Slurm parameters (or that relax-hpc fixes itself).
NOT_SLURM = frozenset({"command", "folder", "map_count", "additional_parameters", "teardown", "stderr_to_stdout",
                       "srun_args", "use_srun", "wckey"})


@lru_cache(maxsize=1)
def valid_slurm_params() -> dict[str, Any]:
    """name -> default of every parameter a recipe may set in ``launch.<role>.slurm`` (from submitit)."""
    from submitit.slurm.slurm import _make_sbatch_string

    out = {}
    for name, p in inspect.signature(_make_sbatch_string).parameters.items():
        if name in MANAGED or name in NOT_SLURM:
            continue
        out[name] = None if p.default is inspect.Parameter.empty else p.default
    return out


def check_slurm_params(params: dict[str, Any]) -> dict[str, Any]:
    """Return ``params`` if every name is a valid extra Slurm parameter, else raise one :class:`UserError`."""
    valid = valid_slurm_params()
    for name, value in params.items():
        if name in MANAGED:
            raise UserError(f"Slurm parameter {name!r} is set by the recipe field {MANAGED[name]}, not in `slurm:`")
        if name not in valid:
            listing = ", ".join(f"{k} (default {v!r})" for k, v in sorted(valid.items()))
            raise UserError(f"unknown Slurm parameter {name!r}; valid parameters: {listing}")
        if isinstance(value, str) and ("\n" in value or "\r" in value):
            raise UserError(f"Slurm parameter {name!r}: a value cannot contain a newline")
    return params


_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]*$")


def directive_quote(value: object) -> str:
    """Quote a value for an ``#SBATCH`` line the way sbatch parses it (not a shell: ``$`` is literal there).

    sbatch's parser honours double and single quotes and backslash escapes, even inside quotes, and treats an
    unquoted ``#`` as a comment. A newline cannot be expressed at all.
    """
    text = str(value)
    if "\n" in text or "\r" in text:
        raise UserError(f"{text!r}: an #SBATCH value cannot contain a newline")
    if text and _PLAIN.match(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def directive(key: str, value: object = True) -> str:
    """One ``#SBATCH`` option (without the ``#SBATCH`` prefix): ``--key=value``, or ``--key`` for ``True``.

    Names follow submitit's convention: underscores become dashes.
    """
    key = key.replace("_", "-")
    if value is True:
        return f"--{key}"
    return f"--{key}={directive_quote(value)}"


def extra_directives(params: dict[str, Any]) -> list[str]:
    """Directives of a role's ``slurm`` mapping (validated); ``False``/``None`` values are left out."""
    check_slurm_params(params)
    return [directive(k, v) for k, v in sorted(params.items()) if v is not None and v is not False]
