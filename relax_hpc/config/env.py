"""``rollout.env``: a multi-turn environment and the sandbox of its tools."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from relax_hpc.config.base import Section


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
