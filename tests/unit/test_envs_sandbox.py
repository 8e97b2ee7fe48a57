"""The sandbox with real subprocesses: calls that sleep past their timeout, allocate past their memory limit, fork
children, read a secret from the environment, write outside their directory or open a socket are killed or
refused; the episode gets an error message and goes on; an environment that raises is counted and the episode
dropped, the other episodes unaffected; a weight update mid-episode continues the turn with the new weights."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.config.load import validate_dict
from relax_hpc.config.schema import SandboxConfig
from relax_hpc.envs import sandbox
from relax_hpc.envs.api import Environment, Step, Task
from relax_hpc.envs.builtin.calculator import PythonToolEnv
from relax_hpc.envs.builtin.lookup import DigitCallParser, DigitLookupEnv
from relax_hpc.envs.episode import run_episode
from relax_hpc.envs.parsers import HermesParser
from relax_hpc.rollout.engine import SamplingParams
from tests.helpers.agentic_helpers import ModelEngine, ScriptedEngine, qwen_style_tokenizer

CFG = SandboxConfig(timeout_s=3, cpu_s=5, memory_mb=256, max_processes=32)


def run_code(code: str, cfg: SandboxConfig = CFG):
    return asyncio.run(sandbox.python_tool(cfg)(code))


def text(r) -> str:
    return r if isinstance(r, str) else r.content


def processes_with(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


def test_good_call_and_what_this_machine_allows() -> None:
    iso = sandbox.probe(None, True)
    print(f"isolation here: {iso}")  # recorded in the report: namespaces and nobody work on the dev machine
    assert text(run_code("print(6 * 7)")) == "42\n"
    assert text(run_code("open('a.txt', 'w').write('x'); import os; print(os.listdir('.'))")).count("a.txt") == 1


def test_sleep_past_timeout_is_killed() -> None:
    t0 = time.monotonic()
    r = run_code("import time; time.sleep(60)")
    assert r.error == "sandbox" and "timeout" in r.content and time.monotonic() - t0 < 10


def test_memory_past_limit_fails_inside_the_call() -> None:
    r = run_code("x = bytearray(600 << 20)\nprint('ALLOC' + 'ATED')")
    assert r.error == "sandbox" and "MemoryError" in r.content and "ALLOCATED" not in r.content


def test_forked_children_die_with_the_call() -> None:
    code = ("import os, time\nprint(os.environ['HOME'], flush=True)\n"
            "for _ in range(4):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(120)\n"
            "time.sleep(120)\n")
    r = run_code(code)
    assert r.error == "sandbox" and "timeout" in r.content
    home = r.content.splitlines()[1].strip()
    assert home.startswith("/") and "relax-sandbox-" in home
    deadline = time.monotonic() + 10
    while processes_with(home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(home) == []  # not one of the children (setsid escaped the process group) survives


def test_secret_env_var_is_not_inherited(monkeypatch) -> None:
    monkeypatch.setenv("RELAX_TEST_SECRET", "hunter2")
    out = text(run_code("import os; print(sorted(os.environ)); print(os.environ.get('RELAX_TEST_SECRET'))"))
    assert "hunter2" not in out and "RELAX_TEST_SECRET" not in out


def test_writes_outside_cwd_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "escape.txt"
    os.chmod(tmp_path, 0o777)  # even a world-writable place is refused
    r = run_code(f"open({str(target)!r}, 'w').write('x')")
    assert r.error == "sandbox" and "refused" in r.content and not target.exists()
    r = run_code(f"import os; os.remove({str(Path(__file__))!r})")
    assert r.error == "sandbox" and Path(__file__).exists()
    r = run_code("import subprocess; subprocess.run(['sh', '-c', 'echo hi > /tmp/relax_escape'])")
    assert r.error == "sandbox" and not Path("/tmp/relax_escape").exists()


def test_network_is_off_where_namespaces_work() -> None:
    if not sandbox.probe(None, True).namespaces:
        pytest.skip("this machine does not allow unprivileged network namespaces")
    r = run_code("import socket; socket.create_connection(('127.0.0.1', 22), timeout=2)")
    out = text(r)
    assert "Connection refused" in out or "unreachable" in out
    r = run_code("import socket; print(socket.if_nameindex())")
    assert text(r).strip() == "[(1, 'lo')]"


def test_episode_gets_the_error_and_goes_on() -> None:
    tok = qwen_style_tokenizer()

    def call(code: str) -> str:
        import json

        return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"

    turns = [call("import time; time.sleep(30)"), call("x = bytearray(900 << 20)"),
             call("import os; print(os.environ.get('RELAX_TEST_SECRET'))"), call("print(4 * 21)"), "84"]
    cfg = validate_dict({"data": {"task": {"name": "copy_digits"}}, "rollout": {"env": {
        "name": "python_tool", "max_turns": 6, "sandbox": {"timeout_s": 2, "memory_mb": 256}}}}).rollout.env
    os.environ["RELAX_TEST_SECRET"] = "hunter2"
    try:
        res = asyncio.run(run_episode(ScriptedEngine(tok, turns), PythonToolEnv(), Task("4 boxes of 21?", "84"),
                                      tokenizer=tok, cfg=cfg, sampling=SamplingParams(max_new_tokens=64),
                                      parser=HermesParser(), seed=0, request_id="py"))
    finally:
        del os.environ["RELAX_TEST_SECRET"]
    st = res.stats
    assert st.error is None and st.turns == 5 and st.reward == 1.0
    assert st.tool_calls == 4 and st.tool_errors == 2 and st.tool_latency_s >= 2
    tools = [m["content"] for m in res.messages if m["role"] == "tool"]
    assert "timeout" in tools[0] and "MemoryError" in tools[1] and tools[2].strip() == "None"
    assert tools[3].strip() == "84"


class Exploding(Environment):
    def __init__(self, when: str = "step"):
        self.when = when

    async def reset(self, task, seed):
        if self.when == "reset":
            raise RuntimeError("cannot start")
        return [{"role": "user", "content": "12"}]

    async def step(self, turn):
        if self.when == "step":
            raise RuntimeError("environment bug")
        if self.when == "hang":
            await asyncio.sleep(60)
        return Step([], 1.0, True)


def test_env_that_raises_is_counted_and_others_finish() -> None:
    from relax_hpc.models.tiny import build_digits_tokenizer

    tok = build_digits_tokenizer()
    cfg = validate_dict({"data": {"task": {"name": "copy_digits"}},
                         "rollout": {"env": {"name": "digit_lookup", "step_timeout_s": 1.0}}}).rollout.env
    turns = ["C", "5"] * 3 + ["1"] * 3
    engine = ScriptedEngine(tok, turns)

    async def main():
        envs = [DigitLookupEnv(), Exploding("step"), Exploding("reset"), Exploding("hang"), DigitLookupEnv(),
                DigitLookupEnv()]
        return await asyncio.gather(*(run_episode(engine, e, Task("3"), tokenizer=tok, cfg=cfg,
                                                  sampling=SamplingParams(max_new_tokens=4),
                                                  parser=DigitCallParser(), seed=i, request_id=f"x{i}")
                                      for i, e in enumerate(envs)))

    res = asyncio.run(main())
    errors = [r.stats.error for r in res]
    assert "raised RuntimeError: environment bug" in errors[1]
    assert "reset() raised RuntimeError: cannot start" in errors[2]
    assert "timed out after 1s" in errors[3]
    assert [e is None for e in errors] == [True, False, False, False, True, True]
    assert all(r.samples and r.stats.turns >= 1 for r in (res[0], res[4], res[5]))


def test_weight_update_mid_episode_continues_the_turn() -> None:
    """pause(abort) + receive + resume while 12 episodes are mid-turn: the aborted turns are resubmitted with their
    tokens as the prefix, they continue at the new version, and every token keeps the version that produced it."""
    import torch

    from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model

    tok = build_digits_tokenizer()
    rcfg = validate_dict({"data": {"task": {"name": "copy_digits"}}})
    torch.manual_seed(0)
    model = build_tiny_model(rcfg.model.tiny, len(tok), pad_token_id=tok.pad_token_id)
    # eos is masked out of the first 12 tokens by a long turn budget and a model that rarely ends: use chunk=1
    engine = ModelEngine(model, tok, chunk=1)
    cfg = validate_dict({"data": {"task": {"name": "copy_digits"}}, "rollout": {"env": {
        "name": "digit_lookup", "max_turns": 2, "max_turn_tokens": 24, "max_total_tokens": 80}}}).rollout.env

    async def updater():
        while sum(engine.batches) < 30:
            await asyncio.sleep(0)
        await engine.pause(abort=True)
        await engine.receive(1, None)  # type: ignore[arg-type]
        await engine.resume()

    async def main():
        eps = [run_episode(engine, DigitLookupEnv(), Task(f"{i}"), tokenizer=tok, cfg=cfg,
                           sampling=SamplingParams(temperature=1.0, max_new_tokens=24), parser=DigitCallParser(),
                           seed=i, request_id=f"w{i}") for i in range(12)]
        return await asyncio.gather(updater(), *eps)

    _, *res = asyncio.run(main())
    aborted = [r for r in res if r.stats.aborted_turns]
    assert aborted, "the update caught no turn in flight"
    for r in aborted:
        s = r.samples[0]
        gen = s.versions[s.loss_mask.astype(bool)]
        assert (np.diff(gen) >= 0).all() and gen.min() == 0 and gen.max() == 1
        assert s.version_range(-1)[0] == 0


def test_resume_after_kill_mid_episode_reads_no_sample_twice(tmp_path: Path) -> None:
    """A real worker process is SIGKILLed while episodes are in flight, then restarted: the episodes it was running
    are lost whole (never a partial sample), it resumes after its published groups, and the consumer reads every
    sample exactly once."""
    import signal
    import subprocess

    from relax_hpc.rundir import RunDir
    from relax_hpc.store.consumer import ConsumerGroup
    from relax_hpc.store.layout import list_shards

    for attempt in range(3):  # the kill must land before the worker's last group (it races the worker's speed)
        rd = RunDir.create(tmp_path / f"run{attempt}")
        worker = [sys.executable, str(Path(__file__).parents[1] / "helpers" / "agentic_worker.py"), str(rd.root),
                  "rollout-0.a", "4"]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        proc = subprocess.Popen(worker, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 300
            while len(list_shards(rd, "rollout-0.a")) < 2:
                assert proc.poll() is None and time.monotonic() < deadline, "worker ended before publishing 2 groups"
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)  # mid-episode: a later group is being generated
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        done = len(list_shards(rd, "rollout-0.a"))  # one group per shard
        if done < 4:
            break
    assert 2 <= done < 4, f"the worker published all {done} groups before the kill in 3 tries"
    c = ConsumerGroup(rd)
    first = c.read(c.plan(1, num_groups=done, timeout_s=10))
    out = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"resume at group {done}" in out.stdout
    rest = c.read(c.plan(2, num_groups=4 - done, timeout_s=10))
    keys = [(s.group_id, s.metadata["episode"], s.metadata["part"]) for s in first + rest]
    assert len(keys) == len(set(keys)) == 4 * 4
    assert {s.group_id for s in first + rest} == {f"rollout-0.a:{i}" for i in range(4)}
    for s in first + rest:
        assert len(s.loss_mask) == len(s.response_ids) == len(s.logprobs) and s.loss_mask.sum() > 0


def test_fork_bomb_hits_the_process_limit() -> None:
    if not sandbox.probe(None, True).drop_to_nobody:
        pytest.skip("RLIMIT_NPROC is set only when calls run as nobody (the role runs as root)")
    code = ("import os\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n            import time\n"
            "            time.sleep(30)\n        n += 1\nexcept OSError as e:\n    print('refused after', n, e)\n")
    r = run_code(code, SandboxConfig(timeout_s=5, memory_mb=256, max_processes=16))
    out = text(r)
    assert "refused after" in out
    assert int(out.split("refused after")[1].split()[0]) < 16
