"""What the benchmarks share: the demo recipe, the machine's description, metric values from event-log records,
scratch run dirs, one error line and an exit code for what goes wrong, and printing the result."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax_hpc.rundir import RunDir

DEMO_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "demo.yaml"


def metric_value(m: dict[str, Any], key: str) -> float:
    v = m.get(key, 0.0)
    return float(v) if isinstance(v, (int, float)) else float("nan")


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import torch

    return {"cpu": model, "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def finite(value: Any) -> Any:
    """JSON has no NaN: a figure that could not be computed (a standard error of one step) becomes null."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


class ScratchDirs:
    """The run dirs of a benchmark under ``--out`` (default: a new temporary folder), removed at the end unless
    ``--keep``; ``report`` then writes ``result.json`` beside them."""

    def __init__(self, out: str | None, *, keep: bool, prefix: str):
        self.made = out is None
        self.root = Path(tempfile.mkdtemp(prefix=prefix)) if out is None else Path(out)
        self.keep = keep
        self.created: list[Path] = []

    def new(self, name: str) -> Path:
        path = self.root / name
        self.created.append(path)
        return path

    def clean(self) -> None:
        if self.keep:
            return
        for d in self.created:
            shutil.rmtree(d, ignore_errors=True)
        if self.made:
            shutil.rmtree(self.root, ignore_errors=True)


def run_guarded(body: Callable[[], dict[str, Any]], dirs: ScratchDirs) -> dict[str, Any] | int:
    """Run a benchmark's body: its result, or an exit code after one error line (2 bad input, 1 failure, 130
    interrupted); the scratch dirs are cleaned up either way."""
    from relax_hpc.errors import ConfigError, RelaxError, UserError

    try:
        return body()
    except (ConfigError, UserError) as exc:
        for line in getattr(exc, "problems", None) or [str(exc)]:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except (RelaxError, RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        dirs.clean()


def report(res: dict[str, Any], dirs: ScratchDirs, *, as_json: bool, text: Callable[[dict[str, Any]], None]) -> int:
    """Print the result (JSON or text) and, with ``--keep``, write it to ``result.json`` beside the run dirs."""
    res = finite(res)
    if dirs.keep:
        (dirs.root / "result.json").write_text(json.dumps(res, indent=1, allow_nan=False))
    if as_json:
        print(json.dumps(res, indent=1, allow_nan=False))
    else:
        text(res)
    return 0


def measure_and_print(recipe: Path, body: Callable[[], dict[str, Any]], *, as_json: bool) -> int:
    """The end of a measuring command: exit 2 after one ``error:`` line where ``recipe`` is missing or the input is
    bad (a ``ValueError``, of which :class:`~relax_hpc.errors.UserError` is one; a ``ConfigError`` gives a line per
    problem), else 0 after printing the result of ``body()`` (JSON, or a field a line)."""
    from relax_hpc.errors import ConfigError

    if not recipe.is_file():
        print(f"error: recipe {recipe} not found (give --recipe)", file=sys.stderr)
        return 2
    try:
        res = body()
    except ValueError as exc:
        for line in exc.problems if isinstance(exc, ConfigError) else [(str(exc).splitlines() or [""])[0]]:
            print(f"error: {line}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(res, indent=1))
    else:
        print_fields(res)
    return 0


def print_fields(res: dict[str, Any], width: int = 32) -> None:
    """One ``name value`` line per entry (floats to 4 significant digits)."""
    for k, v in res.items():
        print(f"{k:{width}s} {v:.4g}" if isinstance(v, float) else f"{k:{width}s} {v}")


def read_records(run_dir: RunDir, proc: str) -> list[dict[str, Any]]:
    """Every parseable record of one process's event log (a missing log is empty)."""
    path = run_dir.event_log(proc)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def model_like_state_dict(gb: float, seed: int = 0) -> dict[str, Any]:
    """Random tensors shaped like a decoder LLM of about ``gb`` GB: bf16 embeddings and layers, fp32 norms."""
    import torch

    hidden, inter, vocab = (2048, 5632, 32000) if gb >= 0.5 else (512, 1408, 8000)
    layer_bytes = 2 * (4 * hidden * hidden + 3 * hidden * inter) + 2 * 4 * hidden
    embed_bytes = 2 * vocab * hidden
    layers = max(1, round((gb * 1e9 - 2 * embed_bytes) / layer_bytes))
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": rand(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"{p}self_attn.{name}.weight"] = rand(hidden, hidden)
        sd[f"{p}mlp.gate_proj.weight"] = rand(inter, hidden)
        sd[f"{p}mlp.up_proj.weight"] = rand(inter, hidden)
        sd[f"{p}mlp.down_proj.weight"] = rand(hidden, inter)
        sd[f"{p}input_layernorm.weight"] = rand(hidden, dtype=torch.float32)
        sd[f"{p}post_attention_layernorm.weight"] = rand(hidden, dtype=torch.float32)
    sd["model.norm.weight"] = rand(hidden, dtype=torch.float32)
    sd["lm_head.weight"] = rand(vocab, hidden)
    return sd
