"""megatron-core's distributed optimizer for the megatron backend, and its ``dist_checkpointing`` checkpoints.

- :func:`build_distributed_optimizer`: ``get_megatron_optimizer`` (``adam`` with decoupled weight decay, i.e.
  AdamW; torch's ``AdamW`` underneath where TransformerEngine and apex are missing) over the GPT wrapped in megatron
  DDP built with ``use_distributed_optimizer=True``. Each data-parallel rank holds the float32 main weights and the
  Adam moments of its contiguous range of every gradient bucket; the step reduce-scatters the gradients and
  all-gathers the updated weights. Weight decay applies to every parameter (``config_overrides={}``), as the torch
  backend's AdamW does, not megatron's default of skipping biases and norms.
- :func:`step`: megatron's ``ChainedOptimizer.step`` split so that a non-finite gradient norm skips the update
  (megatron steps anyway without a loss scaler).
- :func:`gather_moments` / :func:`scatter_moments`: each model parameter's Adam state made whole over the
  data-parallel ranks (every rank fills its range, the rest zeros, one SUM all-reduce: exact) and back, for the
  project's checkpoint format (HF-named, any TP/DP, either backend).
- :func:`save_dist_checkpoint` / :func:`load_dist_checkpoint`: ``megatron.core.dist_checkpointing`` of the model
  and the distributed optimizer in the ``dp_reshardable`` layout (each rank writes its own bucket ranges in
  parallel; a checkpoint loads at another data-parallel size, not another TP/PP size). Loading into an optimizer
  that has not stepped needs its states to exist first (``_init_optimizer_states_with_dummy_values``).
- :func:`cpu_optimizer_shim` / :func:`cuda_type_names`: megatron-core 0.16.1's optimizers are written for CUDA
  only (``device='cuda'`` in about ten tensor factories, ``param.type() == 'torch.cuda.FloatTensor'`` checks). On a
  machine without CUDA, the shim hands the optimizer modules a ``torch`` whose tensor factories put ``'cuda'``
  tensors on the CPU, and :func:`cuda_type_names` (entered only around megatron optimizer calls) makes a CPU
  tensor's ``type()`` answer with the CUDA name. Never installed where CUDA is available.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

DIST_META = {"distrib_optim_sharding_type": "dp_reshardable"}
"""The sharding metadata of the distributed optimizer's ``sharded_state_dict`` (what Megatron-LM passes):
``dp_reshardable`` saves and loads across data-parallel sizes; ``fully_reshardable`` saves but fails to load
(probed with megatron-core 0.19.2), and without metadata the save fails."""

_FACTORIES = frozenset({"tensor", "zeros", "empty", "ones", "full", "zeros_like", "empty_like", "ones_like"})
_SHIMMED = ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
            "megatron.core.optimizer.distrib_optimizer", "megatron.core.distributed.param_and_grad_buffer",
            "megatron.core.utils", "megatron.core.dist_checkpointing.strategies.filesystem_async")


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` on a machine without CUDA, less ``synchronize`` (nothing to wait for)."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return (lambda *args, **kwargs: None) if name == "synchronize" else getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` as megatron's optimizer and checkpoint-writer modules see it on a machine without CUDA: tensor
    factories called with ``device='cuda'`` make CPU tensors, ``torch.cuda.synchronize`` does nothing; everything
    else is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        if name == "cuda":
            return _CpuCuda()
        value = getattr(torch, name)
        if name not in _FACTORIES:
            return value

        def factory(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)

        return factory


def cpu_optimizer_shim() -> None:
    """Where torch has no CUDA: megatron's optimizer modules get :class:`_CpuTorch` (module docstring)."""
    if torch.cuda.is_available():
        return
    import importlib

    for name in _SHIMMED:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _CpuTorch):
            module.torch = _CpuTorch()


@contextlib.contextmanager
def cuda_type_names(on: bool) -> Iterator[None]:
    """With ``on`` (CPU tensors under megatron's optimizer), ``Tensor.type()`` without arguments answers
    ``torch.cuda.FloatTensor`` for a CPU float tensor (megatron checks those names); undone on exit."""
    if not on:
        yield
        return
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return "torch.cuda." + name[len("torch."):]

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def build_distributed_optimizer(trainer: Any, ddp: Any, dtype: torch.dtype) -> Any:
    """megatron's distributed AdamW (a ``ChainedOptimizer``) over ``ddp`` for ``trainer`` (a ``TrainerConfig``)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from relax_hpc.trainer.megatron.config import optimizer_args

    dtypes = {p.dtype for p in ddp.module.parameters() if p.requires_grad}
    if dtypes != {dtype}:  # megatron's param-to-state map assumes one dtype per param group (MegatronBackend casts)
        raise ValueError(f"megatron's distributed optimizer needs every parameter in {dtype}; the model has "
                         f"{sorted(map(str, dtypes))}: float32 parameters beside {dtype} ones in one param group "
                         "map to the wrong optimizer state (megatron lists the float32 shards first)")
    cpu_optimizer_shim()
    config = OptimizerConfig(**optimizer_args(trainer), bf16=dtype == torch.bfloat16, params_dtype=dtype)
    with cuda_type_names(not torch.cuda.is_available()):
        return get_megatron_optimizer(config, [ddp], config_overrides={})


def step(optimizer: Any, max_norm: float) -> float:
    """One update of megatron's optimizer from the gradients in the DDP buffers: the global gradient norm (over the
    data-parallel shards and TP, each shard once), clipping to ``max_norm``, the step and the parameter all-gather.
    A non-finite norm skips the update. Returns the norm before clipping."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    with cuda_type_names(not torch.cuda.is_available()):
        optimizer.prepare_grads()  # the model gradients' ranges -> the main parameters' .grad
        norm = float(optimizer.get_grad_norm())
        if not math.isfinite(norm):
            return norm
        for opt in _parts(optimizer):
            params = opt.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=norm)
        optimizer.step_with_ready_grads()
    return norm


def _parts(optimizer: Any) -> list[Any]:
    """The distributed optimizers of ``optimizer`` (a ``ChainedOptimizer``'s, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _ranges(optimizer: Any, params: list[Any] | None = None) -> Iterator[tuple[Any, Any, Any]]:
    """(distributed optimizer or None, model parameter, its range on this data-parallel rank or None) for every
    parameter of ``params`` (default all): a parameter outside this rank's ranges has no optimizer state here."""
    owners = {id(p): opt for opt in _parts(optimizer) for p in opt.model_param_group_index_map}
    if params is None:
        params = [p for opt in _parts(optimizer) for p in opt.model_param_group_index_map]
    for param in params:
        opt = owners.get(id(param))
        yield opt, param, None if opt is None else opt._get_model_param_range_map(param)["param"]


def has_state(optimizer: Any) -> bool:
    return all(bool(opt.optimizer.state) for opt in _parts(optimizer))


def gather_moments(optimizer: Any, dp_group: Any, keys: tuple[str, ...], *,
                   params: list[Any] | None = None) -> dict[Any, dict[str, torch.Tensor]]:
    """Each model parameter's (of ``params``, default all) whole optimizer tensors (``keys`` of its state;
    ``param`` is the main weight) in the parameter's shape, on every data-parallel rank (one SUM all-reduce of
    disjoint ranges: exact). Every data-parallel rank calls with the same ``params``."""
    import torch.distributed as dist

    out: dict[Any, dict[str, torch.Tensor]] = {}
    for opt, param, rng in _ranges(optimizer, params):
        mine = opt._get_main_param_and_optimizer_states(param) if rng is not None else {}
        out[param] = {}
        for key in keys:  # the main weights and Adam's moments are float32
            whole = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
            if rng is not None:
                whole[rng.start:rng.end] = mine[key].detach().view(-1)
            if dist.get_world_size(dp_group) > 1:
                dist.all_reduce(whole, group=dp_group)
            out[param][key] = whole.view(param.shape)
    return out


def ensure_state(optimizer: Any) -> None:
    """Adam state on every range (megatron's dummy step with zero gradients, which moves the weights by the
    weight decay: load the weights afterwards), so that a checkpoint can be copied into it."""
    with cuda_type_names(not torch.cuda.is_available()):
        for opt in _parts(optimizer):
            if not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()


def reset_state(optimizer: Any) -> None:
    """No Adam state (the next step starts from zero moments, as a new optimizer's)."""
    for opt in _parts(optimizer):
        opt.optimizer.state.clear()


def step_count(optimizer: Any) -> torch.Tensor:
    """AdamW's step counter (the same for every parameter)."""
    opt = _parts(optimizer)[0].optimizer
    return next(iter(opt.state.values()))["step"].detach().clone()


def scatter_moments(optimizer: Any, tensors: dict[Any, dict[str, torch.Tensor]], step_: Any) -> None:
    """This rank's ranges of whole per-parameter tensors (:func:`gather_moments`' layout) into the optimizer's
    state (which must exist: :func:`ensure_state`), and the step counter."""
    for opt, param, rng in _ranges(optimizer):
        if rng is None:
            continue
        mine = opt._get_main_param_and_optimizer_states(param)
        with torch.no_grad():
            for key, whole in tensors[param].items():
                mine[key].copy_(whole.reshape(-1)[rng.start:rng.end].view_as(mine[key]))
    for opt in _parts(optimizer):
        for state in opt.optimizer.state.values():
            state["step"] = torch.as_tensor(step_, dtype=torch.float32).clone()


def sync_main_params(optimizer: Any) -> None:
    """The main (float32) weights copied from the model's weights (after the model was loaded from elsewhere)."""
    for opt in _parts(optimizer):
        opt._copy_model_params_to_main_params()


def _sharded(ddp: Any, optimizer: Any, *, loading: bool) -> dict[str, Any]:
    model = ddp.sharded_state_dict()
    return {"model": model, "optimizer": optimizer.sharded_state_dict(model, is_loading=loading, metadata=DIST_META)}


def save_dist_checkpoint(path: Path | str, ddp: Any, optimizer: Any) -> None:
    """The model and the distributed optimizer in ``path`` (every rank calls; each writes its own shards)."""
    import importlib.util

    from megatron.core import dist_checkpointing

    from relax_hpc.errors import UserError

    if importlib.util.find_spec("psutil") is None:  # its forked writers need it, and the save hangs without
        raise UserError("megatron's dist_checkpointing writer needs psutil, which is not installed: pip install psutil")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with cuda_type_names(not torch.cuda.is_available()):
        dist_checkpointing.save(_sharded(ddp, optimizer, loading=False), str(path), content_metadata=DIST_META)


def load_dist_checkpoint(path: Path | str, ddp: Any, optimizer: Any) -> None:
    """What :func:`save_dist_checkpoint` wrote, at this rank's data-parallel size (every rank calls). The
    checkpoint's pickles build nothing but plain data (:func:`~relax_hpc.trainer.megatron.dist_checkpoint.
    restricted_unpickling`)."""
    from megatron.core import dist_checkpointing

    from relax_hpc.trainer.megatron.dist_checkpoint import restricted_unpickling

    ensure_state(optimizer)  # before the weights are loaded: it takes one zero-gradient step
    with cuda_type_names(not torch.cuda.is_available()), torch.no_grad():  # float32 main weights view the model's
        with restricted_unpickling():
            state = dist_checkpointing.load(_sharded(ddp, optimizer, loading=True), str(path))
        steps = set(_saved_steps(state["optimizer"]))
        ddp.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
    # With torch's AdamW, megatron-core 0.16.1 keeps the step counter in the param groups of the common state and
    # also in each bucket's dp_reshardable parameter state, which is loaded last and does not hold it correctly
    # (a DP=2 checkpoint after 3 steps loads as step 1 at DP=1); and it hands every parameter one shared step
    # tensor, which torch's AdamW would advance once per parameter. The param groups' counter, one tensor each.
    assert len(steps) <= 1, steps
    for opt in _parts(optimizer):
        for st in opt.optimizer.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = torch.tensor(float(next(iter(steps))), dtype=torch.float32) if steps \
                    else st["step"].clone()


def _saved_steps(state: Any) -> Iterator[float]:
    """The ``step`` of every param group in a loaded optimizer state dict (nested for chained optimizers)."""
    if isinstance(state, dict):
        for group in state.get("param_groups", []) if isinstance(state.get("param_groups"), list) else []:
            if isinstance(group, dict) and "step" in group:
                yield float(group["step"])
        for key, value in state.items():
            if key != "param_groups":
                yield from _saved_steps(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _saved_steps(value)
