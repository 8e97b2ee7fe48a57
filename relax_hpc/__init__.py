"""relax-hpc: fully-asynchronous, omni-modal RL post-training for LLMs on Slurm clusters.

Every role (trainer ranks, rollout workers, the launcher, the monitor) coordinates only through one run directory on
a shared filesystem; :mod:`relax_hpc.rundir` owns its layout and :mod:`relax_hpc.fsio` its atomic primitives.
"""

__version__ = "0.1.0"
