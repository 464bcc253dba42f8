"""Hang detection: `distrain launch --hang-timeout` finds a process that stopped making
progress, names it, and restarts the job; compiling and saving are not hangs.

The end-to-end test SIGSTOPs a real worker of a real 2-process MultiWorkerMirroredStrategy
job (its peer then waits in a collective: the hang restarts do not catch); the others
check the heartbeat's pieces in-process.
"""

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

import jax
import jax.numpy as jnp
import pytest

from distrain._src.cluster import launch
from distrain._src.goodput import heartbeat
from distrain._src.goodput.report import report

PY = sys.executable
SCRIPT = str(Path(__file__).parent / "scripts" / "hang_train.py")


def _lines(proc: subprocess.Popen) -> "queue.Queue[tuple[float, str]]":
    q: queue.Queue[tuple[float, str]] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            q.put((time.monotonic(), line.rstrip("\n")))
        q.put((time.monotonic(), ""))  # end of output

    threading.Thread(target=pump, daemon=True).start()
    return q


def _until(q: "queue.Queue[tuple[float, str]]", pattern: str, seen: list[str], deadline: float):
    while time.monotonic() < deadline:
        try:
            t, line = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return t, match
    raise AssertionError(f"no line matching {pattern!r} in time; output:\n" + "\n".join(seen))


@pytest.mark.one_end("newest")  # the launcher is plain Python; the heartbeat's jax side
def test_a_sigstopped_worker_is_found_hung_named_and_the_job_restarts(tmp_path):  # is below
    timeout = 3.0  # well above a loaded machine's pauses between steps
    cmd = [
        PY, "-m", "distrain._src.cluster.launch", "--nproc", "2", "--devices-per-proc", "1",
        "--hang-timeout", f"{timeout:g}", "--max-restarts", "1", "--timeout", "60",
        "--", PY, SCRIPT, "--out", str(tmp_path), "--slow", f"{timeout + 0.5:g}",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    q, seen = _lines(proc), []
    try:
        deadline = time.monotonic() + 120
        _, pids = _until(q, r"process 0 is pid (\d+), process 1 is pid (\d+)", seen, deadline)
        # A compile and a save each longer than the timeout come first (attempt 1 only).
        _until(q, r"^\[1\] slow compile done", seen, deadline)
        _until(q, r"^\[1\] slow save done", seen, deadline)
        _until(q, r"^\[1\] step 12$", seen, deadline)
        os.kill(int(pids[2]), signal.SIGSTOP)
        stopped = time.monotonic()
        found, hung = _until(
            q, r"process (\d) \(pid \d+\) made no progress .*step (\d+)", seen, deadline
        )
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, "\n".join(seen)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    while not q.empty():
        seen.append(q.get()[1])
    out = "\n".join(seen)
    # The stopped one, not its peer; its file holds the step of its last beat (one every
    # timeout / 5 s): at or after the slow save's step 6.
    assert hung[1] == "1" and int(hung[2]) >= 6, hung[0]
    assert found - stopped <= 2 * timeout, (found - stopped, out)
    assert out.count("made no progress") == 1, out  # the slow compile and save were not hangs
    assert "restarting all processes (1 of 1)" in out
    assert "[launch] all processes finished" in out
    r = report(tmp_path)
    assert r.failures == 1
    # From the last progress of the stopped process to the detection: about the timeout.
    assert timeout * 0.5 <= r.buckets_s["hang"] <= found - stopped + timeout, r.buckets_s


def test_the_silent_process_is_named_before_the_peers_that_wait_for_it(tmp_path):
    now = 1000.0
    records = [
        {"watch": True, "pid": 10, "step": 9, "progress_t": now - 5, "busy": None, "t": now},
        {"watch": True, "pid": 11, "step": 7, "progress_t": now - 4, "busy": None, "t": now - 4},
        None,  # not started: never a hang
        # Out of the training loop (fit returned; the program is ending): not watched.
        {"watch": False, "pid": 12, "step": 9, "progress_t": now - 9, "busy": None, "t": now - 9},
    ]  # process 0 waits for process 1, which is stopped
    paths = []
    for i, record in enumerate(records):
        paths.append(str(tmp_path / f"process-{i}.json"))
        if record is not None:
            Path(paths[-1]).write_text(json.dumps(record))
    stall = heartbeat.find_stall(paths, timeout=3.0, now=now)
    assert (stall.process, stall.pid, stall.step, stall.seconds) == (1, 11, 7, 4.0)
    assert heartbeat.find_stall(paths, timeout=6.0, now=now) is None


def test_compiling_and_saving_count_as_progress(tmp_path):
    beat = heartbeat._Beat(str(tmp_path / "beat.json"), period=0.05)
    try:
        assert beat.activity() is None
        samples: list[str | None] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append(beat.activity())
                time.sleep(0.01)

        def slow_to_trace(x):
            time.sleep(0.5)
            return x * 2

        sampler = threading.Thread(target=sample)
        sampler.start()
        jax.block_until_ready(jax.jit(slow_to_trace)(jnp.ones(2)))
        done.set()
        sampler.join()
        assert "compile" in samples, samples
        with heartbeat._busy(beat, "checkpoint"):
            assert beat.activity() == "checkpoint"
        assert beat.activity() is None
        time.sleep(0.2)
        record = heartbeat.read(str(tmp_path / "beat.json"))
        assert record["pid"] == os.getpid() and record["busy"] is None
    finally:
        beat.stop()


def test_a_negative_hang_timeout_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        launch.main(["--nproc", "1", "--hang-timeout", "-1", "--", PY, "-c", "pass"])
    assert e.value.code == 2
    assert "--hang-timeout: expected seconds >= 0, received '-1'" in capsys.readouterr().err
