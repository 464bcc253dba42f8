"""The goodput ledger and its report (issue 39, part 1).

The accounting is checked exactly on a ledger written by hand; the ledger itself on real
phases and real compilation; a SIGKILL and a resume of the real CLI are in
tests/test_resume_logs.py (the same runs, so no extra processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import optax
import pytest

import distrain as dt
from distrain._src.goodput import ledger as goodput_ledger
from distrain._src.goodput.ledger import FILENAME, Ledger
from distrain._src.goodput.report import REPORT_BUCKETS


def _write(path, records):
    with open(path / FILENAME, "w") as f:
        for r in records:
            f.write(json.dumps({"v": 1, **r}) + "\n")


def _b(**kw):
    return {k: float(kw.get(k, 0.0)) for k in goodput_ledger.BUCKETS}


def test_report_accounts_for_a_failure_exactly(tmp_path):
    """Attempt A starts at t=100, saves step 50 at t=120, reaches step 80 and is killed
    (last record t=130); B starts at t=135, resumes from step 50 and finishes at t=160."""
    _write(
        tmp_path,
        [
            {
                "event": "start",
                "t": 103,
                "attempt": "A",
                "step": None,
                "process_start": 100,
                "buckets": _b(startup=3),
            },
            {
                "event": "save",
                "t": 120,
                "attempt": "A",
                "step": 50,
                "buckets": _b(startup=3, compile=4, step=10, checkpoint=3),
            },
            {
                "event": "tick",
                "t": 130,
                "attempt": "A",
                "step": 80,
                "buckets": _b(startup=3, compile=4, step=17, input=1, checkpoint=3, other=2),
            },
            {
                "event": "start",
                "t": 137,
                "attempt": "B",
                "step": None,
                "process_start": 135,
                "buckets": _b(startup=2),
            },
            {"event": "resume", "t": 140, "attempt": "B", "step": 50, "buckets": _b(startup=5)},
            {
                "event": "fit_end",
                "t": 160,
                "attempt": "B",
                "step": 120,
                "buckets": _b(startup=5, compile=2, step=17, evaluation=1),
            },
        ],
    )
    r = dt.goodput.report(tmp_path)
    assert r.wall_s == 60
    assert r.buckets_s == {
        "productive": 10 + 17,  # A's 7 s of step time after step 50 were redone
        "startup": 3 + 5,
        "compile": 4 + 2,
        "input": 0.0,
        "checkpoint": 3.0,
        "evaluation": 1.0,
        "sync": 0.0,  # an island's outer exchange (none here)
        "hang": 0.0,  # an island's wait for a peer past the round deadline (none here)
        "other": 0.0,
        "lost": 7 + 1 + 2,  # step, input and other after A's record of step 50
        "downtime": 5.0,  # A's last record (130) to B's process start (135)
    }
    assert sum(r.buckets_s.values()) == pytest.approx(r.wall_s)
    assert r.goodput == pytest.approx(27 / 60)
    assert r.failures == 1 and r.lost_steps_per_failure == (30,)
    assert [a.finished for a in r.attempts] == [False, True]
    table = r.table()
    assert "lost" in table and "goodput 45.0%" in table
    # Issue 51: what the step count is, beside it (an estimate from the records).
    assert table.endswith(
        "(steps lost each: 30)\n(steps lost: from the step the next attempt resumed from to "
        "the failed attempt's last ledger record; an estimate: a step is recorded when it is "
        "dispatched, and steps after the last record, at most one interval's, are not seen)"
    )


def test_report_skips_a_torn_line_and_a_restart_from_nothing_loses_everything(tmp_path):
    _write(
        tmp_path,
        [
            {
                "event": "tick",
                "t": 10,
                "attempt": "A",
                "step": 5,
                "buckets": _b(startup=4, step=6),
            },
            {
                "event": "start",
                "t": 12,
                "attempt": "B",
                "step": None,
                "process_start": 11,
                "buckets": _b(startup=1),
            },
            {
                "event": "fit_end",
                "t": 20,
                "attempt": "B",
                "step": 5,
                "buckets": _b(startup=1, step=8),
            },
        ],
    )
    with open(tmp_path / FILENAME, "a") as f:
        f.write('{"v": 1, "event": "tick", "t": 2')  # what a SIGKILL mid-write leaves
    r = dt.goodput.report(tmp_path)
    assert r.skipped_lines == 1
    assert r.buckets_s["lost"] == 6 and r.buckets_s["productive"] == 8
    assert r.buckets_s["downtime"] == 1
    assert sum(r.buckets_s.values()) == pytest.approx(r.wall_s) == 20


def test_report_errors_name_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="No goodput ledger at .*dt.callbacks.Goodput"):
        dt.goodput.report(tmp_path)
    # Issue 51: a run of islands has a ledger per island, none at its top.
    for island in (0, 1):
        (tmp_path / f"island-{island}").mkdir()
        (tmp_path / f"island-{island}" / FILENAME).write_text("")
    with pytest.raises(
        FileNotFoundError,
        match=rf"No goodput ledger at {tmp_path}/goodput.jsonl: {tmp_path} is a run of islands, "
        rf"and each island has its own ledger \({tmp_path}/island-0, {tmp_path}/island-1\)\. "
        rf"Pass one island's directory, e\.g\. `distrain goodput {tmp_path}/island-0`\.",
    ):
        dt.goodput.report(tmp_path)
    for island in (0, 1):
        (tmp_path / f"island-{island}" / FILENAME).unlink()
    (tmp_path / FILENAME).write_text("not json\n")
    with pytest.raises(ValueError, match="holds no readable record"):
        dt.goodput.report(tmp_path)


def test_ledger_charges_the_innermost_phase_and_moves_compilation_out(tmp_path):
    ledger = Ledger(tmp_path / "run", interval=0.001)
    try:
        assert Ledger(tmp_path / "run") is ledger  # one per directory and process
        # Earlier tests of this process compiled too: compare what happens below only.
        ledger.progress(0)
        before = dict(ledger.totals)
        outer = time.time()
        with ledger.phase("step"):
            time.sleep(0.05)
            with ledger.phase("checkpoint"):
                time.sleep(0.1)
            # A new program: tracing and compiling it is compile time, not step time.
            jax.jit(lambda x: jnp.sin(x) * 3 + jnp.cos(x) ** 2)(jnp.arange(7.0)).block_until_ready()
        outer = time.time() - outer
        with ledger.phase("input"):
            time.sleep(0.02)
        ledger.progress(1)
        totals = {k: v - before[k] for k, v in ledger.totals.items()}
    finally:
        ledger.close()
    assert totals["checkpoint"] >= 0.1 and totals["step"] >= 0.05
    # The nested checkpoint's time and the compilation are not step time.
    assert totals["step"] + totals["checkpoint"] + totals["compile"] <= outer + 1e-3
    assert totals["compile"] > 0 and totals["input"] >= 0.02
    records = [json.loads(s) for s in (tmp_path / "run" / FILENAME).read_text().splitlines()]
    # progress(0) may tick too (interval 1 ms): how many ticks depends on the clock.
    events = [r["event"] for r in records]
    assert events[0] == "start" and events[-1] == "end" and set(events[1:-1]) == {"tick"}
    assert records[-1]["finished"] is False
    # The process's time is all there: from its start to the last record.
    assert sum(records[-1]["buckets"].values()) == pytest.approx(
        records[-1]["t"] - records[0]["process_start"], abs=1e-3
    )
    with pytest.raises(ValueError, match="Unknown goodput phase 'stpe'"):
        with Ledger(tmp_path / "other").phase("stpe"):
            pass
    Ledger(tmp_path / "other").close()
    with pytest.raises(ValueError, match="interval must be > 0"):
        Ledger(tmp_path / "third", interval=0)


def test_ledger_moves_time_whose_cause_is_known_later(tmp_path):
    # An island learns when its round closes that its barrier wait was for a hung peer.
    ledger = Ledger(tmp_path / "run")
    try:
        with ledger.phase("sync"):
            time.sleep(0.05)
        sync = ledger.totals["sync"]
        assert ledger.move(0.03, "sync", "hang") == 0.03
        assert ledger.move(10.0, "sync", "hang") == pytest.approx(sync - 0.03)  # what it holds
        assert ledger.totals["sync"] == 0 and ledger.totals["hang"] == pytest.approx(sync)
        with pytest.raises(ValueError, match=r"Unknown goodput bucket in move\('sink'"):
            ledger.move(1.0, "sink", "hang")
    finally:
        ledger.close()


def _fit(strategy, workdir, epochs, callbacks=()):
    def train_step(state, batch):
        grads = jax.grad(lambda p: dt.compute_average_loss((batch["x"] @ p) ** 2))(state.params)
        return state.apply_gradients(grads=grads), {}

    def eval_step(state, batch):
        return {}

    x = jnp.ones((64, 4))
    data = dt.data.ArrayPipeline({"x": x}, global_batch_size=16, num_epochs=None)
    val = dt.data.ArrayPipeline({"x": x}, global_batch_size=16, num_epochs=1)
    trainer = dt.Trainer(
        strategy,
        train_step,
        eval_step,
        callbacks=[dt.callbacks.Goodput(workdir, interval=0.01), *callbacks],
    )
    state = dt.TrainState.create(params=jnp.ones(4), tx=optax.sgd(0.1))
    trainer.fit(state, data, epochs=epochs, validation_data=val)
    return trainer


def test_trainer_charges_steps_input_checkpoints_and_evaluation(tmp_path, devices):
    strategy = dt.MirroredStrategy()
    saver = dt.callbacks.ModelCheckpoint(tmp_path / "ck", save_freq=2, async_save=False)
    _fit(strategy, tmp_path, 2, [saver])
    assert goodput_ledger.current() is None  # fit ended: later fits charge nothing here
    ledger = Ledger(tmp_path)
    totals = dict(ledger.totals)
    ledger.close()
    for bucket in ("step", "input", "checkpoint", "evaluation", "compile"):
        assert totals[bucket] > 0, (bucket, totals)
    records = [json.loads(s) for s in (tmp_path / FILENAME).read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "save"] == [2, 4, 6, 8]
    assert [r["event"] for r in records][-2:] == ["fit_end", "end"]
    r = dt.goodput.report(tmp_path)
    assert set(r.buckets_s) == set(REPORT_BUCKETS) and r.attempts[0].finished
    assert 0 < r.goodput < 1

    # A new run in the same directory (not resumed) starts its own ledger and keeps the
    # finished one aside.
    _fit(strategy, tmp_path, 1)
    Ledger(tmp_path).close()
    assert len([f for f in os.listdir(tmp_path) if f.startswith("goodput-")]) == 1
    assert len(dt.goodput.report(tmp_path).attempts) == 1


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_goodput_command_prints_the_table_and_writes_json_and_png(tmp_path):
    _write(
        tmp_path,
        [
            {
                "event": "start",
                "t": 2,
                "attempt": "A",
                "step": None,
                "process_start": 0,
                "buckets": _b(startup=2),
            },
            {
                "event": "fit_end",
                "t": 10,
                "attempt": "A",
                "step": 9,
                "buckets": _b(startup=2, step=8),
            },
        ],
    )
    cmd = [os.path.join(os.path.dirname(sys.executable), "distrain"), "goodput", str(tmp_path)]
    out = subprocess.run(
        [*cmd, "--json", str(tmp_path / "g.json"), "--png", str(tmp_path / "g.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "productive         8.0   80.0%" in out.stdout and "goodput 80.0%" in out.stdout
    assert "steps lost:" not in out.stdout  # no failure: nothing to qualify
    figures = json.loads((tmp_path / "g.json").read_text())
    assert figures["goodput"] == 0.8 and figures["buckets_s"]["startup"] == 2
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Issue 51: it did not say that it wrote them.
    assert out.stdout.endswith(f"wrote {tmp_path / 'g.json'}\nwrote {tmp_path / 'g.png'}\n")

    missing = subprocess.run(
        [*cmd[:2], str(tmp_path / "nope")], capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert missing.stderr.startswith("distrain goodput: error: FileNotFoundError: No goodput")


def test_process_start_is_when_the_process_began_to_within_a_tick():
    # /proc/stat's btime is whole seconds: a start added to it could be up to 1 s off.
    before = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; t = time.time(); "
            "from distrain._src.goodput.ledger import process_start_time; "
            "print(process_start_time(), t)",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    start, began_script = map(float, out.split())
    assert before - 0.02 <= start <= began_script  # a clock tick is 10 ms
