"""Typed recipe schema. Imports no torch: the CLI, the launcher and the monitor validate recipes without it.

Precedence, stated once: ``--set`` overrides > recipe file > defaults below. Every field has a docstring (shown by
``relax-hpc validate --explain`` and in the README's recipe reference).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relax_hpc.config.eval import EvalConfig

INT_LIMIT = 2**63 - 1
"""Largest integer any field takes (torch's int64); seeds are further limited to what numpy takes."""
SEED_LIMIT = 2**32 - 1
"""Largest seed (numpy's ``RandomState`` refuses more)."""
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
"""A run name: becomes a folder name under ``runs/`` and a Slurm job name."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings become descriptions; NaN and
    infinities are refused in every float; integers must fit in 64 bits."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _fits_int64(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT_LIMIT:
            raise ValueError(f"must fit in a 64-bit integer (|value| <= {INT_LIMIT})")
        return v


# ---------------------------------------------------------------------------------------------------------- model
class TinyModelConfig(Section):
    """Shape of a built-in tiny model made from config with random weights (no download)."""

    arch: Literal["qwen3", "qwen2_5_vl", "qwen3_vl", "qwen2_audio", "qwen2_5_omni", "qwen3_omni"] = "qwen3"
    """Architecture family of the tiny model (``qwen2_5_omni`` / ``qwen3_omni``: the thinker of Qwen2.5-Omni /
    Qwen3-Omni-MoE, taking text, images, audios and videos; ``qwen3_vl``: Qwen3-VL, images and videos with
    timestamps)."""
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
    tie_embeddings: bool = True
    """Share the input embedding with the output layer (as Qwen3 <= 4B do). ``False`` for the ``vllm`` engine on the
    CPU: vLLM's CPU backend does not refresh a tied output layer on an in-place weight reload, so the engine would
    restart its server on every update."""

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}")
        return self


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
    init_seed: int = Field(0, ge=0, le=SEED_LIMIT)
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

    @model_validator(mode="after")
    def _lengths(self) -> TaskConfig:
        if self.min_len > self.max_len:
            raise ValueError(f"min_len={self.min_len} is larger than max_len={self.max_len}")
        return self


MEDIA_OPTION_KEYS = ("image_min_pixels", "image_max_pixels", "video_fps", "video_min_frames", "video_max_frames",
                     "video_min_pixels", "video_max_pixels", "use_audio_in_video")
"""The media knobs a data row may override for itself (its ``media_options`` field)."""


class MediaConfig(Section):
    """How images, audios and videos become model tensors, and where (inline, or a pool of worker processes). A knob
    left ``None`` keeps the model's processor default; a row's ``media_options`` field (a dict of the image/video
    knobs) overrides them for that row."""

    pool_size: int = Field(0, ge=0)
    """Worker processes that preprocess media (decode, resize, frame sampling, feature extraction), started once,
    each holding its processor; tensors come back through shared memory. 0: inline in the rollout process."""
    prefetch_batches: int = Field(2, ge=1)
    """Prompt batches the pool prepares ahead of the one the rollout takes (the bound of its queue)."""
    item_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for one prompt's tensors before its worker counts as hung (restarted, the item retried once)."""
    image_min_pixels: int | None = Field(None, ge=1)
    """Fewest pixels an image is resized to (before patching)."""
    image_max_pixels: int | None = Field(None, ge=1)
    """Most pixels an image is resized to."""
    video_fps: float | None = Field(None, gt=0)
    """Frames sampled per second of video (default 2)."""
    video_min_frames: int | None = Field(None, ge=1)
    """Fewest frames sampled from a video (capped by its length)."""
    video_max_frames: int | None = Field(None, ge=1)
    """Most frames sampled from a video."""
    video_min_pixels: int | None = Field(None, ge=1)
    """Fewest pixels per video frame after resizing."""
    video_max_pixels: int | None = Field(None, ge=1)
    """Most pixels per video frame after resizing."""
    use_audio_in_video: bool | None = None
    """Omni thinkers (Qwen2.5-Omni, Qwen3-Omni): each video's audio track is decoded (PyAV), resampled to the
    feature extractor's rate and fed as the sample's audio, its tokens interleaved with the frames' as the model's
    processor lays them out (a video without an audio track stays silent). A row with videos and audios of its own
    cannot use it."""
    audio_sampling_rate: int | None = Field(None, ge=1000)
    """Rate audio is resampled to; must be the rate the model's feature extractor was built for (default: its
    own)."""
    options_key: str = "media_options"
    """Row field holding per-row overrides of the image/video knobs above (and ``use_audio_in_video``)."""

    def options(self) -> dict[str, Any]:
        """The image/video knobs that are set (``MEDIA_OPTION_KEYS``)."""
        return {k: getattr(self, k) for k in MEDIA_OPTION_KEYS if getattr(self, k) is not None}


class DataConfig(Section):
    """Where prompts come from."""

    path: str | None = None
    """JSONL, JSON or Parquet file, a folder of them, or a folder saved by HF ``datasets`` (``save_to_disk``). Relative
    paths are resolved against the recipe's folder. ``None`` uses ``task``."""
    task: TaskConfig | None = None
    """Built-in synthetic task, used when ``path`` is not set."""
    prompt_key: str = Field("prompt", min_length=1)
    """Field holding the prompt: a string, or a list of chat messages."""
    answer_key: str = Field("answer", min_length=1)
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
    media: MediaConfig = Field(default_factory=MediaConfig)
    """Media preprocessing (images, audios, videos): the processor pool and its knobs."""

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
    """``files``: the server loads each snapshot folder from the run dir; ``distributed``: the trainer broadcasts
    the buckets to the servers over a process group (SGLang ``/update_weights_from_distributed``, vLLM's
    weight-transfer engine); any failure falls back to the files, logged as an event."""
    sync_timeout_s: float = Field(300.0, gt=0)
    """Bound on one weight update of a server (either path) before it counts as failed."""


class SandboxConfig(Section):
    """How code and shell tools run: a subprocess per call (see relax_hpc/envs/sandbox.py)."""

    timeout_s: float = Field(10.0, gt=0)
    """Wall-clock limit of one call; past it the call's whole process group (and PID namespace) is killed."""
    cpu_s: int = Field(10, ge=1)
    """CPU-seconds limit (RLIMIT_CPU)."""
    memory_mb: int = Field(1024, ge=16)
    """Address-space limit (RLIMIT_AS) in MiB; an allocation past it fails inside the call."""
    max_processes: int = Field(64, ge=1)
    """Processes the call may have at once (RLIMIT_NPROC; set only when calls run as ``nobody``, since the limit
    counts every process of the user)."""
    max_file_mb: int = Field(64, ge=1)
    """Largest file the call may write (RLIMIT_FSIZE) in MiB."""
    max_output_bytes: int = Field(65536, ge=64)
    """Stdout/stderr kept per call (the rest is cut with a marker)."""
    network: Literal["off", "on"] = "off"
    """``off``: the call runs in its own network namespace (``unshare -n``) with only a loopback device, where the
    machine allows unprivileged namespaces (else a warning once, and the call runs with the host network)."""
    drop_privileges: bool = True
    """When the role runs as root, run calls as ``nobody`` (``setpriv``): writes outside the call's directory are
    then refused by file permissions."""
    env_allow: list[str] = Field(default_factory=lambda: ["PATH", "LANG", "LC_ALL"])
    """Environment variables passed to a call (everything else, secrets included, is stripped)."""
    python: str | None = None
    """Interpreter of the Python tool (None: this role's interpreter when the sandbox user can run it, else
    ``/usr/bin/python3``)."""
    wrapper: list[str] = Field(default_factory=list)
    """Command prefix that runs a call in a site's container runtime instead of the namespaces above, e.g.
    ``[apptainer, exec, --containall, --net, --network, none, tools.sif]`` or ``[enroot, start, tools]``; the
    call's directory is the working directory, mounted by the runtime's own options."""


class EnvConfig(Section):
    """A multi-turn environment (agentic RL): each sample is an episode of model turns and environment answers."""

    name: str
    """Built-in environment (``calculator``, ``python_tool``, ``guess_number``, ``digit_lookup``) or
    ``module:Class`` / ``path/to/file.py:Class`` of a user one (see relax_hpc/envs/api.py). Checked when the config
    is validated."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments given to the environment's constructor."""
    max_turns: int = Field(4, ge=1)
    """Most assistant turns per episode."""
    max_total_tokens: int = Field(2048, ge=16)
    """Most tokens per sample (prompt, generated and environment tokens); a turn is cut to what is left."""
    max_turn_tokens: int | None = Field(None, ge=1)
    """Most tokens per assistant turn (None = ``rollout.sampling.max_new_tokens``)."""
    max_tool_output_tokens: int = Field(256, ge=1)
    """An environment message longer than this many tokens is cut, with ``truncation_marker`` appended."""
    truncation_marker: str = "...[truncated]"
    """Appended to a cut environment message."""
    step_timeout_s: float = Field(60.0, gt=0)
    """Limit of one ``reset``/``step`` call of the environment; past it the episode fails (see ``on_error``)."""
    tool_timeout_s: float = Field(30.0, gt=0)
    """Limit of one tool call (sandboxed tools also have ``sandbox.timeout_s``); past it the model gets an error."""
    tool_parser: str = "hermes"
    """How tool calls are read from a turn: ``hermes`` (Qwen/Hermes ``<tool_call>{json}</tool_call>``), ``none``,
    or ``module:Class`` with a ``parse(text)`` method."""
    reward: Literal["env", "function", "both"] = "env"
    """Where the episode's reward comes from: the environment's step rewards (summed), the recipe's ``reward``
    function on the final assistant turn, or both (weighted sum)."""
    env_reward_weight: float = 1.0
    """Weight of the environment reward when ``reward`` is ``both``."""
    function_reward_weight: float = 1.0
    """Weight of the reward function when ``reward`` is ``both``."""
    on_error: Literal["drop", "zero"] = "drop"
    """An environment that raises or times out: count it, then drop the episode's whole group (``drop``) or keep the
    episode as it stands with reward 0 (``zero``)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra arguments of the chat template in episodes, e.g. ``{enable_thinking: false}`` for Qwen3."""
    max_samples_per_episode: int = Field(4, ge=1)
    """A chat template that is not prefix-preserving (it rewrites earlier turns, e.g. drops earlier reasoning)
    starts a new sample; an episode that would need more samples than this ends (counted as truncated)."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Sandbox of the code/shell tools."""

    @model_validator(mode="after")
    def _resolvable(self) -> EnvConfig:
        from relax_hpc.envs.parsers import resolve_parser
        from relax_hpc.envs.registry import check_env

        check_env(self.name, self.kwargs)
        resolve_parser(self.tool_parser)
        return self


class RolloutConfig(Section):
    """Generation: how many prompts and samples, with what engine."""

    engine: Literal["hf", "sglang", "vllm"] = "hf"
    """``hf``: transformers in-process; ``sglang`` / ``vllm``: inference servers on the rollout nodes
    (``rollout.server``)."""
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
    """SGLang-only server settings."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """Inference servers (``sglang``, ``vllm`` engines)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the ``hf`` engine runs."""
    hf_decoder: Literal["auto", "compiled", "generate"] = "auto"
    """How the ``hf`` engine decodes: ``auto`` = its own sampling loop with a KV cache for text prompts to a plain
    causal LM (same sampling as ``generate``, 1.3x as fast on the demo model: bench generate; on a GPU the loop's
    steps are captured as CUDA graphs), ``transformers.generate`` otherwise; ``compiled`` = ``auto``, and on a GPU
    each layer's elementwise work in the captured steps is fused by ``torch.compile`` (the first batches of each size
    pay the compilation); ``generate`` = always ``transformers.generate``."""
    env: EnvConfig | None = None
    """A multi-turn environment: every sample becomes an episode (None = single-turn prompts)."""


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
    """Built-in reward (``exact_match``, ``math``, ``format``, ``digits_positional``, ``multiple_choice``,
    ``boxed_answer``) or ``module:function`` /
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
class MegatronConfig(Section):
    """Parallel layout of the ``megatron`` trainer backend (data-parallel size implied: ``num_ranks / (tp * pp)``)."""

    tp: int = Field(1, ge=1)
    """Tensor-parallel size: must divide the attention heads, the key/value heads and the MLP intermediate size (the
    vocabulary is padded to a multiple of ``vocab_multiple * tp``)."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel size: must divide the number of layers (each stage holds an equal share)."""
    distributed_optimizer: bool = True
    """megatron-core's distributed optimizer: the AdamW state and the float32 main weights sharded over the
    data-parallel ranks (gradients reduce-scattered, weights all-gathered), and checkpoints in megatron's
    ``dist_checkpointing`` format possible besides the project's. ``false``: torch's AdamW over the DDP float32
    gradients, its state replicated on every data-parallel rank."""
    vocab_multiple: int = Field(128, ge=1)
    """The vocabulary is padded with zero rows to a multiple of ``vocab_multiple * tp`` (dropped again in HF
    weights)."""
    checkpoint_format: Literal["auto", "dist", "full"] = "auto"
    """The run's checkpoints. ``dist``: megatron's ``dist_checkpointing`` (every rank writes its own shards of the
    model and of the distributed optimizer's state, nothing is gathered to one host; loads at another data-parallel
    size, but only with the same ``tp``, ``pp`` and backend); needs ``distributed_optimizer``. ``full``: the project's
    format (the whole model and optimizer state under HF names, gathered to rank 0; loads in either backend at any
    layout). ``auto``: ``dist`` with the distributed optimizer, else ``full``. Either format resumes a checkpoint of
    the other where it can: a ``dist`` one with this backend, the distributed optimizer and its ``tp``/``pp``."""

    @model_validator(mode="after")
    def _dist_needs_the_distributed_optimizer(self) -> MegatronConfig:
        if self.checkpoint_format == "dist" and not self.distributed_optimizer:
            raise ValueError("checkpoint_format: dist needs the distributed optimizer (it holds the sharded state); "
                             "set distributed_optimizer: true, or checkpoint_format: full")
        return self


class TrainerConfig(Section):
    """The learner."""

    backend: Literal["torch", "megatron"] = "torch"
    """``torch`` (HF model, FSDP2 over ranks) or ``megatron`` (megatron-core ``GPTModel``: tensor x pipeline x data
    parallelism; runs on the CPU over gloo too; needs the ``megatron`` extra)."""
    num_ranks: int = Field(1, ge=1)
    """Data-parallel trainer ranks (FSDP2 ``fully_shard`` when > 1; gloo on CPU, NCCL on GPU)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer runs. ``cuda`` on a machine without a GPU is an error."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
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
    checkpoint_timeout_s: float = Field(1800.0, gt=0)
    """How long the leader waits for every rank's part of a sharded checkpoint (``trainer.megatron.checkpoint_format:
    dist``) before it fails the save; the previous checkpoint stays the latest."""
    async_checkpoint: bool = False
    """Write periodic checkpoints on a background thread: the step only takes a CPU copy of the weights, optimizer
    state and RNG (that much extra host memory while the write runs); the store position is committed once the
    checkpoint is durable. Checkpoints on a signal or at the end are always written before the role exits. Applies to
    the gathered format; megatron's ``dist`` checkpoints are written in the loop (every rank its own shards)."""
    export_final: bool = True
    """Export the final model in HF format to ``RUN_DIR/export``."""
    fused_head: bool = False
    """On a GPU, compile the chunked LM head's per-chunk elementwise work (log-sum-exp, gather, the softmax gradient)
    into fused kernels with ``torch.compile`` instead of ~8 passes over ``[chunk, vocabulary]`` float32 tensors; the
    first micro-batches pay the compilation, and a compile failure falls back to the eager chunks with one warning.
    Ignored on the CPU. Opt-in (compilation costs the first steps); measured with ``compile_layers`` in
    docs/benchmarks.md ("The compiled paths")."""
    compile_layers: bool = False
    """On a GPU, ``torch.compile`` the model's decoder layers for the training forward and backward (fuses each
    layer's small elementwise kernels: RoPE, SiLU x up, residual adds, casts). Generation, checkpoints and exports keep
    the eager layers. The first micro-batches pay the compilation; a compile failure falls back to the eager layers
    with one warning. Ignored on the CPU."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Parallel layout of ``backend: megatron`` (ignored by ``torch``); with it, ``num_ranks`` counts every trainer
    process (data x tensor x pipeline)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf loss or gradient norm: ``stop`` the run with an alert (it ends failed, not completed), or ``skip``
    the update, count it (``train/nonfinite_skipped``) and alert once."""
    max_nonfinite_skips: int = Field(10, ge=0)
    """With ``on_nonfinite: skip``: more non-finite steps than this in a row stop the run."""

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"AdamW betas must each be in [0, 1), got {list(v)}")
        return v


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
    source: Literal["data", "env"] = "data"
    """Where the supervised examples come from: ``data``, (prompt, reference answer) pairs; ``env``, the episode
    environment's ``warmup_examples(task, rng)`` hook on the data's prompts (agentic recipes: ``rollout.env`` must
    name an environment that has the hook, see docs/agentic.md). With ``env``, ``batch_size`` counts prompts, each
    giving the environment's examples."""


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
    """Samples older than ``max_staleness`` versions: dropped (and counted), or kept and flagged: the trainer clips
    their ratio around its own current log-probs and weights their tokens by the truncated importance weight
    ``min(exp(logp_now - logp_rollout), algorithm.tis_cap)``."""
    wait_timeout_s: float = Field(1800.0, gt=0)
    """How long the trainer waits for samples before failing the run."""
    keep_plans: int = Field(16, ge=0)
    """Batch plans (which groups each step trained on) kept below the committed step; older ones are deleted at
    each commit. A large value keeps the whole audit trail that ``relax_hpc.store.audit`` checks (the chaos
    bench keeps every plan)."""


# ---------------------------------------------------------------------------------------------------------- launch
class RoleResources(Section):
    """Slurm resources of one role and how its dead processes are restarted (the local executor uses ``env``,
    ``cpu_affinity``, ``gpus`` and the restart fields only)."""

    nodes: int = Field(1, ge=1)
    """Nodes for this role."""
    tasks_per_node: int = Field(1, ge=1)
    """Tasks (processes) per node."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node."""
    cpus_per_task: int = Field(1, ge=1)
    """CPUs per task."""
    mem_gb: float | None = Field(None, gt=0)
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
    gpus: list[int] | None = None
    """Local executor only: the GPU ids of this role's processes, rank ``r`` on ``gpus[r % len(gpus)]``. Its
    ``CUDA_VISIBLE_DEVICES`` lists that GPU first (so its ``cuda`` device is that GPU), then every other GPU up to
    the highest id either role names (so NCCL still sees them for peer-to-peer copies), e.g. ``[0]`` for the trainer
    and ``[1]`` for the rollout worker on a 2-GPU machine. None = the environment's ``CUDA_VISIBLE_DEVICES`` (a
    trainer of several ranks takes GPU ``rank % count``). Slurm ignores it (it assigns GPUs by ``gpus_per_node``)."""
    max_restarts: int = Field(5, ge=0)
    """How often the role supervisor restarts a dead process of this role (killed by a signal or silent for
    ``monitor.dead_after_s``; a rollout worker also after it failed), per rank and launcher (or Slurm job)
    incarnation; 0: never. A restarted trainer resumes from its newest complete checkpoint, a restarted rollout
    worker rejoins at the latest snapshot. Roles whose ranks form a process group (a trainer of several ranks)
    restart as a whole: the death of any rank stops the others by pid and starts every rank again (each rank's
    restart counts here). Ranks started by ``launcher: torchrun`` are not supervised."""
    restart_backoff_s: float = Field(1.0, ge=0, le=3600)
    """Seconds before the first restart of a rank; each further restart of the same rank waits twice as long."""
    restart_backoff_max_s: float = Field(60.0, ge=0, le=86400)
    """The longest wait before a restart."""
    slurm: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """More Slurm parameters by name (``exclude``, ``gres``, ``nodelist``, ``exclusive``, ``mail_type`` ...; the
    names of submitit's Slurm executor). An unknown name is an error listing the valid ones."""
    launcher: Literal["srun", "torchrun"] = "srun"
    """Slurm: how the role's ranks start. ``srun``: one Slurm task per rank (``nodes x tasks_per_node`` tasks, the
    rank from ``SLURM_PROCID``). ``torchrun`` (the trainer role only): one Slurm task per node running
    ``torchrun --nnodes=nodes --nproc-per-node=tasks_per_node`` with a c10d rendezvous on the first node; ranks and
    the process group come from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``); ``nodes x
    tasks_per_node`` must equal ``trainer.num_ranks``, and each node gets ``tasks_per_node x cpus_per_task`` CPUs."""
    torchrun_port: int = Field(29500, ge=1024, le=65535)
    """``launcher: torchrun``: the TCP port of the c10d rendezvous on the role's first node."""

    @field_validator("cpu_affinity")
    @classmethod
    def _cpu_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(c < 0 for c in v)):
            raise ValueError("cpu_affinity must be a non-empty list of CPU ids >= 0 (or null for no pinning)")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpu_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(g < 0 for g in v)):
            raise ValueError("gpus must be a non-empty list of GPU ids >= 0 (or null: the environment's GPUs)")
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

    @model_validator(mode="after")
    def _torchrun_is_for_the_trainer(self) -> LaunchConfig:
        if self.rollout.launcher != "srun":
            raise ValueError("launch.rollout.launcher: torchrun starts trainer ranks only; rollout workers are one "
                             "Slurm task each (launcher: srun)")
        return self


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
    reward_error_alert: float = Field(0.5, ge=0.0, le=1.0)
    """Alert when the reward function fails on more than this fraction of the samples of the last few steps."""
    truncation_alert: float = Field(0.9, ge=0.0, le=1.0)
    """Alert when more than this fraction of the last few steps' responses hit ``max_new_tokens``."""


# ---------------------------------------------------------------------------------------------------------- recipe
class RecipeConfig(Section):
    """A whole RL run."""

    name: str = "run"
    """Name of the run (run dirs and job names start with it): letters, digits, ``.``, ``_``, ``-``; no path
    separators; at most 100 characters."""
    seed: int = Field(0, ge=0, le=SEED_LIMIT)
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
    eval: EvalConfig | None = None
    """Evaluation on a held-out set during training (None = none); see :mod:`relax_hpc.config.eval`."""

    @model_validator(mode="after")
    def _megatron_layout(self) -> RecipeConfig:
        if self.trainer.backend == "megatron":
            from relax_hpc.config.checks import check_megatron

            check_megatron(self)
        return self

    @model_validator(mode="after")
    def _env_warmup(self) -> RecipeConfig:
        if self.warmup.source == "env" and self.warmup.steps:
            from relax_hpc.envs.registry import check_warmup_hook

            if self.rollout.env is None:
                raise ValueError("warmup.source: env needs rollout.env (an episode environment)")
            check_warmup_hook(self.rollout.env.name)
        return self

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        import re

        if not re.match(NAME_PATTERN, v):
            shown = v if len(v) <= 60 else f"{v[:60]}... ({len(v)} chars)"
            raise ValueError(f"{shown!r} is not a safe run name: use 1-100 letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit (it becomes a folder under runs/)")
        return v
