"""LoRA runs through the CLI: a target module the model lacks stops the run with one line (exit 2); a colocate run
publishes adapter-only snapshots, checkpoints the adapter, and resumes from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.runutil import DEMO, cli, events, metrics

SHORT = ("--set", "warmup.steps=0", "--set", "rollout.prompts_per_step=4", "--set", "rollout.n_samples=4")


@pytest.mark.integration
def test_a_target_module_the_model_lacks_fails_the_run_in_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), "--set", "num_steps=2",
               "--set", "model.lora={rank: 8, target_modules: [q_proj, nosuch]}", *SHORT, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "model.lora.target_modules" in lines[0] and "'nosuch'" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.integration
def test_a_lora_run_publishes_adapters_and_resumes_from_its_adapter_checkpoint(tmp_path: Path) -> None:
    from safetensors import safe_open

    run = tmp_path / "run"
    lora = ("--set", "model.lora={rank: 8}", "--set", "trainer.checkpoint_every=2",
            "--set", "trainer.async_checkpoint=false")
    proc = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), "--set", "num_steps=2", *lora,
               *SHORT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    snap = run / "weights" / "v000002"
    manifest = json.loads((snap / "manifest.json").read_text())
    assert manifest["adapter"]["base"]["path"] == "tiny" and len(manifest["adapter"]["base"]["sha256"]) == 64
    assert (snap / "adapter_model.safetensors").is_file() and (snap / "adapter_config.json").is_file()
    assert all(".lora_" in name for name in manifest["tensors"])
    with safe_open(str(run / "checkpoints" / "step_00000002" / "model.safetensors"), "pt") as f:
        assert all("lora_" in k for k in f.keys())  # noqa: SIM118 (safe_open has keys(), no iteration)
    # the same run, two steps more: it resumes from the adapter checkpoint
    cfg = json.loads((run / "config.json").read_text())
    cfg["num_steps"] = 4
    (run / "config.json").write_text(json.dumps(cfg))
    (run / "STATUS.json").unlink(missing_ok=True)
    proc = cli("resume", str(run), "--wait", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    resumed = [e for e in events(run, "colocate-0") if e.get("event") == "resumed"]
    assert resumed and resumed[-1]["step"] == 2
    steps = [r["step"] for r in metrics(run, "colocate-0") if "rollout/reward" in r["metrics"]]
    assert steps == [1, 2, 3, 4], steps


@pytest.mark.integration
def test_a_fully_async_lora_run_sends_adapters_to_the_workers(tmp_path: Path) -> None:
    """The workers' hf engines merge the adapter versions they get over the process-group link (adapter-shaped
    buffers) or from the files; no hand-over falls back or fails."""
    run = tmp_path / "run"
    proc = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), "--set", "mode=fully_async",
               "--set", "num_steps=4", "--set", "model.lora={rank: 8}", *SHORT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    evs = [e for w in (0, 1) for e in events(run, f"rollout-{w}")]
    assert not [e for e in evs if e.get("event") == "weight_fallback" or e.get("level") == "error"], evs
    assert json.loads((run / "weights" / "v000004" / "manifest.json").read_text())["adapter"]
