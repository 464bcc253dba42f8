"""Callbacks: what each writes or decides, chief-only behaviour, and their error paths."""

import csv
import functools
import glob
import io
import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrain as dt
from distrain import Trainer
from distrain import callbacks as cb
from distrain.checkpoint import CheckpointManager
from distrain.data import ArrayPipeline
from tests.linear_problem import DIM, eval_step, new_state, problem, train_step


def pipeline(n=160, batch=32, seed=0):
    return ArrayPipeline(problem(n), global_batch_size=batch, seed=seed)  # 5 steps per epoch


@pytest.fixture
def strategy(devices):
    s = dt.MirroredStrategy()
    assert s.num_replicas_in_sync == 8
    return s


def a_file(tmp_path):
    """A path whose parent is a regular file: no directory can be made there (even as root)."""
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    return blocker / "sub"


def read_scalars(log_dir):
    """{tag: [(step, value)]} from tensorboardX event files (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    out = {}
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents*")):
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


# ------------------------------------------------------------------ logging callbacks


def test_progress_bar_shows_rate_and_metrics(strategy):
    stream = io.StringIO()
    trainer = Trainer(strategy, train_step, eval_step, log_every=2)
    trainer.fit(
        new_state(),
        pipeline(),
        epochs=2,
        validation_data=pipeline(),
        callbacks=[cb.ProgressBar(file=stream)],
    )
    text = stream.getvalue()
    assert "epoch 1/2" in text and "epoch 2/2" in text
    assert "5/5" in text and "step/s" in text
    assert "loss=" in text and "val_loss=" in text


def test_progress_bar_is_silent_on_non_chief(strategy):
    stream = io.StringIO()
    trainer = Trainer(strategy, train_step, callbacks=[cb.ProgressBar(file=stream)])
    trainer.is_chief = False
    trainer.fit(new_state(), pipeline(), epochs=1)
    assert stream.getvalue() == ""


def test_tensorboard_writes_event_files(strategy, tmp_path):
    trainer = Trainer(strategy, train_step, eval_step, log_every=2)
    trainer.fit(
        new_state(),
        pipeline(),
        epochs=2,
        validation_data=pipeline(),
        callbacks=[cb.TensorBoard(tmp_path / "tb")],
    )
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["train/loss"]] == [2, 4, 6, 8, 10]
    assert [s for s, _ in scalars["epoch/loss"]] == [5, 10]
    assert len(scalars["epoch/val_loss"]) == 2
    assert scalars["epoch/loss"][1][1] < scalars["epoch/loss"][0][1]


def test_tensorboard_only_on_chief(strategy, tmp_path):
    trainer = Trainer(strategy, train_step, callbacks=[cb.TensorBoard(tmp_path / "tb")])
    trainer.is_chief = False
    trainer.fit(new_state(), pipeline(), epochs=1)
    assert not os.path.exists(tmp_path / "tb")


def test_csv_logger_rows_and_late_columns(strategy, tmp_path):
    path = tmp_path / "logs" / "epochs.csv"
    trainer = Trainer(strategy, train_step, eval_step)
    _, history = trainer.fit(
        new_state(),
        pipeline(),
        epochs=2,
        validation_data=pipeline(),
        validation_freq=2,
        callbacks=[cb.CSVLogger(path)],
    )
    rows = list(csv.DictReader(open(path)))
    assert [r["epoch"] for r in rows] == ["0", "1"] and [r["step"] for r in rows] == ["5", "10"]
    assert rows[0]["val_loss"] == "" and float(rows[1]["val_loss"]) == pytest.approx(
        history.last("val_loss")
    )


def test_jsonl_logger_events(strategy, tmp_path):
    path = tmp_path / "m.jsonl"
    logger = cb.JSONLinesLogger(path)
    trainer = Trainer(strategy, train_step, eval_step, log_every=5, callbacks=[logger])
    state, _ = trainer.fit(new_state(), pipeline(), epochs=2)
    trainer.evaluate(state, pipeline())
    events = [json.loads(line) for line in open(path)]
    assert [(e["event"], e["step"]) for e in events if e["event"] != "test"] == [
        ("step", 5),
        ("epoch", 5),
        ("step", 10),
        ("epoch", 10),
    ]
    assert events[-1]["event"] == "test" and events[-1]["loss"] > 0


@pytest.mark.parametrize(
    "make,what",
    [
        (lambda p: cb.TensorBoard(p), "TensorBoard log"),
        (lambda p: cb.CSVLogger(p / "e.csv"), "CSVLogger"),
        (lambda p: cb.JSONLinesLogger(p / "m.jsonl"), "JSONLinesLogger"),
        (lambda p: cb.ModelCheckpoint(p), "ModelCheckpoint checkpoint"),
        (lambda p: cb.BackupAndRestore(p), "BackupAndRestore checkpoint"),
    ],
)
def test_unwritable_directories_fail_at_fit_start(strategy, tmp_path, make, what):
    steps = []
    count = cb.LambdaCallback(on_train_batch_end=lambda info: steps.append(info.step))
    trainer = Trainer(strategy, train_step, callbacks=[make(a_file(tmp_path)), count])
    with pytest.raises(OSError, match=f"{what} directory .* is not writable"):
        trainer.fit(new_state(), pipeline(), epochs=1)
    assert steps == []  # failed before the first step


# --------------------------------------------------------------- control callbacks


def test_early_stopping_with_patience(strategy):
    stopper = cb.EarlyStopping("loss", patience=1)
    trainer = Trainer(strategy, train_step, callbacks=[stopper])
    # lr=0 and the same batches in the same order each epoch: the loss never improves
    # (reshuffled batches would sum in another order: another rounding, maybe lower).
    data = ArrayPipeline(problem(160), global_batch_size=32, reshuffle_each_epoch=False)
    _, history = trainer.fit(new_state(lr=0.0), data, epochs=10)
    # As Keras: epoch 1 is the first without improvement, and patience=1 is used up there.
    assert history.epoch == [0, 1] and stopper.stopped_epoch == 1


def test_early_stopping_restores_best_weights(strategy):
    kept = {}
    record = cb.LambdaCallback(
        on_epoch_end=lambda e, logs: kept.setdefault(e, trainer.state_snapshot())
    )
    # mode="max" on a falling loss: epoch 0 is the best, so it stops at epoch 2 (patience 2).
    stopper = cb.EarlyStopping("loss", mode="max", patience=2, restore_best_weights=True)
    trainer = Trainer(strategy, train_step, callbacks=[record, stopper])
    state, history = trainer.fit(new_state(), pipeline(), epochs=10)
    assert history.epoch == [0, 1, 2] and stopper.best_epoch == 0
    np.testing.assert_array_equal(np.asarray(state.params["w"]), np.asarray(kept[0].params["w"]))


def test_early_stopping_errors(strategy):
    with pytest.raises(ValueError, match="mode must be 'auto', 'min' or 'max'"):
        cb.EarlyStopping(mode="up")
    trainer = Trainer(strategy, train_step, callbacks=[cb.EarlyStopping("val_acc")])
    with pytest.raises(ValueError, match=r"monitors 'val_acc'.*loss.*need validation_data"):
        trainer.fit(new_state(), pipeline(), epochs=1)


def nan_batches():
    batches = [problem(32, seed=i) for i in range(6)]
    batches[3]["x"][0, 0] = np.nan
    return batches


def test_terminate_on_nan_stops_and_never_saves_nan(strategy, tmp_path):
    ckpt = cb.ModelCheckpoint(tmp_path / "ckpt", save_freq=1, max_to_keep=None)
    stop = cb.TerminateOnNaN(raise_error=True)
    trainer = Trainer(strategy, train_step, log_every=1, callbacks=[ckpt, stop])
    with pytest.warns(UserWarning, match="not saving step 4 because the state holds NaN"):
        with pytest.raises(RuntimeError, match="metric 'loss' is nan at step 4"):
            trainer.fit(new_state(), nan_batches(), epochs=1)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.all_steps() == [1, 2, 3]
        restored = mgr.restore(target=new_state())
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.state))


# ------------------------------------------------------------ checkpoint callbacks


def test_model_checkpoint_saves_state_and_progress(strategy, tmp_path):
    trainer = Trainer(strategy, train_step)
    state, _ = trainer.fit(
        new_state(),
        pipeline(),
        epochs=2,
        callbacks=[cb.ModelCheckpoint(tmp_path / "c", save_freq=4, max_to_keep=2)],
    )
    with CheckpointManager(tmp_path / "c") as mgr:
        assert mgr.all_steps() == [4, 8]
        restored = mgr.restore(target=new_state())
    assert restored.metadata["progress"]["global_step"] == 8
    assert restored.metadata["progress"]["epoch"] == 1  # step 8 is inside epoch 1
    assert restored.data_state["iterator"]["step"] == 8


def test_model_checkpoint_best_only(strategy, tmp_path):
    trainer = Trainer(strategy, train_step, eval_step)
    best = cb.ModelCheckpoint(
        tmp_path / "c", monitor="val_loss", save_best_only=True, max_to_keep=None
    )
    trainer.fit(
        new_state(lr=-0.01), pipeline(), epochs=3, validation_data=pipeline(), callbacks=[best]
    )  # gradient ascent: only epoch 0 is ever the best
    with CheckpointManager(tmp_path / "c") as mgr:
        assert mgr.all_steps() == [5]
    with pytest.raises(ValueError, match="save_best_only=True.*needs monitor"):
        cb.ModelCheckpoint(tmp_path / "d", save_best_only=True)
    with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive number"):
        cb.ModelCheckpoint(tmp_path / "d", save_freq=0)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_backup_and_restore_resumes_exactly(strategy, tmp_path, k):
    """A run that crashes mid-epoch and is started again ends bit-identical to one that
    never crashed: same batches (data position restored), same parameters, same logs."""

    def run(backup, crash_at=None, csv_path=None):
        def crash(info):
            if crash_at is not None and info.step >= crash_at:
                raise RuntimeError("simulated crash")

        callbacks = [
            cb.BackupAndRestore(backup, save_freq=2, delete_checkpoint=False),
            cb.LambdaCallback(on_train_batch_end=crash),
        ]
        if csv_path:
            callbacks.append(cb.CSVLogger(csv_path))
        trainer = Trainer(
            strategy, train_step, eval_step, steps_per_execution=k, callbacks=callbacks
        )
        state, history = trainer.fit(
            new_state(), pipeline(), epochs=3, validation_data=pipeline(), validation_freq=2
        )
        return trainer, state, history

    _, reference, ref_history = run(tmp_path / "a")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path / "b", crash_at=8, csv_path=tmp_path / "b.csv")
    trainer, resumed, history = run(tmp_path / "b", csv_path=tmp_path / "b.csv")
    assert 6 <= trainer.loop.initial_step <= 8
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Epoch 1's metric sums were restored too, and validation ran after the same epochs.
    np.testing.assert_equal(history.history, ref_history.history)
    assert np.isnan(history.history["val_loss"][0]) and not np.isnan(history.history["val_loss"][1])
    rows = list(csv.DictReader(open(tmp_path / "b.csv")))
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]


def test_backup_and_restore_after_epoch_end_and_cleanup(strategy, tmp_path):
    backup = tmp_path / "bk"
    crash = cb.LambdaCallback(
        on_epoch_end=lambda e, logs: (_ for _ in ()).throw(RuntimeError("x")) if e == 0 else None
    )
    with pytest.raises(RuntimeError):
        Trainer(strategy, train_step, callbacks=[cb.BackupAndRestore(backup), crash]).fit(
            new_state(), pipeline(), epochs=2
        )
    trainer = Trainer(strategy, train_step, callbacks=[cb.BackupAndRestore(backup)])
    _, history = trainer.fit(new_state(), pipeline(), epochs=2)
    assert (
        trainer.loop.initial_epoch == 1
        and trainer.loop.initial_step == 5
        and history.epoch == [0, 1]
    )
    assert not os.path.exists(backup)  # delete_checkpoint=True after success


def test_backup_from_another_model_is_an_error(strategy, tmp_path):
    Trainer(strategy, train_step).fit(
        new_state(),
        pipeline(),
        epochs=1,
        callbacks=[cb.BackupAndRestore(tmp_path / "bk", delete_checkpoint=False)],
    )
    other = dt.TrainState.create(
        params={"w": jnp.zeros((DIM + 1,)), "b": jnp.zeros(())}, tx=optax.sgd(0.1)
    )
    with pytest.raises(ValueError, match=r"w"):
        Trainer(strategy, lambda s, b: (s, {})).fit(
            other, pipeline(), epochs=1, callbacks=[cb.BackupAndRestore(tmp_path / "bk")]
        )


# ------------------------------------------------------------------- base / lambda


def test_lambda_callback_hooks_in_order(strategy):
    calls = []
    hooks = {
        name: functools.partial(lambda name, *a: calls.append(name), name)
        for name in (
            "on_train_begin",
            "on_epoch_begin",
            "on_train_batch_end",
            "on_test_begin",
            "on_test_end",
            "on_epoch_end",
            "on_train_end",
            "on_train_abort",
        )
    }
    trainer = Trainer(strategy, train_step, eval_step, callbacks=[cb.LambdaCallback(**hooks)])
    trainer.fit(new_state(), pipeline(), epochs=1, validation_data=pipeline())
    assert calls == ["on_train_begin", "on_epoch_begin"] + ["on_train_batch_end"] * 5 + [
        "on_test_begin",
        "on_test_end",
        "on_epoch_end",
        "on_train_end",
    ]


def test_abort_hook_runs_on_errors(strategy):
    calls = []

    def boom(info):
        raise KeyError("boom")

    trainer = Trainer(
        strategy,
        train_step,
        callbacks=[
            cb.LambdaCallback(
                on_train_batch_end=boom,
                on_train_end=lambda logs: calls.append("end"),
                on_train_abort=lambda e: calls.append(type(e).__name__),
            ),
        ],
    )
    with pytest.raises(KeyError):
        trainer.fit(new_state(), pipeline(), epochs=1)
    assert calls == ["KeyError"]


def test_lambda_callback_errors():
    with pytest.raises(TypeError, match="unknown hook 'on_batch_end'"):
        cb.LambdaCallback(on_batch_end=print)
    with pytest.raises(TypeError, match="must be callable"):
        cb.LambdaCallback(on_epoch_end=3)


def test_callbacks_read_the_loop_record_and_change_only_what_is_explicit(strategy):
    # The loop's position is one record, trainer.loop; stop_training is the request.
    seen = []

    class Watch(cb.Callback):
        def on_epoch_end(self, epoch, logs=None):
            loop = self.trainer.loop
            seen.append((epoch, loop.epoch, loop.global_step, loop.step_in_epoch, loop.in_fit))
            assert loop.has_validation and loop.steps_per_epoch == 5 and loop.epochs == 3
            assert loop.history.epoch == list(range(epoch + 1))  # this epoch's logs are in
            if epoch == 1:
                self.trainer.stop_training = True

    trainer = Trainer(strategy, train_step, eval_step, callbacks=[Watch()])
    _, history = trainer.fit(new_state(), pipeline(), epochs=3, validation_data=pipeline())
    assert seen == [(0, 0, 5, 5, True), (1, 1, 10, 5, True)] and history.epoch == [0, 1]
    assert isinstance(trainer.loop, cb.LoopState) and not trainer.loop.in_fit
    assert trainer.loop.history is history and trainer.loop.epoch == 2
    # One way to read the loop: the Trainer has no loose copies of the record's fields.
    for name in ("epoch", "global_step", "step_in_epoch", "initial_step", "history", "in_fit"):
        assert not hasattr(trainer, name), name


def test_two_callbacks_saving_state_under_one_key_are_refused(strategy):
    """Their states would overwrite each other in a checkpoint and resume crossed."""

    class Counter(cb.Callback):
        def state_dict(self):
            return {"n": 1}

    with pytest.raises(
        ValueError,
        match=r"Two callbacks save their state under the key "
        r"'Counter'.*distinct `state_key`",
    ):
        Trainer(strategy, train_step).fit(
            new_state(), pipeline(), epochs=1, callbacks=[Counter(), Counter()]
        )
