"""Evaluation on a held-out set: during training (the ``eval`` recipe section, :mod:`relax_hpc.eval.hook`) and after
it on stored snapshots (``relax-hpc eval``, :mod:`relax_hpc.eval.offline`). Generation goes through the rollout
engine's ``generate`` API only (:mod:`relax_hpc.rollout.engine`); results are files of the run dir
(``eval/vNNNNNN.json``) and metric records ``eval/*`` with the weight version as their step."""
