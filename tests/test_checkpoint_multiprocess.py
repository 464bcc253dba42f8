"""Several processes: agreeing on the preemption step; restoring their checkpoint in one process.

Two real processes join a JAX distributed job on loopback (tests/scripts/ckpt_multiprocess.py,
4 CPU devices each). Only one of them receives SIGTERM; both must save the same step
and exit with PREEMPTION_EXIT_CODE. The checkpoint they wrote together (a leaf sharded
over all 8 devices of both processes) is then restored here, in one process, onto 8,
4 and 1 devices, and the job started again restores it on both processes and goes on.
"""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from distrain._src.cluster.launch import free_port
from distrain.checkpoint import PREEMPTION_EXIT_CODE, CheckpointManager

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_multiprocess.py"
TIMEOUT = 120


def _target(devices, spec_rows):
    mesh = jax.make_mesh((len(devices),), ("d",), devices=devices)
    if len(devices) == 1:
        rep = rows = SingleDeviceSharding(devices[0])
    else:
        rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, spec_rows)
    return {
        "w": jax.ShapeDtypeStruct((5, 3), jnp.float32, sharding=rep),
        "s": jax.ShapeDtypeStruct((16, 6), jnp.float32, sharding=rows),
        "rng": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep),
    }


def _start_job(tmp_path, ckpt, name, *extra):
    """Starts the 2 processes; returns (procs, log files, queue of (process id, line))."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs, logs = [], []
    lines: queue.Queue = queue.Queue()
    for pid in range(2):
        log = open(tmp_path / f"{name}{pid}.stderr", "w")
        logs.append(log)
        cmd = [sys.executable, str(SCRIPT), "--process-id", str(pid), "--port", str(port)]
        proc = subprocess.Popen(
            [*cmd, "--dir", str(ckpt), *extra],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
            env=env,
        )
        procs.append(proc)
        threading.Thread(
            target=lambda p=proc, i=pid: [lines.put((i, x.strip())) for x in p.stdout],
            daemon=True,
        ).start()
    return procs, logs, lines


def _stop_job(procs, logs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    for log in logs:
        log.close()


def _drain(lines, seen):
    while not lines.empty():
        pid, line = lines.get()
        seen[pid].append(line)


def _expected(step):
    w = np.arange(15, dtype=np.float32).reshape(5, 3) + step
    s = np.arange(96, dtype=np.float32).reshape(16, 6) + 2 * step
    return w, s


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_sigterm_to_one_process_stops_all_at_the_same_step_and_both_resume(tmp_path, devices):
    ckpt = tmp_path / "ckpt"
    seen = {0: [], 1: []}
    procs, logs = [], []
    try:
        procs, logs, lines = _start_job(tmp_path, ckpt, "p")
        # Let both get going, then preempt process 1 only.
        deadline = time.monotonic() + TIMEOUT
        while "STEP 5" not in seen[1]:
            crashed = [p.returncode for p in procs if p.poll() is not None]
            assert not crashed and time.monotonic() < deadline, (
                crashed,
                [(tmp_path / f"p{i}.stderr").read_text()[-2000:] for i in range(2)],
            )
            try:
                pid, line = lines.get(timeout=1)
            except queue.Empty:
                continue
            seen[pid].append(line)
        os.killpg(procs[1].pid, signal.SIGTERM)
        codes = [p.wait(timeout=TIMEOUT) for p in procs]
    finally:
        _stop_job(procs, logs)
    time.sleep(0.2)  # let the reader threads hand over the last lines
    _drain(lines, seen)

    stderr = [(tmp_path / f"p{i}.stderr").read_text()[-2000:] for i in range(2)]
    assert codes == [PREEMPTION_EXIT_CODE] * 2, stderr
    final = [next(x for x in seen[i] if x.startswith("PREEMPTED")).split() for i in range(2)]
    assert final[0][1] == final[1][1], final  # the same step on both processes
    assert final[0][2] == "signalled=False" and final[1][2] == "signalled=True"
    step = int(final[0][1])
    assert step % 2 == 0 and step >= 6  # the first flag exchange after the signal

    # Written by 2 processes x 4 devices; restored here, in one process, on 8, 4 and 1.
    assert len(devices) == 8
    with CheckpointManager(ckpt) as mgr:
        assert mgr.all_steps() == [step]
        for devs in (devices, devices[:4], devices[7:]):
            r = mgr.restore(target=_target(devs, P("d")))
            assert r.step == step and r.metadata == {"process_count": 2}
            w, s = _expected(step)
            np.testing.assert_array_equal(np.asarray(r.state["w"]), w)
            np.testing.assert_array_equal(np.asarray(r.state["s"]), s)
            np.testing.assert_array_equal(
                jax.random.key_data(r.state["rng"]), jax.random.key_data(jax.random.key(3))
            )
            assert r.state["s"].sharding.device_set == set(devs)

    # The same job started again: both processes restore the step together and go on.
    seen = {0: [], 1: []}
    procs, logs = [], []
    try:
        procs, logs, lines = _start_job(tmp_path, ckpt, "q", "--max-steps", str(step + 4))
        codes = [p.wait(timeout=TIMEOUT) for p in procs]
    finally:
        _stop_job(procs, logs)
    time.sleep(0.2)
    _drain(lines, seen)
    stderr = [(tmp_path / f"q{i}.stderr").read_text()[-2000:] for i in range(2)]
    assert codes == [0, 0], stderr
    for i in range(2):
        markers = [x for x in seen[i] if x.split()[:1] in (["START"], ["DONE"])]  # gloo prints too
        assert markers == [f"START {step}", "DONE"], seen[i]
    with CheckpointManager(ckpt) as mgr:
        r = mgr.restore(target=_target(devices, P("d")))
    assert r.step == step + 4
    w, s = _expected(step + 4)
    np.testing.assert_array_equal(np.asarray(r.state["w"]), w)
    np.testing.assert_array_equal(np.asarray(r.state["s"]), s)
