"""Conformance of every weight transport (relax_hpc/weights/transport/): the trainer side sends a version, the
rollout side receives it and its engine holds exactly the trainer's tensors; when the transport's own path fails
the version comes from the snapshot files and the event log says so (event ``weight_fallback``).

Real parts throughout: the torch backend on the tiny model, the real publisher and snapshot files, a real ``hf``
engine holding its own model, real gloo links between the trainer (its own process, killed to break the link) and
the worker's receiver in this process; for the ``server`` transport the SGLang stand-in
(``tests/helpers/sglang_standin.py``:
a real HTTP server process with a HF model behind SGLang's endpoints, SGLang cannot run here), whose weights are
checked by its greedy output against HF with the trainer's tensors.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from relax_hpc.rundir import RunDir

BASE = {"data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"}, "rollout": {"device": "cpu"},
        "mode": "fully_async"}

SENDER = textwrap.dedent("""
    import json, sys, torch
    from safetensors.torch import save_file
    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.config.load import validate_dict
    from relax_hpc.events import EventLog
    from relax_hpc.models.load import load_model, load_tokenizer
    from relax_hpc.rundir import RunDir
    from relax_hpc.trainer.backend import make_backend
    from relax_hpc.trainer.session import TrainerSession
    from relax_hpc.weights.transport import make_sender
    rd, cfg, out = RunDir(sys.argv[1]), validate_dict(json.loads(sys.argv[2])), sys.argv[3]
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, device="cpu", dtype=torch.float32, seed=5)
    trainer = make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32,
                           algorithm=get_algorithm(cfg.algorithm.name), tokenizer=tok, model=model)
    session = TrainerSession(rd, cfg, trainer, tok, EventLog(rd, "trainer", 0))
    session.publish()
    sender = make_sender(cfg, session, run_dir=rd, rank=0, device="cpu")
    sender.start(0)

    def save(v):
        sd = {k: t.detach().clone().contiguous() for k, t in model.state_dict().items()}
        save_file(sd, f"{out}/v{v}.safetensors")

    save(0)
    print(json.dumps({"ready": 0, "kind": sender.kind}), flush=True)
    for line in sys.stdin:
        v = int(line)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # "training"
        trainer.step = v
        sender.send(v)
        save(v)
        print(json.dumps({"sent": v}), flush=True)
    sender.close()
""")


class Trainer:
    """The trainer side in its own process: ``send(v)`` changes its weights and sends them as version ``v``."""

    def __init__(self, rd: RunDir, cfg: dict[str, Any], out: Path):
        self.out = out
        self.proc = subprocess.Popen([sys.executable, "-c", SENDER, str(rd.root), json.dumps(cfg), str(out)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.kind = self._line()["kind"]

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read() if self.proc.stderr else ""
        return json.loads(line)

    def send(self, version: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{version}\n")
        self.proc.stdin.flush()
        assert self._line() == {"sent": version}

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(self.out / f"v{version}.safetensors")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)


def worker_side(rd: RunDir, cfg: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(receiver, engine, its event log) of rollout worker 0, the engine on a model of its own."""
    from relax_hpc.config.load import validate_dict
    from relax_hpc.events import EventLog
    from relax_hpc.models.load import load_tokenizer
    from relax_hpc.modes.components import build_engine
    from relax_hpc.weights.transport import make_receiver

    c = validate_dict(cfg)
    engine = build_engine(c, load_tokenizer(c.model), seed=0)
    events = EventLog(rd, "rollout", 0)
    return make_receiver(c, engine, run_dir=rd, rank=0, proc="rollout-0", events=events), engine, events


def same(engine: Any, want: dict[str, torch.Tensor]) -> bool:
    got = engine.weight_template()
    return set(got) == set(want) and all(torch.equal(got[k].detach(), want[k]) for k in want)


def fallbacks(rd: RunDir) -> list[dict[str, Any]]:
    lines = rd.event_log("rollout-0").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == "weight_fallback"]


def wait_latest(rd: RunDir, version: int, timeout_s: float = 60.0) -> None:
    from relax_hpc.weights import latest_version

    deadline = time.monotonic() + timeout_s
    while latest_version(rd) != version:
        assert time.monotonic() < deadline, f"LATEST never named v{version}"
        time.sleep(0.05)


def test_files_transport(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    cfg = {**BASE, "weights": {"transport": {"kind": "files"}}}
    trainer = Trainer(rd, cfg, tmp_path)
    receiver, engine, _ = worker_side(rd, cfg)
    try:
        assert trainer.kind == "files" and receiver.kind == "files" and not receiver.fast
        assert asyncio.run(receiver.update(files_first=True)) == (0, "file")
        assert same(engine, trainer.weights(0))
        trainer.send(1)
        wait_latest(rd, 1)
        assert asyncio.run(receiver.update(files_first=False)) == (1, "file")
        assert same(engine, trainer.weights(1)) and not same(engine, trainer.weights(0))
    finally:
        trainer.kill()
        receiver.close()
    assert not fallbacks(rd)  # the files are the fallback: nothing to fall back from


def test_process_group_transport_and_its_fallback(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    cfg = {**BASE, "weights": {"transport": {"kind": "process_group", "files_every_s": 3600}}}
    trainer = Trainer(rd, cfg, tmp_path)
    receiver, engine, _ = worker_side(rd, cfg)
    loop = asyncio.new_event_loop()
    try:
        assert trainer.kind == "process_group" and receiver.fast
        assert loop.run_until_complete(receiver.update(files_first=True)) == (0, "file")
        assert same(engine, trainer.weights(0))
        trainer.send(1)  # over the link only: files_every_s keeps v1 off the disk while the link serves
        deadline = time.monotonic() + 120
        while engine.version < 1:
            assert time.monotonic() < deadline, "v1 never came over the link"
            loop.run_until_complete(receiver.pull())
            time.sleep(0.05)
        assert same(engine, trainer.weights(1))
        assert not fallbacks(rd)
        # the trainer dies (the link with it); its successor publishes v2 as files only: the worker takes them
        want2 = trainer.weights(1)
        trainer.kill()
        from relax_hpc.weights import SnapshotPublisher

        want2 = {k: v + 0.5 for k, v in want2.items()}
        SnapshotPublisher(rd).publish(want2, version=2, step=2)
        assert loop.run_until_complete(receiver.update(files_first=False)) == (2, "file")
        assert same(engine, want2)
    finally:
        trainer.kill()
        receiver.close()
        loop.close()
    (ev,) = fallbacks(rd)
    assert ev["level"] == "warning" and "process_group" in ev["message"] and "snapshot files" in ev["message"]


def test_memory_transport_and_its_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """colocate: the engine (here on a model of its own, so the hand-over is a copy) gets each version in memory;
    a hand-over that fails is replaced by the version's snapshot files."""
    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.config.load import validate_dict
    from relax_hpc.events import EventLog
    from relax_hpc.models.load import load_model, load_tokenizer
    from relax_hpc.modes.components import build_engine
    from relax_hpc.trainer.backend import make_backend
    from relax_hpc.trainer.session import TrainerSession
    from relax_hpc.weights.transport import make_sender

    rd = RunDir.create(tmp_path / "run")
    cfg = validate_dict({**BASE, "mode": "colocate", "weights": {"transport": {"kind": "memory"}}})
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, device="cpu", dtype=torch.float32, seed=5)
    trainer = make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32,
                           algorithm=get_algorithm(cfg.algorithm.name), tokenizer=tok, model=model)
    events = EventLog(rd, "colocate", 0)
    session = TrainerSession(rd, cfg, trainer, tok, events)
    engine = build_engine(cfg, tok, seed=0)
    loop = asyncio.new_event_loop()
    sender = make_sender(cfg, session, run_dir=rd, rank=0, device="cpu", engine=engine,
                         call=loop.run_until_complete, events=events)
    try:
        assert sender.kind == "memory" and not engine.shared
        sender.start(0)
        assert engine.version == 0 and same(engine, trainer.full_state_dict())
        for v in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            trainer.step = v
            if v == 2:  # fault injection: this engine refuses in-memory sources once
                real = engine.receive

                async def refuse(version: int, source: Any, real: Any = real) -> None:
                    from relax_hpc.rollout.engine import SnapshotFolder

                    if not isinstance(source, SnapshotFolder):
                        raise RuntimeError("hand-over refused")
                    await real(version, source)

                monkeypatch.setattr(engine, "receive", refuse)
            sender.send(v)
            assert engine.version == v and same(engine, trainer.full_state_dict())
    finally:
        sender.close()
        loop.run_until_complete(engine.close())
        loop.close()
        session.close()
    lines = rd.event_log("colocate-0").read_text().splitlines()
    evs = [e for e in map(json.loads, lines) if e.get("event") == "weight_fallback"]
    assert len(evs) == 1 and evs[0]["step"] == 2 and "hand-over refused" in evs[0]["message"]


STANDIN = Path(__file__).parents[1] / "helpers" / "sglang_standin.py"
PROMPT = [1, 5, 6, 7, 17]


def test_server_transport_and_its_fallback(tmp_path: Path) -> None:
    from relax_hpc.config.load import validate_dict
    from relax_hpc.events import EventLog
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.modes.components import build_engine
    from relax_hpc.rollout.engine import GenerateRequest, SamplingParams
    from relax_hpc.weights import SnapshotPublisher
    from relax_hpc.weights.transport import make_receiver
    from tests.helpers.server_util import TINY, LoopThread, hf_greedy, hf_model

    rd = RunDir.create(tmp_path / "run")
    cfg = {"name": "srv", "mode": "fully_async", "model": {"path": "tiny", "tiny": TINY, "dtype": "float32"},
           "data": {"task": {"name": "reverse_digits", "min_len": 2, "max_len": 4, "num_prompts": 64},
                    "max_prompt_tokens": 16},
           "rollout": {"engine": "sglang", "device": "cpu", "server": {
               "command": f"{sys.executable} {STANDIN}", "startup_timeout_s": 300, "stop_grace_s": 5,
               "sync_timeout_s": 20, "restart_backoff_s": 0.2, "env": {"PYTHONPATH": os.getcwd()}}},
           "weights": {"transport": {"kind": "server"}}}
    out = tmp_path / "trainer"
    out.mkdir()
    trainer = Trainer(rd, cfg, out)
    c, tok = validate_dict(cfg), build_digits_tokenizer()
    events = EventLog(rd, "rollout", 0)
    engine = build_engine(c, tok, seed=0, run_dir=rd, proc="rollout-0", events=events)
    receiver = make_receiver(c, engine, run_dir=rd, rank=0, proc="rollout-0", events=events)
    loop = LoopThread()

    def greedy_is(want: dict[str, torch.Tensor], version: int) -> None:
        req = GenerateRequest(request_id=f"g{version}", prompt_ids=PROMPT,
                              sampling=SamplingParams(temperature=0.0, max_new_tokens=20))
        got = loop.run(engine.generate(req), timeout=120).samples[0]
        ref = hf_greedy(hf_model(want, folder=engine.setup.model_dir), PROMPT, 20, tok.eos_token_id)
        assert got.token_ids.tolist() == ref and (got.versions == version).all()

    try:
        assert trainer.kind == "server" and receiver.kind == "server" and receiver.fast
        assert loop.run(receiver.update(files_first=True), timeout=300) == (0, "file")
        greedy_is(trainer.weights(0), 0)
        trainer.send(1)  # broadcast into the server over the link (its files are written too)
        assert loop.run(receiver.update(files_first=False), timeout=120) == (1, "fast")
        greedy_is(trainer.weights(1), 1)
        assert not fallbacks(rd)
        # the trainer dies (its link with it); its successor publishes v2 as files only: the server loads them
        trainer.kill()
        want2 = {k: v + 0.01 for k, v in trainer.weights(1).items()}
        model_config = json.loads((engine.setup.model_dir / "config.json").read_text())
        SnapshotPublisher(rd).publish(want2, version=2, step=2, model_config=model_config)
        assert loop.run(receiver.update(files_first=False), timeout=120) == (2, "file")
        greedy_is(want2, 2)
    finally:
        trainer.kill()
        receiver.close()
        loop.run(engine.close(), timeout=60)
        loop.close()
        events.close()
    (ev,) = fallbacks(rd)
    assert ev["level"] == "warning" and "weights.transport=server" in ev["message"]
    log = (rd.root / "logs" / "server-rollout-0-0.log").read_text()
    assert log.count('"POST /update_weights_from_distributed HTTP/1.1" 200') >= 1
