"""Typed recipe schema. Imports no torch: the CLI, the launcher and the monitor validate recipes without it.

Precedence, stated once: ``--set`` overrides > recipe file > defaults below. Every field has a docstring (shown by
``relax-hpc validate --explain`` and in the README's recipe reference).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


# ---------------------------------------------------------------------------------------------------------- model
class TinyModelConfig(Section):
    """Shape of a built-in tiny model made from config with random weights (no download)."""

    arch: Literal["qwen3", "qwen2_5_vl", "qwen2_audio"] = "qwen3"
    """Architecture family of the tiny model."""
    hidden_size: int = Field(64, ge=8)
    """Hidden size."""
    num_layers: int = Field(2, ge=1)
    """Number of transformer layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = Field(128, ge=8)
    """MLP intermediate size."""
    max_position: int = Field(256, ge=16)
    """Maximum sequence length (positions)."""


class ModelConfig(Section):
    """The policy model and its tokenizer."""

    path: str = "tiny"
    """``tiny`` builds a small model from ``tiny`` with random weights and the built-in offline tokenizer; otherwise a
    local folder in HF format (config.json + safetensors + tokenizer), or a hub name where the machine can reach a
    hub."""
    tokenizer: str | None = None
    """Tokenizer folder or hub name; defaults to ``path``. ``builtin:digits`` is the offline demo tokenizer."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Shape of the tiny model (used when ``path`` is ``tiny``)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Training/generation dtype. ``auto``: float32 on CPU, bfloat16 on GPU."""
    trust_remote_code: bool = False
    """Passed to transformers when loading ``path``."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    attn_implementation: Literal["auto", "sdpa", "flex_attention", "flash_attention_2", "eager"] = "auto"
    """Attention kernel (``auto`` = ``sdpa``). Packed micro-batches are fastest with a kernel that skips the other
    sequences' blocks (``flex_attention``, compiled on first use; ``flash_attention_2`` where flash-attn is
    installed). See docs/benchmarks.md for measured figures."""
    init_seed: int = 0
    """Seed for the random weights of a tiny model."""


# ---------------------------------------------------------------------------------------------------------- data
class TaskConfig(Section):
    """A built-in synthetic task that generates prompts and answers (the demo uses it; no files needed)."""

    name: Literal["reverse_digits", "sort_digits", "copy_digits"] = "reverse_digits"
    """Which task: reverse, sort or copy a string of digits."""
    min_len: int = Field(3, ge=1)
    """Shortest digit string."""
    max_len: int = Field(5, ge=1)
    """Longest digit string."""
    num_prompts: int = Field(2048, ge=1)
    """How many distinct prompts one epoch holds."""


class DataConfig(Section):
    """Where prompts come from."""

    path: str | None = None
    """JSONL, JSON or Parquet file, a folder of them, or a folder saved by HF ``datasets`` (``save_to_disk``). Relative
    paths are resolved against the recipe's folder. ``None`` uses ``task``."""
    task: TaskConfig | None = None
    """Built-in synthetic task, used when ``path`` is not set."""
    prompt_key: str = "prompt"
    """Field holding the prompt: a string, or a list of chat messages."""
    answer_key: str = "answer"
    """Field holding the reference answer given to the reward function."""
    system_prompt: str | None = None
    """Optional system message put before each prompt."""
    chat_template: bool = True
    """Apply the tokenizer's chat template (prompts become chat messages)."""
    max_prompt_tokens: int = Field(512, ge=1)
    """Prompts longer than this are skipped and counted (never truncated silently)."""
    shuffle: bool = True
    """Shuffle prompts each epoch, deterministically from ``seed``."""
    num_epochs: int = Field(1000, ge=1)
    """How many passes over the prompts at most (the run stops at ``num_steps`` first)."""

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        if self.path is None and self.task is None:
            raise ValueError("data needs either `path` (a JSONL/Parquet file) or `task` (a built-in task)")
        return self


# ---------------------------------------------------------------------------------------------------------- rollout
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


class SGLangConfig(Section):
    """Settings of the ``sglang`` engine (a server per rollout node)."""

    server_args: dict[str, Any] = Field(default_factory=dict)
    """Extra ``sglang.launch_server`` arguments (e.g. ``mem_fraction_static``)."""
    startup_timeout_s: float = 600.0
    """How long to wait for the server to answer /health."""


class RolloutConfig(Section):
    """Generation: how many prompts and samples, with what engine."""

    engine: Literal["hf", "sglang"] = "hf"
    """``hf``: transformers in-process; ``sglang``: one SGLang server per rollout node."""
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
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    """SGLang server settings."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the ``hf`` engine runs."""
    hf_decoder: Literal["auto", "generate"] = "auto"
    """How the ``hf`` engine decodes: ``auto`` = its own sampling loop with a KV cache for text prompts to a plain
    causal LM (same sampling as ``generate``, 1.3x as fast on the demo model: bench generate), ``transformers.generate``
    otherwise; ``generate`` = always ``transformers.generate``."""


# ---------------------------------------------------------------------------------------------------------- algorithm
class OverlongConfig(Section):
    """DAPO's soft overlong punishment."""

    enabled: bool = False
    """Penalise responses that approach ``max_new_tokens``."""
    buffer_tokens: int = Field(16, ge=1)
    """Length of the soft-penalty zone before the limit."""
    penalty: float = 1.0
    """Largest penalty (reached at the limit), subtracted from the reward."""


class DistillConfig(Section):
    """On-policy distillation: the teacher's log-probs shape the advantage (reverse KL)."""

    teacher: str | None = None
    """Teacher model path (HF format) or ``tiny`` with ``teacher_seed``."""
    coef: float = 1.0
    """Weight of the reverse-KL term in the per-token advantage."""
    reward_coef: float = 0.0
    """Weight of the task reward's group advantage added to it (0 = pure distillation)."""


class AlgorithmConfig(Section):
    """The RL objective. ``name`` picks a module of the algorithm registry; the rest are its options."""

    name: str = "grpo"
    """Registered algorithm: ``grpo``, ``gspo``, ``sapo``, ``distill``, or ``module:attr`` of a user one."""
    clip_low: float = Field(0.2, ge=0.0)
    """PPO clip range below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = Field(0.28, ge=0.0)
    """PPO clip range above 1 (clip-higher: ratio <= 1 + clip_high)."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = (
        "token_mean")
    """Loss aggregation: over all tokens of the batch, or per sequence then averaged (``_norm``: Dr.GRPO's constant
    normaliser = max_new_tokens)."""
    std_normalize: bool = True
    """Divide group advantages by the group's reward std (False = Dr.GRPO)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards have zero variance (they carry no signal)."""
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    """DAPO's overlong penalty."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty to the reference model (0 = no reference model is kept)."""
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r, with r = pi_ref / pi."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    tis_cap: float | None = Field(2.0, ge=1.0)
    """Truncated importance sampling against the rollout policy's log-probs: weight min(pi_old/pi_rollout, cap).
    ``None`` disables the correction."""
    proximal: bool = False
    """Decoupled PPO: clip against the trainer's own recomputed log-probs (the proximal policy) and correct the
    behaviour mismatch with the truncated IS weight."""
    sapo_tau_pos: float = Field(1.0, gt=0.0)
    """SAPO gate temperature for positive advantages."""
    sapo_tau_neg: float = Field(1.05, gt=0.0)
    """SAPO gate temperature for negative advantages."""
    distill: DistillConfig = Field(default_factory=DistillConfig)
    """On-policy distillation settings (``name: distill``)."""

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        from relax_hpc.algorithms.registry import check_algorithm_name

        check_algorithm_name(v)
        return v


# ---------------------------------------------------------------------------------------------------------- reward
class RewardConfig(Section):
    """How responses are scored."""

    name: str = "exact_match"
    """Built-in reward (``exact_match``, ``math``, ``format``, ``digits_positional``) or ``module:function`` /
    ``path/to/file.py:function`` of a user function. Checked when the config is validated."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments given to the reward function."""
    on_error: Literal["zero", "drop"] = "zero"
    """A reward that raises or returns NaN: count it, then score 0 (``zero``) or drop the whole group (``drop``)."""
    timeout_s: float = Field(60.0, gt=0)
    """Per-batch timeout of an async reward function."""

    @model_validator(mode="after")
    def _resolvable(self) -> RewardConfig:
        from relax_hpc.rewards.registry import check_reward

        check_reward(self.name, self.kwargs)
        return self


# ---------------------------------------------------------------------------------------------------------- trainer
class TrainerConfig(Section):
    """The learner."""

    backend: Literal["torch", "megatron"] = "torch"
    """``torch`` (HF model, FSDP2 over ranks; runs on CPU) or ``megatron`` (megatron-core, GPU)."""
    num_ranks: int = Field(1, ge=1)
    """Data-parallel trainer ranks (FSDP2 ``fully_shard`` when > 1; gloo on CPU, NCCL on GPU)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer runs. ``cuda`` on a machine without a GPU is an error."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up steps."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one packed micro-batch (sequences are packed without padding up to this many tokens)."""
    checkpoint_every: int = Field(50, ge=1)
    """Checkpoint every N steps (and always on SIGTERM/SIGUSR2 and at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many checkpoints to keep."""
    async_checkpoint: bool = False
    """Write periodic checkpoints on a background thread: the step only takes a CPU copy of the weights, optimizer
    state and RNG (that much extra host memory while the write runs); the store position is committed once the
    checkpoint is durable. Checkpoints on a signal or at the end are always written before the role exits."""
    export_final: bool = True
    """Export the final model in HF format to ``RUN_DIR/export``."""


class SFTWarmupConfig(Section):
    """Optional supervised warm-up before RL (real RL starts from a supervised model; the demo uses a few steps)."""

    steps: int = Field(0, ge=0)
    """Supervised steps on (prompt, answer) pairs from the data (0 = none)."""
    lr: float = Field(1e-3, gt=0)
    """Learning rate of the warm-up."""
    batch_size: int = Field(32, ge=1)
    """Pairs per warm-up step."""
    task: TaskConfig | None = None
    """An easier built-in task for the warm-up; defaults to the data's task."""


# ------------------------------------------------------------------------------------------------ weights, store
class WeightSyncConfig(Section):
    """How new weights reach the rollout engines."""

    publish_every: int = Field(1, ge=1)
    """Publish a weight snapshot every N trainer steps."""
    keep_last: int = Field(3, ge=1)
    """Snapshots kept (plus pinned ones and any a reader holds a lease on)."""
    fast_path: Literal["auto", "gloo", "off"] = "auto"
    """Also send new weights over a process group when trainer rank 0 and the rollout workers can form one (the
    snapshot on disk stays the truth for late joiners and recovery): ``auto`` uses NCCL for GPU models and gloo on
    CPU; ``gloo`` sends GPU weights through host memory over TCP (roles sharing one GPU, which NCCL refuses, or nodes
    without a common NCCL fabric)."""
    verify: Literal["sha256", "size"] = "sha256"
    """How readers verify a snapshot before loading it."""
    files_every_s: float = Field(10.0, ge=0)
    """fully_async, while the fast path serves every rollout worker: write the snapshot files of a published version
    only if this many seconds passed since the last ones (the last step's always). Any worker off the fast path
    (starting, restarted, link down) makes every published version go to the files again. 0: always write them."""

    @field_validator("fast_path", mode="before")
    @classmethod
    def _yaml_bool(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` (and `on`) as a boolean
        return {False: "off", True: "auto"}.get(v, v) if isinstance(v, bool) else v


class StoreConfig(Section):
    """The sharded sample store."""

    retention: Literal["delete", "keep"] = "delete"
    """Consumed shards are deleted once a checkpoint covers them, or kept (debugging)."""
    stale_policy: Literal["drop", "flag"] = "drop"
    """Samples older than ``max_staleness`` versions: dropped (and counted) or kept and down-weighted by IS."""
    wait_timeout_s: float = Field(1800.0, gt=0)
    """How long the trainer waits for samples before failing the run."""


# ---------------------------------------------------------------------------------------------------------- launch
class RoleResources(Section):
    """Slurm resources of one role (ignored by the local executor, except ``env`` and ``cpu_affinity``)."""

    nodes: int = Field(1, ge=1)
    """Nodes for this role."""
    tasks_per_node: int = Field(1, ge=1)
    """Tasks (processes) per node."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node."""
    cpus_per_task: int = Field(1, ge=1)
    """CPUs per task."""
    mem_gb: float | None = None
    """Memory per node in GB (None = the partition's default)."""
    partition: str | None = None
    """Slurm partition (None = launch.partition)."""
    constraint: str | None = None
    """Slurm --constraint."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """Extra ``#SBATCH`` lines, e.g. ``--reservation=rl``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for this role."""
    cpu_affinity: list[int] | None = None
    """Local executor only: pin every process of this role to these CPU ids (``os.sched_setaffinity``), e.g. ``[0]``
    for the trainer and ``[1]`` for the rollout worker on a 2-core machine. None = no pinning. Slurm ignores it (use
    ``--cpu-bind`` through ``slurm`` or ``extra_sbatch`` there)."""
    slurm: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """More Slurm parameters by name (``exclude``, ``gres``, ``nodelist``, ``exclusive``, ``mail_type`` ...; the
    names of submitit's Slurm executor). An unknown name is an error listing the valid ones."""

    @field_validator("cpu_affinity")
    @classmethod
    def _cpu_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(c < 0 for c in v)):
            raise ValueError("cpu_affinity must be a non-empty list of CPU ids >= 0 (or null for no pinning)")
        return v

    @field_validator("slurm")
    @classmethod
    def _known_slurm_params(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v:
            from relax_hpc.launch.slurm_params import check_slurm_params

            check_slurm_params(v)
        return v


class LaunchConfig(Section):
    """Where and how the roles run."""

    executor: Literal["auto", "local", "slurm"] = "auto"
    """``auto``: Slurm when ``sbatch`` is on PATH, else local processes."""
    placement: Literal["hetjob", "separate"] = "hetjob"
    """fully_async on Slurm: one heterogeneous job (trainer and rollout het groups) or separate jobs."""
    partition: str | None = None
    """Default partition."""
    account: str | None = None
    """Slurm account."""
    qos: str | None = None
    """Slurm QOS."""
    time_min: int = Field(240, ge=1)
    """Time limit in minutes."""
    signal_delay_s: int = Field(120, ge=10)
    """Seconds before the time limit at which Slurm sends the preemption signal (USR2)."""
    max_requeues: int = Field(10, ge=0)
    """How often a preempted or timed-out trainer requeues itself."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run before each role (module load, conda activate ...)."""
    trainer: RoleResources = Field(default_factory=RoleResources)
    """Trainer resources."""
    rollout: RoleResources = Field(default_factory=RoleResources)
    """Rollout resources (one task per rollout worker)."""


class MonitorConfig(Section):
    """Metrics sinks and alerts."""

    tensorboard: bool = False
    """Also write TensorBoard event files to ``RUN_DIR/logs/tensorboard``."""
    wandb: bool = False
    """Also log to Weights & Biases (offline mode unless WANDB_MODE says otherwise)."""
    wandb_project: str = "relax-hpc"
    """W&B project."""
    alert_urls: list[str] = Field(default_factory=list)
    """Apprise URLs notified on a dead role, a NaN loss or a stall (always also written to the event log)."""
    stall_minutes: float = Field(15.0, gt=0)
    """No trainer progress for this long raises a stall alert."""
    dead_after_s: float = Field(120.0, gt=0)
    """A heartbeat older than this marks a role dead."""


# ---------------------------------------------------------------------------------------------------------- recipe
class RecipeConfig(Section):
    """A whole RL run."""

    name: str = "run"
    """Name of the run (run dirs and job names start with it)."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    mode: Literal["colocate", "fully_async"] = "colocate"
    """``colocate``: one group generates then trains (strictly on-policy). ``fully_async``: rollout workers and the
    trainer overlap, linked by the sample store and weight snapshots."""
    num_steps: int = Field(100, ge=1)
    """Trainer steps (one optimizer update each)."""
    max_staleness: int = Field(1, ge=0)
    """fully_async: how many policy versions a sample may lag the trainer. 0 = on-policy by version."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Policy model."""
    data: DataConfig
    """Prompts."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Objective."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Learner."""
    warmup: SFTWarmupConfig = Field(default_factory=SFTWarmupConfig)
    """Optional supervised warm-up."""
    weights: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """Weight sync."""
    store: StoreConfig = Field(default_factory=StoreConfig)
    """Sample store."""
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    """Executor and Slurm resources."""
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """Metrics sinks and alerts."""
