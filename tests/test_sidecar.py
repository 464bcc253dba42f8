"""``dt.SidecarEvaluator`` and the evaluator task (issue 53).

Real processes where the issue asks for them: one ``distrain launch --nproc 2
--evaluator`` job serves the every-checkpoint, kill and garbled checks (its data hooks in
tests/scripts/sidecar_job.py garble a checkpoint and SIGKILL the evaluator mid-
evaluation), and a sidecar spanning two processes follows a training on 8 devices.
The rest runs in this process: a save held open, the wrong inputs, the ``TF_CONFIG``
role and ``distrain evaluate``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import distrain as dt
from distrain._src.train.callbacks import finish_mark
from distrain.cli import main as cli
from tests import linear_problem as lp
from tests.processes import run_together, xla_flags
from tests.test_multi_worker import clean_env, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
PY = sys.executable


def _quickstart(tmp_path, *extra):
    """The quickstart, small: 22 steps, a checkpoint every 5 (all kept), the test split
    of tests/scripts/sidecar_job.py."""
    return [
        "--config",
        QUICKSTART,
        "model.kwargs.hidden=[32]",
        "train.epochs=1",
        "data.validation_split=null",
        "data.fn=tests.scripts.sidecar_job:digits",
        f"data.kwargs={{hooks: {tmp_path / 'hooks'}, garble: 10, kill_at: 2}}",
        f"checkpoint.dir={tmp_path / 'ck'}",
        "checkpoint.save_freq=5",
        "checkpoint.max_to_keep=20",
        "evaluator.every_checkpoint=true",
        "evaluator.poll_interval=0.1",
        *extra,
    ]


def _reference(tmp_path, steps, devices="[cpu:0]"):
    """``Trainer.evaluate`` of each checkpoint of ``steps`` on one device, built as the
    config says: ``{step: metrics}``."""
    from distrain._src.train.sidecar_run import _parts
    from distrain.config import load_config

    cfg = load_config(QUICKSTART, _quickstart(tmp_path, f"strategy.devices={devices}")[2:])
    parts = _parts(cfg)
    trainer = dt.Trainer(parts.strategy, eval_step=parts.eval_step)
    mgr = dt.checkpoint.CheckpointManager(tmp_path / "ck", read_only=True)
    target = parts.strategy.put_replicated(parts.state)
    return {
        step: trainer.evaluate(mgr.restore(step=step, target=target).state, parts.data)
        for step in steps
    }


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The one ``distrain launch --evaluator`` job (its directory and output): one worker
    (its own ``jax.distributed`` world of one) and the evaluator, on the 2 cores."""
    d = tmp_path_factory.mktemp("launch")
    argv = [PY, "-m", "distrain.cli", "launch", "--nproc", "1", "--devices-per-proc", "1"]
    argv += ["--max-restarts", "1", "--timeout", "60", "--evaluator", "--", PY, "-m"]
    argv += ["distrain.cli", "train", "--no-progress", *_quickstart(d)]
    argv += ["strategy.name=multi_worker_mirrored", f"logging.dir={d / 'logs'}"]
    argv += ["logging.jsonl=true", "logging.goodput=false"]
    env = {**clean_env(1), "SIDECAR_TEST_CHECKPOINTS": str(d / "ck")}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops its processes (SIGTERM, then SIGKILL)
        out, err = proc.communicate(timeout=30)
    return d, subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.one_end("lowest")
def test_launch_evaluator_every_checkpoint_once_through_a_kill_and_a_garbled_one(launched):
    d, proc = launched
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "[launch] starting 1 process" in log and "[launch] the evaluator is pid" in log
    # Garbled: skipped with one line; killed mid-evaluation: restarted alone.
    assert "[evaluator] garbled the checkpoint of step 10" in log
    assert log.count("skipping the checkpoint of step 10") == 1
    assert f"in {d / 'ck'}: it is damaged" in log
    assert "[evaluator] SIGKILL to the evaluator in evaluation 2" in log
    assert (
        "[launch] the evaluator was killed by SIGKILL; restarting it (1 of 1); the workers" in log
    )
    assert log.count("[launch] starting 1 process") == 1  # the worker never restarted
    assert "[evaluator] SidecarEvaluator: training finished; 3 evaluation(s)" in log
    # Every checkpoint but the garbled one, each recorded once, in order.
    assert finish_mark.read(d / "ck") == (True, 20)
    with open(d / "logs" / "evaluator" / "sidecar.json") as f:
        progress = json.load(f)
    assert [r["step"] for r in progress["evaluated"]] == [5, 15, 20]
    assert progress["skipped"] == [10]
    with open(d / "logs" / "evaluator" / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [(r["event"], r["step"], r["epoch"]) for r in lines] == [
        ("epoch", 5, 0),
        ("epoch", 15, 1),
        ("epoch", 20, 2),
    ]
    # Each result is Trainer.evaluate's on the same checkpoint, on as many devices (one).
    reference = _reference(d, [r["step"] for r in progress["evaluated"]])
    for record in progress["evaluated"]:
        expected = reference[record["step"]]
        assert record["metrics"].keys() == {f"eval/{k}" for k in expected}
        for k, v in expected.items():
            assert record["metrics"][f"eval/{k}"] == pytest.approx(v, rel=1e-6)
        assert record["lag_s"] is not None and record["lag_s"] >= 0


@pytest.mark.one_end("lowest")
def test_tf_config_evaluator_role_and_distrain_evaluate(launched, monkeypatch, capsys):
    """`distrain train` on a TF_CONFIG evaluator task follows (the newest checkpoint
    only, by default); `distrain evaluate --checkpoint DIR/15` evaluates one."""
    d, proc = launched
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {
                "cluster": {"worker": ["h0:1"], "evaluator": ["h1:1"]},
                "task": {"type": "evaluator", "index": 0},
            }
        ),  # fmt: skip
    )
    args = _quickstart(d, "strategy.devices=[cpu:0]", "evaluator.every_checkpoint=false")
    args += [f"evaluator.workdir={d / 'newest'}"]
    assert cli(["train", *args]) == 0
    out = capsys.readouterr().out
    assert "SidecarEvaluator: step 20: eval/" in out and "step 15:" not in out
    with open(d / "newest" / "sidecar.json") as f:
        newest = json.load(f)["evaluated"]
    with open(d / "logs" / "evaluator" / "sidecar.json") as f:
        followed = json.load(f)["evaluated"]
    assert [r["step"] for r in newest] == [20] and newest[0]["metrics"] == followed[-1]["metrics"]

    monkeypatch.delenv("TF_CONFIG")
    assert cli(["evaluate", *args, "--checkpoint", str(d / "ck" / "15")]) == 0
    out = capsys.readouterr().out
    loss = followed[1]["metrics"]["eval/loss"]
    assert out.splitlines()[-1].startswith("checkpoint 15: ") and f"loss={loss:.4f}" in out


# ------------------------------------------------------- a sidecar of 2 processes
@pytest.mark.one_end("newest")
def test_training_on_8_devices_evaluated_on_1_and_2_processes(tmp_path):
    """The 2-process sidecar follows a live training; both processes record the same
    steps (process 0 picks each one), every checkpoint once; results as 1 device's."""
    assert jax.device_count() == 8
    ck, port = tmp_path / "ck", free_port()
    jobs = []
    for i in range(2):
        env = clean_env(
            1,
            DISTRAIN_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            DISTRAIN_NUM_PROCESSES="2",
            DISTRAIN_PROCESS_ID=str(i),
            DISTRAIN_TIMEOUT_SECONDS="60",
        )
        jobs.append(([PY, "-m", "tests.scripts.sidecar_job", str(ck), str(tmp_path / "two")], env))
    out: list = []
    runner = threading.Thread(target=lambda: out.extend(run_together(jobs, timeout=180)))
    runner.start()

    def wait_for_the_sidecar(logs=None):  # it started watching: checkpoints land live
        deadline = time.monotonic() + 120
        while not (tmp_path / "two" / "goodput.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    slow = dt.callbacks.LambdaCallback(
        on_train_begin=wait_for_the_sidecar, on_train_batch_end=lambda info: time.sleep(0.15)
    )
    keep = dt.callbacks.ModelCheckpoint(ck, save_freq=1, max_to_keep=None)
    data = dt.data.ArrayPipeline(lp.problem(), global_batch_size=16, num_epochs=None, seed=0)
    trainer = dt.Trainer(dt.MirroredStrategy(), lp.train_step, callbacks=[keep, slow])
    trainer.fit(lp.new_state(), data, steps=12)
    runner.join(timeout=200)
    assert len(out) == 2, "the sidecar processes did not end"
    for code, text, _ in out:
        assert code == 0, text[-3000:]
    seen = [
        [line.split()[2:] for line in text.splitlines() if line.startswith(f"P{i} STEP ")]
        for i, (_, text, _) in enumerate(out)
    ]
    assert seen[0] == seen[1]  # the same steps, the same values, on both processes
    assert [int(s) for s, _ in seen[0]] == list(range(1, 13))

    from tests.scripts.sidecar_job import test_data

    one = dt.SidecarEvaluator(
        lp.eval_step,
        test_data(),
        ck,
        state=lp.new_state(),
        strategy=dt.MirroredStrategy(jax.devices()[:1]),
        every_checkpoint=True,
        workdir=tmp_path / "one",
    )
    history = one.start()
    assert history.epoch == list(range(1, 13))
    for (step, loss), value in zip(seen[0], history.history["eval/loss"], strict=True):
        assert float(loss) == pytest.approx(value, rel=1e-6), step


# --------------------------------------------------------- in this process
def _save(directory, step, state=None, **kwargs):
    with dt.checkpoint.CheckpointManager(directory, max_to_keep=None, **kwargs) as mgr:
        mgr.save(step, state if state is not None else lp.new_state(), force=True)


def _data():
    from tests.scripts.sidecar_job import test_data

    return test_data()


def test_a_save_held_open_is_polled_and_never_read_then_a_garbled_one_is_skipped(
    tmp_path, monkeypatch, capsys
):
    """The writer is blocked between its files and its commit (orbax's rename waits on
    an event): the sidecar looks at least 10 times and records nothing until it is
    released; a garbled checkpoint after it is skipped with one line."""
    from orbax.checkpoint.path import atomicity  # the writer's commit, held by the test

    release, held = threading.Event(), threading.Event()
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        if self.get_final().name == "2":
            held.set()
            while not release.is_set():
                await asyncio.sleep(0.01)
        return await original(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)
    ck = tmp_path / "ck"
    writer = threading.Thread(target=_save, args=(ck, 2))
    writer.start()
    try:
        assert held.wait(60)
        assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(ck))  # its files are there
        sidecar = dt.SidecarEvaluator(
            lp.eval_step, _data(), ck, state=lp.new_state(), poll_interval=0.01, timeout=60
        )
        history: list = []
        follower = threading.Thread(target=lambda: history.append(sidecar.start()))
        follower.start()
        deadline = time.monotonic() + 60
        while sidecar.polls < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sidecar.polls >= 10 and sidecar.results == []  # looked, read nothing
        assert "2" not in os.listdir(ck)
    finally:
        release.set()
        writer.join(60)
    _save(ck, 3)
    with open(ck / "3" / "meta" / "metadata", "w") as f:
        f.write("garbled{")
    finish_mark.write(ck, 3)
    follower.join(60)
    assert history and history[0].epoch == [2]
    out = capsys.readouterr().out
    assert out.count("skipping the checkpoint of step 3") == 1
    assert "it is damaged" in out and "training finished; 1 evaluation(s)" in out
    assert os.path.isdir(ck / "3")  # left in place: the sidecar never writes there


@pytest.mark.one_end("newest")  # a real process and a signal
def test_sigterm_stops_it_with_one_line_and_a_rerun_continues(tmp_path, capfd):
    ck = tmp_path / "ck"
    _save(ck, 1)
    code = (
        "import os, distrain as dt\n"
        "from tests import linear_problem as lp\n"
        "from tests.scripts.sidecar_job import test_data\n"
        "term = dt.callbacks.LambdaCallback(on_epoch_end=lambda e, l: os.kill(os.getpid(), 15))\n"
        f"s = dt.SidecarEvaluator(lp.eval_step, test_data(), {str(ck)!r}, state=lp.new_state(),"
        " poll_interval=0.05, callbacks=[term])\n"
        "s.start()\n"
        "print('STOPPED', s.stopped_by_signal)\n"
    )
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    proc = subprocess.run(
        [PY, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if "SIGTERM" in ln]
    assert lines == [
        "SidecarEvaluator: stopped by SIGTERM after 1 evaluation(s) (the newest: step 1); run "
        "it again to continue where it stopped"
    ]
    assert "STOPPED True" in proc.stdout
    _save(ck, 2)
    finish_mark.write(ck, 2)
    sidecar = dt.SidecarEvaluator(
        lp.eval_step, _data(), ck, state=lp.new_state(), poll_interval=0.01
    )
    assert sidecar.start().epoch == [1, 2]  # step 1 from the progress file, not again
    out = capfd.readouterr().out
    assert "step 1:" not in out and "SidecarEvaluator: step 2:" in out


def test_wrong_inputs_are_one_line_each(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint directory .*missing.* to exist within "
                       r"timeout=0.2 s; it does not"):  # fmt: skip
        dt.SidecarEvaluator(
            lp.eval_step, _data(), tmp_path / "missing", state=lp.new_state(), timeout=0.2
        ).start()
    (tmp_path / "empty").mkdir()
    with pytest.raises(TimeoutError, match=r"expected a checkpoint in .*empty within timeout"):
        dt.SidecarEvaluator(
            lp.eval_step, _data(), tmp_path / "empty", state=lp.new_state(), timeout=0.2,
            poll_interval=0.05,
        ).start()  # fmt: skip
    _save(tmp_path / "ck", 1)
    wide = lp.new_state().replace(params={"w": np.zeros((7,), np.float32), "b": np.zeros(())})
    with pytest.raises(ValueError, match=r"at 'params/w' the checkpoint has shape \(4,\) "
                       r"\(float32\), the target has shape \(7,\)"):  # fmt: skip
        dt.SidecarEvaluator(lp.eval_step, _data(), tmp_path / "ck", state=wide).start()

    def no_metrics(state, batch):
        return {}

    with pytest.raises(ValueError, match=r"`no_metrics` returned no metrics \(an empty dict\)"):
        dt.SidecarEvaluator(no_metrics, _data(), tmp_path / "ck", state=lp.new_state()).start()
    with pytest.raises(ValueError, match="`poll_interval` must be seconds >= 0"):
        dt.SidecarEvaluator(lp.eval_step, _data(), tmp_path, state=lp.new_state(),
                            poll_interval=-1)  # fmt: skip


def test_the_finish_mark_names_the_final_checkpoint_and_a_new_fit_clears_it(tmp_path):
    ck = tmp_path / "ck"
    seen = []
    look = dt.callbacks.LambdaCallback(
        on_train_begin=lambda logs: seen.append(finish_mark.read(ck))
    )
    keep = dt.callbacks.ModelCheckpoint(ck, save_freq=4, max_to_keep=None)
    data = dt.data.ArrayPipeline(lp.problem(), global_batch_size=16, num_epochs=None, seed=0)
    trainer = dt.Trainer(dt.MirroredStrategy(), lp.train_step, callbacks=[keep, look])
    state, _ = trainer.fit(lp.new_state(), data, steps=10)
    assert finish_mark.read(ck) == (True, 8)  # step 10 was not saved: 8 is the final one
    trainer.fit(state, data, steps=5)  # make-or-restore: numbering continues after 8
    assert seen == [(False, None), (False, None)]  # cleared while the second fit ran
    assert finish_mark.read(ck) == (True, 12)
    (ck / finish_mark.FILENAME).write_text("not json")
    with pytest.raises(ValueError, match=r"training_finished.json to be the JSON mark"):
        finish_mark.read(ck)
