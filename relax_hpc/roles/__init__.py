"""Roles as data (:mod:`relax_hpc.roles.spec`: the table from mode to role specs) and the role entry point
(:mod:`relax_hpc.roles.entry`: ``run_role``, what ``relax-hpc role`` runs)."""

from relax_hpc.roles.entry import load_run_config, run_role
from relax_hpc.roles.spec import MODES, ROLES, ModeSpec, RoleSpec, mode_spec, role_plan, role_spec

__all__ = ["MODES", "ROLES", "ModeSpec", "RoleSpec", "load_run_config", "mode_spec", "role_plan", "role_spec",
           "run_role"]
