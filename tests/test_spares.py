"""Warm spares under `distrain launch`: a restart hands each rank to a process that has
already imported the libraries, and nothing else changes.

The end-to-end test SIGKILLs a real worker of a real 2-process Trainer job after killing
its rank's waiting spare: the dead spare is replaced and never used, the restarted
processes are the spares (their pids were alive before the kill), training resumes from
the checkpoint to the parameters of an uninterrupted run, and the goodput ledger's start
record is the hand-over, not the spare's exec. The pool's own tests run real spares that
import nothing heavy (``preload=()``): the forms of a Python command, the environment,
standard input, exit status and tracebacks, and every reason a rank starts cold.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import distrain as dt
from distrain._src.cluster.spares import PER_ATTEMPT, Pool, spare_form
from distrain._src.cluster.supervisor import Supervisor

pytestmark = pytest.mark.one_end("newest")  # plain processes and Python; see tests/conftest.py

PY = sys.executable
SCRIPTS = Path(__file__).parent / "scripts"


def _lines(proc: subprocess.Popen) -> queue.Queue[str]:
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            q.put(line.rstrip("\n"))
        q.put("")  # end of output

    threading.Thread(target=pump, daemon=True).start()
    return q


def _until(q: queue.Queue[str], pattern: str, seen: list[str], deadline: float) -> re.Match:
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matching {pattern!r} in time; output:\n" + "\n".join(seen))


def _reference(devices, steps: int) -> dict:
    """The same training in this process on 2 devices, uninterrupted."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import mw_train
    finally:
        sys.path.remove(str(SCRIPTS))
    strategy = dt.MirroredStrategy(devices[:2])
    step_fn = mw_train.make_train_step(16)
    with strategy.scope():
        state = strategy.put_replicated(mw_train.initial_state())
        for i in range(steps):
            batch = strategy.distribute_batch(mw_train.global_batch(i, 16))
            state, _ = strategy.run(step_fn, args=(state, batch))
    return {k: np.asarray(v) for k, v in state.params.items()}


def test_a_killed_worker_restarts_in_warm_spares_and_resumes_exactly(tmp_path, devices):
    steps = 12
    cmd = [
        PY, "-m", "distrain._src.cluster.launch", "--nproc", "2", "--devices-per-proc", "1",
        "--max-restarts", "1", "--max-preemptions", "0", "--timeout", "60", "--",
        PY, str(SCRIPTS / "spare_train.py"), "--out", str(tmp_path), "--steps", str(steps),
        "--hold-at", "6",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTRAIN_")}
    proc = subprocess.Popen(
        cmd,
        env={**env, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    q, seen = _lines(proc), []
    try:
        deadline = time.monotonic() + 240
        cold = _until(q, r"process 0 is pid (\d+), process 1 is pid (\d+)", seen, deadline)
        spares = _until(
            q, r"warm spares started: pid (\d+) for process 0, pid (\d+) for", seen, deadline
        )
        # The spare of process 1 dies while it waits: replaced, never handed the rank.
        os.kill(int(spares[2]), signal.SIGKILL)
        replaced = _until(q, r"warm spares started: pid (\d+) for process 1$", seen, deadline)

        # Both spares finish importing while the workers train, and process 1 holds after
        # its save of step 6: the kill comes then.
        def ready() -> bool:
            said = " ".join(line for line in seen if "warm spares ready:" in line)
            held = any(re.fullmatch(r"\[1\] pid \d+ step 6", line) for line in seen)
            return held and {spares[1], replaced[1]} <= set(re.findall(r"pid (\d+)", said))

        while not ready():
            _until(q, "", seen, deadline)  # the next line
        killed_at = time.time()
        os.kill(int(cold[2]), signal.SIGKILL)
        _until(q, r"process 1 was killed by SIGKILL; stopping the other processes", seen, deadline)
        warm = _until(q, r"process 0 is pid (\d+), process 1 is pid (\d+)", seen, deadline)
        _until(q, r"process\(es\) 0, 1 run in warm spares", seen, deadline)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        while (line := q.get(timeout=10)) != "":
            seen.append(line)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = "\n".join(seen)
    assert proc.returncode == 0, log
    assert [warm[1], warm[2]] == [spares[1], replaced[1]], log
    # No restart left after it: no spares for the second attempt (nothing could use them).
    assert log.count("warm spares started") == 2, log
    assert (
        f"the warm spare for process 1 (pid {spares[2]}) was killed by SIGKILL while waiting"
    ) in log
    reference = _reference(devices, steps)
    firsts = []
    for i, pid in enumerate([spares[1], replaced[1]]):
        got = np.load(tmp_path / f"result_{i}.npz")
        assert int(got["pid"]) == int(pid)
        firsts.append(int(got["first"]))
        for name, want in reference.items():
            np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-7)
    assert firsts == [7, 7]  # resumed from the save of step 6, where process 1 was killed
    # The ledger: the restarted attempt started at the hand-over (after the kill), with
    # its imports already done; the report accounts for the wall time as with cold starts.
    starts = [
        r for r in map(json.loads, (tmp_path / "goodput.jsonl").read_text().splitlines())
        if r["event"] == "start"
    ]  # fmt: skip
    assert [r["pid"] for r in starts] == [int(cold[1]), int(spares[1])]
    assert killed_at < starts[1]["process_start"] < starts[1]["t"] < killed_at + 30
    assert 0 <= starts[1]["milestones"]["imported"] - starts[1]["process_start"] < 1.0
    report = dt.goodput.report(tmp_path)
    assert report.failures == 1 and len(report.attempts) == 2
    assert abs(sum(report.buckets_s.values()) - report.wall_s) < 1e-6 * report.wall_s


# ---------------------------------------------------------------------- the pool itself


def _pool(command: list[str], env: dict[str, str], logs: list[str]) -> Pool:
    form = spare_form(command)
    assert form is not None
    return Pool(command, form, 1, env_for=lambda i: env, log=logs.append, preload=())


def _run(pool: Pool, env: dict[str, str]) -> tuple[int, str, int]:
    spare = pool.spares[0].proc
    proc = pool.take(0, env)
    assert proc is spare
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out.decode(), spare.pid


def test_spare_runs_each_python_form_as_python_would(tmp_path):
    base = {**os.environ, "PYTHONUNBUFFERED": "1", "SPARE_TEST": "a"}
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    show = (
        "import os, sys\n"
        "print(__name__, sys.argv, sys.path[0], os.environ['DISTRAIN_RESTART_COUNT'], "
        "os.environ['DISTRAIN_HEARTBEAT_FILE'], os.environ.get('SPARE_TEST'), "
        "sys.stdin.read() == '', os.getpid())\n"
        "sys.exit(int(sys.argv[-1]))\n"
    )
    (tmp_path / "pkg" / "main.py").write_text(show)
    (tmp_path / "script.py").write_text(show)
    cases = [
        ([PY, "-c", show, "x", "3"], ["-c", "x", "3"], ""),
        ([PY, str(tmp_path / "script.py"), "4"], [str(tmp_path / "script.py"), "4"], tmp_path),
        ([PY, "-m", "pkg.main", "5"], [str(tmp_path / "pkg" / "main.py"), "5"], tmp_path),
    ]
    logs: list[str] = []
    cwd = os.getcwd()
    os.chdir(tmp_path)  # -m finds pkg from the working directory, as python does
    try:
        pools = [_pool(command, base, logs) for command, _, _ in cases]
        for pool in pools:
            pool.fill()
        for (command, argv, path0), pool in zip(cases, pools, strict=True):
            env = {**base, "DISTRAIN_RESTART_COUNT": "7", "DISTRAIN_HEARTBEAT_FILE": "hb"}
            code, out, pid = _run(pool, env)
            assert code == int(command[-1]), out
            assert out.strip() == f"__main__ {argv} {path0} 7 hb a True {pid}", out
    finally:
        os.chdir(cwd)
    assert len(logs) == 3 and all(line.startswith("warm spares started: pid") for line in logs)


def test_an_error_or_a_signal_in_a_spare_ends_it_as_in_a_cold_process(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("def f():\n    raise ValueError('boom')\n\nf()\n")
    logs: list[str] = []
    pool = _pool([PY, str(script)], dict(os.environ), logs)
    pool.fill()
    code, out, _ = _run(pool, dict(os.environ))
    assert code == 1
    assert out.startswith(f'Traceback (most recent call last):\n  File "{script}", line 4, in')
    assert "spare_main" not in out and "runpy" not in out and "ValueError: boom" in out
    pool = _pool([PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], {}, logs)
    pool.fill()
    assert _run(pool, {})[0] == -signal.SIGTERM


def test_a_rank_starts_cold_when_its_spare_died_or_its_environment_differs():
    logs: list[str] = []
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    pool = _pool([PY, "-c", "pass"], env, logs)
    assert pool.take(0, env) is None and logs == []  # no spare yet: cold, nothing to say
    pool.fill()
    spare = pool.spares[0].proc
    os.kill(spare.pid, signal.SIGKILL)
    spare.wait()
    assert pool.take(0, env) is None
    assert logs[-1] == (
        f"the warm spare for process 0 (pid {spare.pid}) was killed by SIGKILL while "
        "waiting; starting process 0 cold"
    )
    pool.fill()
    spare = pool.spares[0].proc
    differs = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    for name in PER_ATTEMPT:  # what changes per attempt is handed over, not compared
        differs[name] = "per attempt"
    assert pool.take(0, differs) is None
    assert spare.wait(timeout=10) == -signal.SIGKILL  # never used: killed
    assert logs[-1] == (
        "process 0 starts cold: its environment differs from its warm spare's in XLA_FLAGS "
        f"(expected only {', '.join(PER_ATTEMPT)} to change)"
    )
    pool.fill()  # a spare killed while waiting is replaced at the next fill
    spare = pool.spares[0].proc
    os.kill(spare.pid, signal.SIGKILL)
    spare.wait()
    pool.fill()
    assert f"(pid {spare.pid}) was killed by SIGKILL while waiting; starting another" in logs[-2]
    assert pool.spares[0].proc.pid != spare.pid and pool.spares[0].proc.poll() is None
    waiting = pool.spares[0].proc
    pool.close()
    assert waiting.poll() == -signal.SIGKILL and pool.spares == {}


@pytest.mark.parametrize(
    "command, form",
    [
        ([PY, "train.py", "--x"], "script"),
        ([PY, "-m", "pkg.train"], "module"),
        ([PY, "-c", "pass"], "code"),
        ([os.path.join(os.path.dirname(PY), "distrain"), "train"], "script"),
        ([PY, "-u", "train.py"], None),  # an interpreter option: cold
        ([PY], None),
        (["bash", "-c", "true"], None),
        (["/no/such/python"], None),
        ([], None),
    ],
)
def test_which_commands_a_spare_can_run(command, form):
    assert spare_form(command) == form


def test_spares_switch_and_a_command_no_spare_can_run(capfd):
    def args(spares):
        return argparse.Namespace(nproc=2, hang_timeout=0, spares=spares, islands=None)

    assert Supervisor(args(None), [PY, "t.py"]).pool is not None  # the default: on
    assert Supervisor(args(False), [PY, "t.py"]).pool is None
    assert Supervisor(args(None), ["bash", "-c", "true"]).pool is None
    assert capfd.readouterr().err == ""
    assert Supervisor(args(True), ["bash", "-c", "true"]).pool is None
    assert capfd.readouterr().err == (
        "[launch] --spares: no warm spares for this command, every restart starts cold "
        "(expected a Python program of this launcher's environment: `python SCRIPT`, "
        "`python -m MODULE`, `python -c CODE` or a console script such as `distrain`; "
        "received 'bash')\n"
    )
