"""Keras's own callback tests, re-stated against distrain (issue 23).

Each test names the test of `keras-team/keras` (`keras/src/callbacks/*_test.py`) whose
behavioural assertions it ports. Where Keras drives a callback by hand with a dummy
model, the port runs a real `Trainer.fit` whose metric follows a script: the state is
the number of epochs run, and the step logs `values[epoch]`, so "the weights of epoch
k" is the state `k + 1`. Differences kept on purpose are in docs/migrating_from_tf.md
("Differences that remain").
"""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distrain as dt
from distrain import callbacks as cb
from distrain.checkpoint import CheckpointManager
from tests.linear_problem import new_state, problem, train_step


def one_device():
    return dt.OneDeviceStrategy(jax.devices()[0])


def scripted_fit(values, callbacks, monitor="loss", epochs=None, trainer=None):
    """``fit`` for ``epochs`` (default: all values) one-step epochs logging ``values``.

    Returns ``(epochs run, history)``; the final state is the number of epochs whose
    state ``fit`` returned (``k + 1`` for the state at the end of epoch ``k``).
    """
    table = jnp.asarray(values, jnp.float32)

    def step(state, batch):
        i = jnp.minimum(state["epochs"], len(values) - 1)
        return {"epochs": state["epochs"] + 1}, {monitor: table[i]}

    trainer = trainer or dt.Trainer(one_device(), step)
    data = [{"x": np.zeros((1, 1), np.float32)}] * len(values)
    state, history = trainer.fit(
        {"epochs": jnp.int32(0)},
        data,
        epochs=epochs or len(values),
        steps_per_epoch=1,
        callbacks=callbacks,
    )
    return int(state["epochs"]), history


# ------------------------------------------------------------------ EarlyStopping


def test_early_stopping_patience():
    # keras: EarlyStoppingTest.test_early_stopping_patience
    losses = [10.0, 9.0, 8.0, 9.0, 8.9, 8.8, 8.7, 8.6, 8.5]
    for patience in [0, 1, 2, 3]:
        stopper = cb.EarlyStopping(monitor="loss", patience=patience)
        _, history = scripted_fit(losses, [stopper])
        assert stopper.stopped_epoch == max(patience, 1) + 2, patience
        assert history.epoch[-1] == stopper.stopped_epoch


def test_early_stopping_modes():
    # keras: EarlyStoppingTest.test_early_stopping (the `cases` table: the direction
    # chosen for each mode and metric; an unknown monitor is a ValueError in fit)
    cases = [
        ("max", "val_mse", "max"),
        ("min", "val_loss", "min"),
        ("auto", "val_mse", "min"),
        ("auto", "loss", "min"),
        ("auto", "acc", "max"),
        ("auto", "val_accuracy", "max"),
        ("auto", "hinge", "min"),
        ("auto", "f1_score", "max"),
    ]
    for mode, monitor, expected in cases:
        assert cb.EarlyStopping(monitor=monitor, mode=mode).mode == expected, (mode, monitor)
    with pytest.raises(ValueError, match="monitors 'unknown', which is not among.*loss"):
        scripted_fit([1.0, 1.0], [cb.EarlyStopping(monitor="unknown")])


def test_early_stopping_mode_max_and_min_delta():
    # keras: early_stopping.py `_is_improvement` (monitor_op(current - min_delta, best),
    # min_delta negated in min mode); no Keras test pins min_delta, so the formula is.
    rising = [0.5, 0.6, 0.55, 0.58, 0.59, 0.7]
    stopper = cb.EarlyStopping(monitor="acc", patience=2)  # auto: max
    scripted_fit(rising, [stopper], "acc")
    assert stopper.stopped_epoch == 3 and stopper.best == pytest.approx(0.6)
    falling = [1.0, 0.95, 0.9, 0.85, 0.8]
    stopper = cb.EarlyStopping(monitor="loss", patience=1, min_delta=0.1)
    scripted_fit(falling, [stopper])
    assert stopper.stopped_epoch == 1  # 0.95 is not below 1.0 - 0.1
    stopper = cb.EarlyStopping(monitor="loss", patience=1, min_delta=0.04)
    ran, _ = scripted_fit(falling, [stopper])
    assert stopper.stopped_epoch is None and ran == 5


def test_early_stopping_reuse_resets_state():
    # keras: EarlyStoppingTest.test_early_stopping_reuse and
    # test_state_reset_across_fit_calls (on_train_begin clears every per-run field)
    patience = 3
    stopper = cb.EarlyStopping(monitor="loss", patience=patience)
    values = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    _, first = scripted_fit(values, [stopper])
    assert len(first.epoch) >= patience and stopper.stopped_epoch == patience
    stopper.best, stopper.wait = -1.0, 99  # stale values from another run
    _, second = scripted_fit(values, [stopper])  # a stale best would stop at epoch 1
    assert len(second.epoch) >= patience and stopper.stopped_epoch == patience
    stopper.on_train_begin()
    assert stopper.best is None and stopper.wait == 0 and stopper.stopped_epoch is None
    assert stopper.best_epoch is None and stopper.best_state is None


def test_early_stopping_with_baseline():
    # keras: EarlyStoppingTest.test_early_stopping_with_baseline (trains at least
    # `patience` epochs) and the baseline case of
    # test_early_stopping_final_weights_when_restoring_model_weights
    patience = 3
    stopper = cb.EarlyStopping(monitor="mse", patience=patience, baseline=0.6)
    # Epochs that improve without beating the baseline still count as waiting.
    _, history = scripted_fit([0.9, 0.8, 0.8, 0.8, 0.8, 0.8], [stopper], "mse")
    assert len(history.epoch) >= patience and stopper.stopped_epoch == 2

    stopper = cb.EarlyStopping(
        monitor="val_loss", patience=5, baseline=0.5, restore_best_weights=True
    )
    state, history = scripted_fit([0.9, 0.8, 0.7, 0.71, 0.72, 0.73], [stopper], "val_loss")
    # No epoch beats the baseline: 5 epochs, then the state of epoch 2 (the best).
    assert len(history.epoch) == 5
    assert state == 2 + 1


def test_early_stopping_final_weights_when_restoring_model_weights():
    # keras: EarlyStoppingTest.test_early_stopping_final_weights_when_restoring_model_weights
    stopper = cb.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
    state, history = scripted_fit([0.2, 0.15, 0.1, 0.11, 0.12], [stopper], "val_loss")
    assert len(history.epoch) == 5 and state == 2 + 1  # the best epoch is 2

    # Another callback requests the stop: the best state is still restored.
    stopper = cb.EarlyStopping(
        monitor="val_loss", patience=5, baseline=0.5, restore_best_weights=True
    )

    def stop_at_3(epoch, logs):
        if epoch == 3:
            stopper.trainer.stop_training = True

    state, history = scripted_fit(
        [0.9, 0.8, 0.7, 0.71, 0.72, 0.73],
        [stopper, cb.LambdaCallback(on_epoch_end=stop_at_3)],
        "val_loss",
    )
    assert len(history.epoch) == 4 and state == 2 + 1


def test_early_stopping_with_start_from_epoch():
    # keras: EarlyStoppingTest.test_early_stopping_with_start_from_epoch
    flat = [1.0] * 20
    for start_from_epoch, patience in [(2, 3), (2, 0)]:
        stopper = cb.EarlyStopping(
            monitor="mse", patience=patience, start_from_epoch=start_from_epoch
        )
        _, history = scripted_fit(flat, [stopper], "mse")
        assert len(history.epoch) >= patience + start_from_epoch
        # Epochs before start_from_epoch are not watched; the first watched one is best.
        assert stopper.best_epoch == start_from_epoch
        assert stopper.stopped_epoch == start_from_epoch + max(patience, 1)


# --------------------------------------------------------------- ModelCheckpoint


def test_model_checkpoint_monitor_not_available_warns_and_saves(tmp_path):
    # keras: ModelCheckpointTest.test_model_checkpoint_options, "Case 5: metric not
    # available" (pytest.warns(UserWarning), and the file exists)
    ckpt = cb.ModelCheckpoint(tmp_path, monitor="unknown", save_best_only=True, mode="min")
    with pytest.warns(
        UserWarning,
        match=r"monitors 'unknown', which is not among the epoch "
        r"metrics: loss\. Saving this epoch anyway",
    ):
        scripted_fit([1.0, 0.5], [ckpt])
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [1, 2]


def test_model_checkpoint_save_best_only_and_initial_value_threshold(tmp_path):
    # keras: ModelCheckpointTest.test_model_checkpoint_options, Cases 4 and 12-15
    # (save_best_only saves improvements only; initial_value_threshold is the value
    # the first epoch must beat, in min, max and auto modes)
    def saved(values, monitor, **kwargs):
        directory = tmp_path / f"{monitor}-{len(os.listdir(tmp_path))}"
        ckpt = cb.ModelCheckpoint(directory, monitor=monitor, save_best_only=True, **kwargs)
        scripted_fit(values, [ckpt], monitor)
        with CheckpointManager(directory) as mgr:
            return mgr.all_steps()

    assert saved([0.5, 0.4, 0.6, 0.3], "val_loss") == [1, 2, 4]
    assert saved([0.5, 0.4], "val_loss", initial_value_threshold=None) == [1, 2]
    assert saved([0.5, 0.4], "val_loss", mode="min", initial_value_threshold=0.0) == []
    assert saved([0.5, 0.4], "val_loss", initial_value_threshold=0.0) == []  # auto: min
    assert saved([0.5, 0.9], "val_auc", initial_value_threshold=1.0) == []  # auto: max
    assert saved([0.1, 0.2, 0.1], "val_acc", mode="max", initial_value_threshold=-0.01) == [1, 2]


def test_model_checkpoint_misspelled_val_metric_is_not_silent(tmp_path):
    # distrain: a val_ monitor is skipped only on epochs that did not validate
    # (validation_freq > 1); on an epoch that did, a misspelled name warns and saves.
    ckpt = cb.ModelCheckpoint(tmp_path, monitor="val_los", save_best_only=True)
    trainer = dt.Trainer(dt.MirroredStrategy(), train_step, _eval_step())
    data = dt.data.ArrayPipeline(problem(64), global_batch_size=32)
    with pytest.warns(UserWarning, match=r"'val_los'.*loss, val_loss\. Saving this epoch"):
        trainer.fit(
            new_state(), data, epochs=2, validation_data=_val(), validation_freq=2, callbacks=[ckpt]
        )
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [4]  # epoch 1 (no validation) skipped, epoch 2 saved


def _eval_step():
    from tests.linear_problem import eval_step

    return eval_step


def _val():
    return dt.data.ArrayPipeline(
        problem(32, seed=1), global_batch_size=32, shuffle=False, num_epochs=1
    )


# -------------------------------------------------------------- BackupAndRestore


def _fit_with_backup(backup_dir, epochs, extra=(), **kwargs):
    trainer = dt.Trainer(dt.MirroredStrategy(), train_step)
    data = dt.data.ArrayPipeline(problem(64), global_batch_size=32, seed=0)
    backup = cb.BackupAndRestore(backup_dir, async_save=False, **kwargs)
    state, history = trainer.fit(new_state(), data, epochs=epochs, callbacks=[backup, *extra])
    return backup, state, history


def test_backup_corrupted_state_directory_falls_back_to_the_previous_backup(tmp_path):
    # keras: BackupAndRestoreCallbackTest.test_backup_corrupted (the newest backup's
    # weights are garbled; fit resumes from the previous one and finishes the run)
    backup_dir = tmp_path / "backup"

    def interrupt(epoch, logs):
        if epoch == 1:
            raise RuntimeError("EpochInterruption")

    with pytest.raises(RuntimeError, match="EpochInterruption"):
        _fit_with_backup(backup_dir, 4, [cb.LambdaCallback(on_epoch_end=interrupt)])
    assert sorted(os.listdir(backup_dir)) == ["2", "4"]  # epochs 0 and 1 (2 steps each)
    for root, _, files in os.walk(backup_dir / "4" / "state"):
        for name in files:  # every file of the state item, as Keras writes "0" over it
            with open(os.path.join(root, name), "w") as f:
                f.write("0")
    with pytest.warns(UserWarning, match=r"4 is damaged.*state/_METADATA holds a JSON int"):
        backup, state, history = _fit_with_backup(backup_dir, 4, delete_checkpoint=False)
    assert backup.restored_step == 2
    assert history.epoch == [0, 1, 2, 3] and int(state.step) == 8
    _, reference, _ = _fit_with_backup(tmp_path / "reference", 4)
    np.testing.assert_array_equal(np.asarray(state.params["w"]), np.asarray(reference.params["w"]))


def test_model_deleted_case_epoch(tmp_path):
    # keras: BackupAndRestoreCallbackTest.test_model_deleted_case_epoch
    backup_dir = tmp_path / "subdir"
    assert not backup_dir.exists()
    _fit_with_backup(backup_dir, 2)
    assert not backup_dir.exists()


def test_backup_dir_empty_or_none_error():
    # keras: BackupAndRestoreCallbackTest.test_backup_dir_empty_error and
    # test_backup_dir_none_error (both ValueError)
    with pytest.raises(ValueError, match="received the empty path"):
        cb.BackupAndRestore(backup_dir="", save_freq="epoch")
    with pytest.raises(ValueError, match="expected a checkpoint directory.*received None"):
        cb.BackupAndRestore(backup_dir=None, save_freq="epoch")


def test_save_freq_unknown_error():
    # keras: BackupAndRestoreCallbackTest.test_save_freq_unknown_error
    for freq in ("batch", 0.15):
        with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive number"):
            cb.BackupAndRestore(backup_dir="backup_dir", save_freq=freq)


# ----------------------------------------------------------------- TerminateOnNaN


def _nan_fit(callbacks, epochs=20, nan_at=0):
    batches = [problem(8, seed=i) for i in range(4)]
    for b in batches[nan_at:]:
        b["y"][:] = np.inf
    trainer = dt.Trainer(one_device(), train_step, log_every=1)
    return trainer.fit(new_state(), batches, epochs=epochs, callbacks=callbacks)


def test_terminate_on_nan():
    # keras: TerminateOnNaNTest.test_TerminateOnNaN (one epoch in the history, its
    # loss NaN or inf) and test_terminate_on_nan_graceful_stop (no error raised)
    with pytest.warns(RuntimeWarning, match="metric 'loss' is (nan|inf) at step 1") as seen:
        _, history = _nan_fit([cb.TerminateOnNaN()])
    # Code written for distrain < 0.2, when this raised, is told how to get that back.
    assert "TerminateOnNaN(raise_error=True)" in str(seen[0].message)
    loss = history.history["loss"]
    assert len(loss) == 1 and not np.isfinite(loss[0])


def test_terminate_on_nan_raise_error_raises_error():
    # keras: TerminateOnNaNTest.test_terminate_on_nan_raise_error_raises_error
    with pytest.raises(RuntimeError, match="metric 'loss' is (nan|inf)"):
        _nan_fit([cb.TerminateOnNaN(raise_error=True)], epochs=1)


def test_raise_error_terminate_does_not_trigger_on_train_end():
    # keras: TerminateOnNaNTest.test_raise_error_terminate_does_not_trigger_on_train_end
    ended = []
    tracking = cb.LambdaCallback(on_train_end=lambda logs: ended.append(True))
    with pytest.raises(RuntimeError):
        _nan_fit([tracking, cb.TerminateOnNaN(raise_error=True)], epochs=1)
    assert ended == []


def test_raise_error_terminate_preserves_backup(tmp_path):
    # keras: TerminateOnNaNTest.test_raise_error_terminate_preserves_backup
    backup_dir = tmp_path / "backups"
    backup = cb.BackupAndRestore(backup_dir, save_freq=1, async_save=False)
    with pytest.warns(UserWarning, match="not saving step 3 because the state holds NaN"):
        with pytest.raises(RuntimeError):
            _nan_fit([backup, cb.TerminateOnNaN(raise_error=True)], epochs=1, nan_at=2)
    with CheckpointManager(backup_dir) as mgr:
        assert mgr.all_steps() == [1, 2]


@pytest.mark.parametrize("raise_error", [False, True])
def test_normal_training_does_not_raise(raise_error):
    # keras: TerminateOnNaNTest.test_normal_training_does_not_raise
    trainer = dt.Trainer(one_device(), train_step, log_every=1)
    data = [problem(8, seed=i) for i in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, history = trainer.fit(
            new_state(), data, epochs=2, callbacks=[cb.TerminateOnNaN(raise_error=raise_error)]
        )
    assert len(history.history["loss"]) == 2


def test_raise_error_terminate_stops_on_later_batch():
    # keras: TerminateOnNaNTest.test_raise_error_terminate_stops_on_later_batch (the
    # message names the step where the loss turned non-finite)
    with pytest.raises(RuntimeError, match=r"is (nan|inf) at step 2 \(epoch 0\)"):
        _nan_fit([cb.TerminateOnNaN(raise_error=True)], epochs=1, nan_at=1)
