"""`distrain train` is done when its final evaluation is (issue 51, items 1 and 2).

Until then the finished state stays backed up and the goodput ledger unfinished: a kill
in the final evaluation is a failure, and the next attempt trains no step and only
evaluates. The kills are real: the test split of tests/scripts/killed_in_evaluation.py
sends the signal when the final evaluation first reads it.
"""

from __future__ import annotations

import json
import signal

import pytest

import distrain as dt
from distrain._src.train.run import RunInterrupted
from distrain.cli import main
from distrain.config import load_config, run_config
from tests.test_resume_logs import QUICKSTART, ROOT, _cli, _finish, _start

DATA = "tests.scripts.killed_in_evaluation:digits"
SMALL = ["model.kwargs.hidden=[32]", "data.validation_split=null", f"data.fn={DATA}"]


def _command(d, *extra):
    """A small quickstart (22 steps) whose final evaluation SIGKILLs process
    ``data.kwargs.process`` the first time it runs."""
    return [
        *_cli(d, epochs=1)[:-1],  # logging.jsonl, no CSV
        *SMALL,
        f"data.kwargs.kill_once={d / 'killed'}",
        f"checkpoint.backup_dir={d / 'backup'}",
        "checkpoint.backup_freq=10",
        *extra,
    ]


@pytest.mark.split_ends  # a slow test: see tests/conftest.py
@pytest.mark.parametrize("how", ["train", "launch"])
def test_a_kill_in_the_final_evaluation_only_evaluates_again(tmp_path, capsys, how):
    """``train``: `distrain train` is killed and run again by hand; ``launch``: process 1
    of `distrain launch --nproc 2 --max-restarts 1` is killed and the launcher restarts
    both (the chief writes the ledger, each process deletes its part of the local tier)."""
    if how == "train":
        killed = _start(_command(tmp_path), ROOT)
        out, err = _finish(killed)
        assert killed.returncode == -signal.SIGKILL, err[-3000:]
        assert "sending SIGKILL to process 0 in the final evaluation" in out
        assert "final test:" not in out
        proc = _start(_command(tmp_path), ROOT)  # the same command
        out, err = _finish(proc)
        prefix = ""
    else:
        launch = [_cli(tmp_path)[0], "launch", "--nproc", "2", "--devices-per-proc", "1"]
        launch += ["--max-restarts", "1", "--timeout", "60", "--"]
        proc = _start(
            launch
            + _command(
                tmp_path,
                "strategy.name=multi_worker_mirrored",
                "data.kwargs.process=1",
                f"checkpoint.local_dir={tmp_path / 'local'}",
                "checkpoint.local_freq=5",
            ),
            ROOT,
        )
        log, err = _finish(proc)
        assert "[1] sending SIGKILL to process 1 in the final evaluation" in log
        assert "[launch] restarting all processes (1 of 1)" in err
        attempts = log.split("[0] distrain train: quickstart on")
        assert len(attempts) == 3 and "final test:" not in attempts[1]
        out, prefix = attempts[2], "[0] "
    assert proc.returncode == 0, err[-3000:]
    # One line says training had finished; no step runs again; it evaluates.
    assert (
        f"{prefix}BackupAndRestore: training had finished: the backup of step 22 in "
        f"{tmp_path / 'backup'} is its final state, so nothing is left to train"
    ) in out
    assert "resumed from the backup" not in out and f"{prefix}final test: " in out
    assert "(0 steps, resumed at step 22, now at 22)" in out
    records = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "step"] == [10, 20]  # once each
    assert not (tmp_path / "backup").exists()  # deleted once the evaluation was done
    assert not (tmp_path / "local").exists()  # every process's part, then the folder

    assert main(["goodput", str(tmp_path)]) == 0
    assert "over 2 attempt(s), 1 failure(s) (steps lost each: 0)" in capsys.readouterr().out
    r = dt.goodput.report(tmp_path)
    assert [a.finished for a in r.attempts] == [False, True]
    assert r.attempts[1].resumed_from == 22
    assert r.attempts[1].first_step == r.attempts[1].last_step == 22  # no step ran
    assert r.attempts[1].buckets["evaluation"] > 0  # the final evaluation, not "other"


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_ctrl_c_in_the_final_evaluation_keeps_the_finished_state(tmp_path, devices):
    """A real SIGINT in the final evaluation: the message says training had finished and
    what to run; the same config again only evaluates."""
    overrides = [
        *SMALL,
        "train.epochs=1",
        "logging.progress_bar=false",
        f"data.kwargs.kill_once={tmp_path / 'interrupted'}",
        "data.kwargs.signal_name=SIGINT",
        f"checkpoint.backup_dir={tmp_path / 'backup'}",
        "checkpoint.backup_freq=10",
    ]
    cfg = load_config(QUICKSTART, overrides)
    # A shell's background job ignores SIGINT (and so would this process): Ctrl-C's default.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(RunInterrupted) as e:
            run_config(cfg, progress_bar=False, print_fn=None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert str(e.value) == (
        "interrupted in the final evaluation (training had finished at step 22); its final "
        f"state is backed up (step 22 in {tmp_path / 'backup'}): run the same command to "
        "evaluate without training again"
    )
    # checkpoint.delete_backups=false keeps the backups (a rerun would evaluate again).
    keep = load_config(QUICKSTART, [*overrides, "checkpoint.delete_backups=false"])
    lines: list[str] = []
    result = run_config(keep, progress_bar=False, print_fn=lines.append)
    assert result.history.epoch == [0] and result.test_metrics["accuracy"] > 0
    assert lines[-1].endswith("(0 steps, resumed at step 22, now at 22)")
    steps = sorted(int(p.name) for p in (tmp_path / "backup").iterdir() if p.name.isdigit())
    assert steps == [20, 22]
