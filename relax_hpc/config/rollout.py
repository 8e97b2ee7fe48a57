"""The ``rollout`` section: how many prompts and samples, sampling, and the engine, whose settings depend on it.

``rollout`` is a discriminated union on ``rollout.engine``: :class:`HFRolloutConfig` (``hf``, in-process; has
``hf_decoder``), :class:`SGLangRolloutConfig` (``sglang``; has ``server`` and ``sglang``) and
:class:`VLLMRolloutConfig` (``vllm``; has ``server``). A key of another engine is an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Union

from pydantic import Field, field_validator

from relax_hpc.config.base import Section, Variants
from relax_hpc.config.env import EnvConfig


class SamplingConfig(Section):
    """Sampling parameters of generation."""

    temperature: float = Field(1.0, ge=0.0)
    """Softmax temperature (0 = greedy)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = Field(64, ge=1)
    """Most tokens generated per response."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings (the EOS token always stops)."""

    @field_validator("stop")
    @classmethod
    def _nonempty_stops(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("a stop string must not be empty (it would stop every response at once)")
        return v


class SGLangConfig(Section):
    """Settings of the ``sglang`` engine (a server per rollout node)."""

    server_args: dict[str, Any] = Field(default_factory=dict)
    """Extra ``sglang.launch_server`` arguments (e.g. ``mem_fraction_static``); ``rollout.server.extra_args`` is the
    engine-independent way."""
    startup_timeout_s: float = 600.0
    """Superseded by ``rollout.server.startup_timeout_s`` (kept so older recipes validate)."""


class ServerConfig(Section):
    """Inference servers of the ``sglang`` and ``vllm`` engines: one per tensor-parallel group of a rollout task's
    GPUs, started by the rollout process on its own node, on a free port, stopped with it."""

    command: str | None = None
    """How to start a server; ``None`` = ``python -m sglang.launch_server`` / ``python -m
    vllm.entrypoints.openai.api_server`` with this Python. Prefix a wrapper or name another environment's Python:
    ``apptainer exec --nv sglang.sif python3 -m sglang.launch_server``, ``/opt/vllm-venv/bin/python -m
    vllm.entrypoints.openai.api_server`` (``tools/install.sh --vllm`` makes one). The engine adds the model, host,
    port, dtype and sync-related arguments."""
    extra_args: list[str] = Field(default_factory=list)
    """More server arguments, appended as given (``["--max-num-seqs", "256"]``)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for the server (``VLLM_CPU_KVCACHE_SPACE``, ``CUDA_...``)."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel size of one server."""
    gpus_per_server: int | None = Field(None, ge=1)
    """GPUs one server uses (``None`` = ``tp_size``); a rollout task with more GPUs starts several servers."""
    host: str = "127.0.0.1"
    """Address a server binds to (the worker on the same node talks to it)."""
    port: int | None = Field(None, ge=1, le=65535)
    """First port (server k gets ``port + k``); ``None`` = a free port picked at start."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long a server may take to answer its health endpoint after start."""
    stop_grace_s: float = Field(15.0, gt=0)
    """Seconds between SIGTERM and SIGKILL when a server is stopped."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Bound on one HTTP generation request."""
    control_timeout_s: float = Field(120.0, gt=0)
    """Bound on one control request (pause, abort, weight update)."""
    max_connections: int = Field(256, ge=1)
    """Connection limit of the engine's HTTP client (concurrent requests to one server)."""
    max_restarts: int = Field(5, ge=0)
    """A server that dies is restarted (with backoff) at most this many times per rollout process."""
    restart_backoff_s: float = Field(2.0, ge=0)
    """First restart delay; doubled on each further restart."""
    partial_rollout: bool = True
    """On a weight update, abort in-flight requests and resubmit them afterwards with the tokens generated so far
    (each keeps the version that produced it). ``False``: wait for in-flight requests to finish, then update."""
    max_resubmits: int = Field(4, ge=0)
    """A sample aborted by weight updates more often than this is returned as aborted (``finish_reason=abort``)."""
    weight_sync: Literal["files", "distributed"] = "files"
    """Deprecated: use ``weights.transport`` (``distributed`` = ``kind: server``). ``files``: the server loads each
    snapshot folder from the run dir; ``distributed``: the trainer broadcasts
    the buckets to the servers over a process group (SGLang ``/update_weights_from_distributed``, vLLM's
    weight-transfer engine); any failure falls back to the files, logged as an event."""
    sync_timeout_s: float = Field(300.0, gt=0)
    """Bound on one weight update of a server (either path) before it counts as failed."""
    sleep_level: Literal[0, 1, 2] | None = None
    """Colocate: how the server sleeps while the trainer trains (vLLM ``/sleep``, SGLang
    ``/release_memory_occupation``): 0 = never (it keeps its memory the whole step); 1 = KV cache freed, weights
    kept in host memory; 2 = KV cache and weights freed (the new weights are loaded after waking anyway, so nothing
    needs keeping). ``None`` = 2 in colocate. fully_async servers never sleep (setting 1 or 2 there is an error)."""
    gpu_memory_utilization: float | None = Field(None, gt=0, lt=1)
    """The share of its GPU's memory a server takes for weights, activations and KV cache (vLLM
    ``--gpu-memory-utilization``, SGLang ``--mem-fraction-static``); in colocate the trainer lives on the rest.
    ``None`` = the engine's default in fully_async, 0.5 in colocate. Not used by a CPU server."""
    versions: str | None = None
    """Server versions accepted at start (a PEP 440 specifier, ``">=0.5.10,<0.6"``); ``None`` = the releases the
    engine was checked against (sglang ``>=0.5.10,<=0.5.23``, vllm ``>=0.32,<0.33``); ``""`` = any."""


class PartialConfig(Section):
    """Partial rollouts (``mode: colocate``): each step starts more prompts than it trains, stops generating once
    enough whole groups have finished, and carries the unfinished ones into the next step (docs/partial-rollouts.md)."""

    overprovision: float = Field(1.25, ge=1.0, le=4.0)
    """Groups in generation per step (carried + fresh) = ``ceil(prompts_per_step x overprovision)``; the step stops
    generating once ``prompts_per_step`` groups are whole (every sample finished)."""
    carry_over: bool = True
    """Unfinished groups continue next step from their tokens so far (each token keeps its version), while their
    oldest token is at most ``max_staleness`` versions behind the trained one; ``false``: they are dropped
    (counted) and the step's extra prompts only shorten its tail."""


class RolloutBase(Section):
    """Generation: how many prompts and samples, with what engine. The keys below hold for every engine; each
    engine's own keys follow in its variant (``rollout.engine`` selects it)."""

    engine: Literal["hf", "sglang", "vllm"] = "hf"
    """``hf``: transformers in-process; ``sglang`` / ``vllm``: inference servers on the rollout nodes
    (``rollout.server``). Selects the variant: the other engines' keys are errors."""
    num_workers: int = Field(2, ge=1)
    """Rollout workers in ``fully_async`` mode (processes locally, tasks/nodes on Slurm)."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts per trainer step (the global batch is prompts_per_step x n_samples samples)."""
    n_samples: int = Field(8, ge=1)
    """Samples per prompt (the GRPO group size)."""
    batch_prompts: int = Field(16, ge=1)
    """Prompts generated together in one engine call."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where generation runs: the ``hf`` engine's model, or the servers of ``sglang`` / ``vllm`` (``cpu``: a CPU
    server; ``auto``: the GPU where there is one, else the CPU)."""
    env: EnvConfig | None = None
    """A multi-turn environment: every sample becomes an episode (None = single-turn prompts)."""
    partial: PartialConfig | None = None
    """Partial rollouts in ``mode: colocate`` (None: every step generates exactly ``prompts_per_step`` groups to the
    end)."""


class HFRolloutConfig(RolloutBase):
    """``rollout.engine: hf``: transformers in the rollout process (colocate shares the trainer's model)."""

    engine: Literal["hf"] = "hf"
    """The in-process engine."""
    hf_decoder: Literal["auto", "compiled", "generate"] = "auto"
    """How the ``hf`` engine decodes: ``auto`` = its own sampling loop with a KV cache for text prompts to a plain
    causal LM (same sampling as ``generate``, 1.3x as fast on the demo model: bench generate; on a GPU the loop's
    steps are captured as CUDA graphs), ``transformers.generate`` otherwise; ``compiled`` = ``auto``, and on a GPU
    each layer's elementwise work in the captured steps is fused by ``torch.compile`` (the first batches of each size
    pay the compilation); ``generate`` = always ``transformers.generate``."""


class ServerRolloutBase(RolloutBase):
    """What the server engines (``sglang``, ``vllm``) share: the server processes."""

    engine: Literal["sglang", "vllm"] = "sglang"
    """A server engine."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """Inference servers (``sglang``, ``vllm`` engines)."""


class SGLangRolloutConfig(ServerRolloutBase):
    """``rollout.engine: sglang``: an SGLang server per tensor-parallel group of a rollout task's GPUs."""

    engine: Literal["sglang"] = "sglang"
    """The SGLang server engine."""
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    """SGLang-only server settings."""


class VLLMRolloutConfig(ServerRolloutBase):
    """``rollout.engine: vllm``: a vLLM server per tensor-parallel group of a rollout task's GPUs."""

    engine: Literal["vllm"] = "vllm"
    """The vLLM server engine."""


ROLLOUT_VARIANTS = Variants("engine", {"hf": HFRolloutConfig, "sglang": SGLangRolloutConfig,
                                       "vllm": VLLMRolloutConfig}, default="hf")
"""``rollout`` by ``rollout.engine``."""

if TYPE_CHECKING:
    RolloutConfig = Union[HFRolloutConfig, SGLangRolloutConfig, VLLMRolloutConfig]  # noqa: UP007
else:
    RolloutConfig = ROLLOUT_VARIANTS.annotation()
"""The ``rollout`` section: one of its engine variants."""
