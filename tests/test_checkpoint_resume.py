"""Exact resume: kill a real training process (SIGKILL, SIGTERM, a NaN), restart it, compare.

tests/scripts/ckpt_train.py trains an MLP with dt.MirroredStrategy on 8 CPU devices,
checkpointing asynchronously every 5 steps. Each test interrupts it at chosen points,
starts it again with the same command, and requires the final parameters to be
bit-identical to those of a run that was never interrupted, and the restarts to have
resumed from the expected checkpoint (not from scratch).
"""

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from distrain.checkpoint import PREEMPTION_EXIT_CODE, CheckpointManager

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_train.py"
STEPS, SAVE_EVERY = 30, 5
TIMEOUT = 120  # seconds per process; a healthy run takes a few seconds


def _run(tmp: Path, ckpt: Path, name: str, *extra: str, until: str | None = None, sig=None):
    """Runs the script; with ``until``, sends ``sig`` to its process group on that line.

    Returns (returncode, stdout lines). The process group is always killed at the end.
    """
    out = tmp / f"{name}.npz"
    cmd = [sys.executable, str(SCRIPT), "--dir", str(ckpt), "--out", str(out)]
    cmd += ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra]
    with open(tmp / f"{name}.stderr", "w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )
        lines: list[str] = []
        q: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [q.put(x) for x in proc.stdout] + [q.put(None)])
        reader.start()
        try:
            while True:
                line = q.get(timeout=TIMEOUT)
                if line is None:
                    break
                lines.append(line.strip())
                if until is not None and line.strip() == until:
                    os.killpg(proc.pid, sig)
                    until = None
            code = proc.wait(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            reader.join(timeout=30)
    return code, lines


def _params(path: Path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert a[k].tobytes() == b[k].tobytes(), f"parameter {k} differs"


def _start(lines: list[str]) -> int:
    return int(next(x for x in lines if x.startswith("START")).split()[1])


def _committed(ckpt: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final parameters of a run that is never interrupted."""
    tmp = tmp_path_factory.mktemp("reference")
    code, lines = _run(tmp, tmp / "ckpt", "ref")
    assert code == 0, (tmp / "ref.stderr").read_text()[-3000:]
    assert lines[0] == "START 0" and lines[-1] == "DONE"
    return _params(tmp / "ref.npz")


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_sigkill_at_several_points_resumes_bit_exact(tmp_path, reference):
    ckpt = tmp_path / "ckpt"

    # 1. Between checkpoints (step 7; the async write of step 5 may still be running).
    code, lines = _run(tmp_path, ckpt, "a", until="STEP 7", sig=signal.SIGKILL)
    assert code == -signal.SIGKILL and "DONE" not in lines

    # 2. Right after save() returned for step 15: its asynchronous write is in flight.
    code, lines = _run(tmp_path, ckpt, "b", until="SAVED 15", sig=signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert _start(lines) in (0, 5)

    # 3. Step 25 fully written but not yet renamed into place (the commit is held).
    stall = ("--stall-commit-at", "25")
    code, lines = _run(tmp_path, ckpt, "c", *stall, until="COMMIT_STALLED 25", sig=signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert _start(lines) in (10, 15)
    assert any(p.name.startswith("25.orbax-checkpoint-tmp") for p in ckpt.iterdir())
    assert _committed(ckpt)[-1] == 20  # the half-committed step is not a checkpoint

    # 4. Same command again: resumes from step 20 and finishes.
    code, lines = _run(tmp_path, ckpt, "d")
    assert code == 0, (tmp_path / "d.stderr").read_text()[-3000:]
    assert _start(lines) == 20 and lines[-1] == "DONE"
    assert not any("orbax-checkpoint-tmp" in p.name for p in ckpt.iterdir())
    _assert_bit_identical(_params(tmp_path / "d.npz"), reference)


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_nan_is_never_checkpointed_and_sigterm_saves_then_resumes_bit_exact(tmp_path, reference):
    ckpt = tmp_path / "ckpt"

    # Inputs turn NaN from step 12; the check before the step-15 save stops the run.
    code, lines = _run(tmp_path, ckpt, "nan", "--nan-at", "12")
    assert code == 1 and "STEP 15" in lines and "SAVED 15" not in lines
    assert "FloatingPointError: loss is nan at step 15" in (tmp_path / "nan.stderr").read_text()
    assert _committed(ckpt)[-1] == 10
    with CheckpointManager(ckpt) as mgr:
        last_good = mgr.restore()
    assert last_good.step == 10
    assert all(np.isfinite(v).all() for v in last_good.state["params"].values())

    # SIGTERM at step 17: the step finishes, the run saves that step and exits with 143.
    code, lines = _run(
        tmp_path, ckpt, "term", "--step-sleep", "0.05", until="STEP 17", sig=signal.SIGTERM
    )
    assert code == PREEMPTION_EXIT_CODE == 143, (tmp_path / "term.stderr").read_text()[-3000:]
    assert _start(lines) == 10
    stopped = int(next(x for x in lines if x.startswith("PREEMPTED")).split()[1])
    assert 17 <= stopped < STEPS
    assert _committed(ckpt)[-1] == stopped

    code, lines = _run(tmp_path, ckpt, "resume")
    assert code == 0, (tmp_path / "resume.stderr").read_text()[-3000:]
    assert _start(lines) == stopped and lines[-1] == "DONE"
    _assert_bit_identical(_params(tmp_path / "resume.npz"), reference)


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_resume_on_fewer_devices_continues_the_same_data_order(tmp_path, reference):
    """Written on 8 devices, continued on 4 with the same global batch: the same batches,
    so the same parameters up to the order of floating-point sums (not bit for bit)."""
    ckpt = tmp_path / "ckpt"
    code, lines = _run(tmp_path, ckpt, "first", "--steps", "15")
    assert code == 0 and lines[-1] == "DONE"
    code, lines = _run(tmp_path, ckpt, "second", "--devices", "4")
    assert code == 0, (tmp_path / "second.stderr").read_text()[-3000:]
    assert _start(lines) == 15 and lines[-1] == "DONE"
    resumed = _params(tmp_path / "second.npz")
    for k, ref in reference.items():
        np.testing.assert_allclose(resumed[k], ref, rtol=1e-5, atol=1e-6)
