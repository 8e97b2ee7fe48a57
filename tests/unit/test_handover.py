"""Background snapshots of the ``memory`` transport (weights/transport/memory.py) and background GPU checkpoints
(trainer/gpu_checkpoint.py), both over the backend's one asynchronous host copy, through the real SnapshotFiles and
publisher: on the CPU the plain path (the snapshot holds the weights of the version handed
over); on a GPU (marked ``gpu``) the pinned copy on a side stream: the snapshot holds the version's weights even though
the next optimizer step runs right after, a version is skipped while a write is running, a final one always lands."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from relax_hpc.rundir import RunDir
from relax_hpc.weights import SnapshotPublisher, latest_version
from relax_hpc.weights.reader import load_snapshot
from relax_hpc.weights.transport.memory import BackgroundSnapshots


def setup(tmp_path, device: str):
    """The real torch backend (tiny Qwen3) and the real SnapshotFiles/publisher."""
    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
    from relax_hpc.trainer.backend import make_backend
    from relax_hpc.weights.transport.files import SnapshotFiles
    from tests.helpers.backend_conformance import make_cfg

    cfg = make_cfg(trainer={"device": device})
    tok = build_digits_tokenizer()
    model = build_tiny_model(cfg.model.tiny, len(tok), seed=0, pad_token_id=tok.pad_token_id).to(device)
    trainer = make_backend(cfg, rank=0, world_size=1, device=device, dtype=torch.float32,
                           algorithm=get_algorithm(cfg.algorithm.name), tokenizer=tok, model=model)
    rd = RunDir.create(tmp_path / "run")
    session = SimpleNamespace(publisher=SnapshotPublisher(rd, keep_last=10), run_dir=rd, trainer=trainer)
    return trainer.model, trainer.optimizer, rd, trainer, SnapshotFiles(session)


def train_once(model, opt) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 16), device=next(model.parameters()).device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def snapshot(rd: RunDir, version: int) -> dict[str, torch.Tensor]:
    return load_snapshot(rd.snapshot(version))[0]


def test_cpu_hand_over_publishes_the_version(tmp_path) -> None:
    model, opt, rd, trainer, files = setup(tmp_path, "cpu")
    assert trainer.host_copy_async() is None  # the CPU has no asynchronous host copy: a synchronous one
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    snaps = BackgroundSnapshots(files)
    assert snaps.publish(1)
    assert snaps.async_copy is False
    train_once(model, opt)  # the weights move on; the snapshot must not
    files.close()
    got = snapshot(rd, 1)
    assert latest_version(rd) == 1
    for k in got:
        assert torch.equal(got[k], want[k]), k
    assert any(not torch.equal(v.detach(), want[k]) for k, v in model.state_dict().items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_hand_over_in_the_background(tmp_path) -> None:
    model, opt, rd, _, files = setup(tmp_path, "cuda")
    train_once(model, opt)
    want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    snaps = BackgroundSnapshots(files)
    snaps.publish(1)
    assert snaps.async_copy is True
    train_once(model, opt)  # queued right behind the copy: the pre-hook orders it after
    moved = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    files.drain()
    got = snapshot(rd, 1)
    assert any(not torch.equal(moved[k], want[k]) for k in want)
    for k in got:
        assert torch.equal(got[k], want[k]), k
    # a write still running: the next non-final version is skipped, a final one waits and lands
    gate = threading.Event()
    files.pending = files.pool.submit(gate.wait, 30)
    assert not snaps.publish(2)
    assert snaps.skipped == 1
    threading.Timer(0.5, gate.set).start()
    want3 = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    assert snaps.publish(3, final=True)
    files.close()
    assert latest_version(rd) == 3 and not rd.snapshot(2).exists()
    got3 = snapshot(rd, 3)
    for k in got3:
        assert torch.equal(got3[k], want3[k]), k


def test_gpu_checkpoint_capture_not_on_cpu(tmp_path) -> None:
    from relax_hpc.trainer.gpu_checkpoint import capture_on_gpu

    _, _, _, trainer, files = setup(tmp_path, "cpu")
    assert capture_on_gpu(trainer) is None
    files.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_checkpoint_in_the_background(tmp_path) -> None:
    """The checkpoint holds the weights and optimizer state of the step it was taken at, though the next optimizer
    step is queued right behind the copies; it loads back through the plain checkpoint reader."""
    from relax_hpc.trainer.checkpoint import load_checkpoint, save_checkpoint
    from relax_hpc.trainer.gpu_checkpoint import capture_on_gpu

    model, opt, rd, trainer, files = setup(tmp_path, "cuda")
    train_once(model, opt)
    want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    want_m = {k: v.detach().cpu().clone() for k, v in opt.state[model.model.norm.weight].items()}
    data, wait = capture_on_gpu(trainer)
    train_once(model, opt)
    wait()
    save_checkpoint(rd, 1, data=data, state={"version": 1})
    model_sd, optim_sd, _ = load_checkpoint(rd.checkpoint(1))
    assert any(not torch.equal(v.detach().cpu(), want[k]) for k, v in model.state_dict().items())
    for k in want:
        assert torch.equal(model_sd[k], want[k]), k
    st = optim_sd["state"]["model.norm.weight"]
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(st[k], want_m[k]), k
    files.close()
