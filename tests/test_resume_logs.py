"""A resumed run keeps the logs of the run it resumes, and says what happened.

Every line the killed run wrote up to the step it resumes from is kept exactly once;
the lines it wrote after that step are replaced by the resumed run's (issue 42, 1-2).
The CLI tests are real processes: SIGKILL, SIGINT (Ctrl-C) and SIGTERM.
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrain as dt
from distrain import callbacks as cb
from distrain._src.data.pipeline import ArrayPipeline
from distrain._src.train.metrics import Mean
from distrain._src.train.run import _interrupted
from distrain._src.train.trainer import Trainer
from tests.processes import xla_flags

pytestmark = pytest.mark.one_end("newest")  # see tests/conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")


def train_step(state, batch):
    def loss_fn(p):
        err = (batch["x"] @ p["w"] - batch["y"]) ** 2
        return dt.compute_average_loss(err), err

    grads, err = jax.grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), {"loss": Mean.from_values(err)}


def pipeline():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 4)).astype(np.float32)
    y = (x @ np.arange(1, 5, dtype=np.float32)).astype(np.float32)
    return ArrayPipeline({"x": x, "y": y}, global_batch_size=16, seed=0)  # 5 steps an epoch


def new_state():
    return dt.TrainState.create(params={"w": jnp.zeros(4)}, tx=optax.sgd(0.01))


class Crash(cb.Callback):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, info):
        if info.step >= self.at_step:
            raise RuntimeError("simulated crash")


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _fit(tmp_path, loggers_first: bool, crash_at: int | None):
    loggers = [
        cb.CSVLogger(tmp_path / "epochs.csv"),
        cb.JSONLinesLogger(tmp_path / "metrics.jsonl"),
    ]
    backup = cb.BackupAndRestore(tmp_path / "backup", save_freq=6, async_save=False, verbose=False)
    cbs = [*loggers, backup] if loggers_first else [backup, *loggers]
    if crash_at is not None:
        cbs.append(Crash(crash_at))
    trainer = Trainer(dt.MirroredStrategy(), train_step, callbacks=cbs, log_every=2)
    trainer.fit(new_state(), pipeline(), epochs=4)
    return trainer


@pytest.mark.parametrize("loggers_first", [True, False], ids=["loggers-first", "backup-first"])
def test_resumed_fit_keeps_logs_in_either_callback_order(tmp_path, devices, loggers_first):
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tmp_path, loggers_first, crash_at=15)  # backups at 6 and 12; lines to 14
    killed = (tmp_path / "metrics.jsonl").read_text().splitlines()
    killed_steps = [r["step"] for r in map(json.loads, killed) if r["event"] == "step"]
    assert killed_steps[-1] == 14  # the crashed run logged past its newest backup

    trainer = _fit(tmp_path, loggers_first, crash_at=None)
    assert trainer.loop.initial_step == 12

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    # Every line up to the resumed step is the killed run's, byte for byte, once...
    kept = [line for line in killed if json.loads(line).get("step", 0) <= 12]
    assert lines[: len(kept)] == kept
    # ...and the rest is the resumed run's: each step and epoch exactly once, in order.
    assert [r["step"] for r in records if r["event"] == "step"] == list(range(2, 21, 2))
    assert [r["epoch"] for r in records if r["event"] == "epoch"] == [0, 1, 2, 3]
    assert all(isinstance(r["step"], int) for r in records)  # no "step": 10.0
    with open(tmp_path / "epochs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2, 3]
    assert [int(r["step"]) for r in rows] == [5, 10, 15, 20]


def test_jsonl_resume_drops_a_torn_last_line(tmp_path, devices):
    with pytest.raises(RuntimeError):
        _fit(tmp_path, True, crash_at=15)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"event": "step", "st')  # what a SIGKILL mid-write leaves
    _fit(tmp_path, True, crash_at=None)
    records = _records(tmp_path / "metrics.jsonl")  # parses: the torn line is gone
    assert [r["step"] for r in records if r["event"] == "step"] == list(range(2, 21, 2))


def test_resume_from_a_callback_without_the_flag_warns(tmp_path, devices):
    class MyRestore(cb.Callback):  # resumes, but does not say so
        def on_train_begin(self, logs=None):
            t = self.trainer
            t.resume(t.state, {"epoch": 1, "global_step": 5}, None)

    trainer = Trainer(dt.MirroredStrategy(), train_step, callbacks=[MyRestore()])
    with pytest.warns(DeprecationWarning, match="restores_progress = True"):
        trainer.fit(new_state(), pipeline(), epochs=2)

    class Flagged(MyRestore):
        restores_progress = True

    trainer = Trainer(
        dt.MirroredStrategy(), train_step, callbacks=[cb.CSVLogger(tmp_path / "e.csv"), Flagged()]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(new_state(), pipeline(), epochs=2)
    assert trainer.loop.initial_step == 5


def test_progress_bar_writes_lines_off_a_terminal_and_redraws_on_one(devices):
    stream = io.StringIO()  # not a terminal: one line per epoch, no redraws
    trainer = Trainer(dt.MirroredStrategy(), train_step, log_every=2)
    trainer.fit(new_state(), pipeline(), epochs=2, callbacks=[cb.ProgressBar(file=stream)])
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in stream.getvalue()
    assert lines[0].startswith("epoch 1/2: 5/5 steps, ") and "step/s" in lines[0]
    assert "loss=" in lines[1]

    stream = io.StringIO()
    trainer.fit(
        new_state(), pipeline(), epochs=1, callbacks=[cb.ProgressBar(file=stream, redraw=True)]
    )
    assert "\r" in stream.getvalue() and "5/5" in stream.getvalue()


# ------------------------------------------------------------- the CLI, real signals


def _cli(tmp_path, *extra, epochs=20):
    return [
        os.path.join(os.path.dirname(sys.executable), "distrain"),
        "train",
        "--config",
        QUICKSTART,
        "--no-progress",
        f"train.epochs={epochs}",
        "train.validation_freq=100",
        f"logging.dir={tmp_path}",
        "logging.jsonl=true",
        "logging.csv=true",
        *extra,
    ]


def _start(cmd, cwd):
    env = {**os.environ, "XLA_FLAGS": xla_flags(8)}
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # A shell's background job (`pytest ... &`) ignores SIGINT, and an ignored signal
        # stays ignored across exec: the runs must see Ctrl-C as a terminal would send it.
        preexec_fn=_default_sigint,
    )


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _logged_step(jsonl) -> int:
    if not os.path.exists(jsonl):
        return -1
    with open(jsonl) as f:
        steps = [json.loads(s)["step"] for s in f if s.endswith("\n") and '"step"' in s]
    return max(steps, default=-1)


def _signal_when_logged(runs, timeout=120):
    """Sends each ``(proc, jsonl, step, sig)``'s signal once its ``jsonl`` holds a step
    event at or past ``step``."""
    pending, deadline = list(runs), time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for run in list(pending):
            proc, jsonl, step, sig = run
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            if _logged_step(jsonl) >= step:
                os.killpg(proc.pid, sig) if sig == signal.SIGKILL else proc.send_signal(sig)
                pending.remove(run)
        time.sleep(0.05)
    assert not pending, f"runs did not log their step within {timeout} s"


def _finish(proc, timeout=180):
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("tier", ["persistent", "local"])
def test_cli_sigkill_and_rerun_keep_every_log_line_once(tmp_path, tier):
    """With ``local``, backups every 10 steps go to a local tier (the persistent one
    every 1000 never comes): the rerun resumes from it."""
    freq = 50 if tier == "persistent" else 10
    local = [f"checkpoint.local_dir={tmp_path / 'local'}", "checkpoint.local_freq=10"]
    cmd = _cli(
        tmp_path,
        f"checkpoint.backup_dir={tmp_path / 'backup'}",
        f"checkpoint.backup_freq={50 if tier == 'persistent' else 1000}",
        "logging.goodput_interval=0.02",  # so the ledger sees steps past the backup
        *(local if tier == "local" else []),
    )
    jsonl = tmp_path / "metrics.jsonl"
    began = time.time()
    proc = _start(cmd, ROOT)
    _signal_when_logged([(proc, jsonl, 130, signal.SIGKILL)])
    _finish(proc)
    time.sleep(1.0)  # downtime the goodput report must find
    killed = jsonl.read_text().splitlines(keepends=True)
    killed = [line for line in killed if line.endswith("\n")]

    proc = _start(cmd, ROOT)
    out, err = _finish(proc)
    wall = time.time() - began
    assert proc.returncode == 0, err[-3000:]
    resumed_at = int(out.split("resumed from the backup of step ")[1].split()[0])
    assert resumed_at >= 100 and resumed_at % freq == 0
    assert ("in the local tier" in out) == (tier == "local")
    assert f"resumed at step {resumed_at}, now at 440" in out  # not "(440 steps)"

    lines = jsonl.read_text().splitlines(keepends=True)
    # Epochs end on multiples of 22 steps, never at a backup (every 50): an epoch's line
    # is kept exactly when its step is at or before the resumed one, as a step's is.
    kept = [s for s in killed if json.loads(s)["step"] <= resumed_at]
    assert lines[: len(kept)] == kept
    records = [json.loads(s) for s in lines]
    assert [r["step"] for r in records if r["event"] == "step"] == list(range(10, 441, 10))
    assert [r["epoch"] for r in records if r["event"] == "epoch"] == list(range(20))
    with open(tmp_path / "epochs.csv", newline="") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == list(range(20))

    # The goodput ledger (logging.dir) accounts for both attempts, the kill included.
    r = dt.goodput.report(tmp_path)
    assert len(r.attempts) == 2 and r.failures == 1
    assert r.attempts[1].resumed_from == resumed_at and r.attempts[1].finished
    assert r.attempts[1].restore[0] == tier and r.attempts[1].restore[1] > 0
    # Start-up broken down: seconds from the process start to each milestone, in order.
    marks = r.attempts[1].milestones
    assert (
        0
        < marks["imported"]
        < marks["model"]
        < marks["data"]
        < r.attempts[1].end - r.attempts[1].start
    )
    assert r.lost_steps_per_failure == (r.attempts[0].last_step - resumed_at,)
    if tier == "persistent":  # killed past step 130 with backups every 50
        assert r.lost_steps_per_failure[0] > 0 and r.buckets_s["lost"] > 0
    else:  # at most one interval, two if killed while the newest was written (0: just after)
        assert 0 <= r.lost_steps_per_failure[0] <= 2 * freq
        assert not (tmp_path / "local" / "process-0").exists()  # deleted with the backups
    assert r.buckets_s["downtime"] >= 1.0
    assert sum(r.buckets_s.values()) == pytest.approx(r.wall_s, rel=1e-6)
    # From the first process's start to the last record: the wall time measured here
    # less the spawn before the first start and the exit after the last record (the
    # interpreter's and the runtime's teardown: over a second on a loaded machine).
    assert wall - 3.0 < r.wall_s <= wall


def test_cli_interruptions_are_one_line_saying_what_was_saved(tmp_path):
    """Ctrl-C with backups, Ctrl-C with checkpoint.dir but no backups (issue 51, 5) and a
    SIGTERM, three real runs side by side."""
    dirs = [tmp_path / name for name in ("int", "int_nobackup", "term")]
    backup = [d / "backup" for d in dirs]
    procs = [
        _start(
            _cli(
                dirs[0],
                f"checkpoint.backup_dir={backup[0]}",
                "checkpoint.backup_freq=50",
                epochs=1000,
            ),
            ROOT,
        ),
        _start(
            _cli(
                dirs[1],
                f"checkpoint.dir={dirs[1] / 'ckpt'}",
                "checkpoint.save_freq=10",
                epochs=1000,
            ),
            ROOT,
        ),
        _start(
            _cli(
                dirs[2],
                f"checkpoint.backup_dir={backup[2]}",
                "checkpoint.backup_freq=1000",
                epochs=1000,
            ),
            ROOT,
        ),
    ]
    try:
        _signal_when_logged(
            (proc, d / "metrics.jsonl", step, sig)
            for proc, d, step, sig in zip(
                procs,
                dirs,
                (60, 20, 30),
                (signal.SIGINT, signal.SIGINT, signal.SIGTERM),
                strict=True,
            )
        )
        (_, err_int), (_, err_nob), (out_term, err_term) = [_finish(p) for p in procs]
    finally:
        for p in procs:
            _finish(p, timeout=1)

    # Ctrl-C: exit 130, no traceback, one line: where it stopped, what is saved, what to do.
    assert procs[0].returncode == 130, err_int[-3000:]
    line = [s for s in err_int.splitlines() if s.startswith("distrain train:")]
    assert len(line) == 1 and "Traceback" not in err_int, err_int[-3000:]
    assert "interrupted at step" in line[0] and "the newest backup is step 50 in" in line[0]
    assert "run the same command to continue" in line[0]
    # checkpoint.dir holds checkpoints, which the command does not resume from: it says so.
    assert procs[1].returncode == 130 and "Traceback" not in err_nob, err_nob[-3000:]
    kept = max(int(s) for s in os.listdir(dirs[1] / "ckpt") if s.isdigit())
    line = [s for s in err_nob.splitlines() if s.startswith("distrain train:")]
    assert len(line) == 1 and kept >= 10, err_nob[-3000:]
    assert line[0].endswith(
        "; running the command again starts over: it resumes only from "
        "checkpoint.backup_dir, which is not set. checkpoint.dir keeps the checkpoint of "
        f"step {kept} in {dirs[1] / 'ckpt'} (for later use: "
        "dt.checkpoint.CheckpointManager(dir).restore(target=state)); set "
        "checkpoint.backup_dir to make a run resumable"
    )
    # SIGTERM: saved where it stopped, exit 143, one line saying so.
    assert procs[2].returncode == 143, err_term[-3000:]
    saved = sorted(int(s) for s in os.listdir(backup[2]) if s.isdigit())
    assert f"stopped by SIGTERM after step {saved[-1]}, saved in {backup[2]}" in out_term
    assert "run the same command to continue" in out_term


def test_interruptions_without_backups_say_nothing_can_be_resumed(tmp_path, devices):
    """The lines of a Ctrl-C without checkpoint.backup_dir, before any checkpoint.dir save
    (a real one after saves: the CLI test above)."""
    assert _interrupted(Trainer(dt.MirroredStrategy(), train_step)) == (
        "interrupted at step 0; nothing was saved (no checkpoint.backup_dir), so running "
        "the command again starts over"
    )
    keep = Trainer(dt.MirroredStrategy(), train_step, callbacks=[cb.ModelCheckpoint(tmp_path)])
    assert _interrupted(keep, evaluating=True) == (
        "interrupted in the final evaluation (training had finished at step 0); nothing was "
        "saved (no checkpoint.backup_dir, and no checkpoint in checkpoint.dir yet), so "
        "running the command again retrains from step 0"
    )
