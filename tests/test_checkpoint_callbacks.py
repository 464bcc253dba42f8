"""ModelCheckpoint and BackupAndRestore across several fits, with NaN and on SIGTERM.

Keras' make-or-restore pattern (each run restores the newest model and trains more)
must write every run's checkpoints; a finished BackupAndRestore run kept on disk
restores instead of retraining; NaN never costs the last good backup; a SIGTERM that
could not save does not exit with the "saved" status.
"""

import os
import signal

import jax
import numpy as np
import pytest

import distrain as dt
from distrain import Trainer
from distrain import callbacks as cb
from distrain.checkpoint import CheckpointManager
from tests.linear_problem import new_state, train_step
from tests.test_callbacks import nan_batches, pipeline


@pytest.fixture
def strategy(devices):
    return dt.MirroredStrategy()


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_make_or_restore_with_model_checkpoint_writes_every_run(strategy, tmp_path):
    ckpt = tmp_path / "ckpt"

    def run_training(epochs=1):
        """The Keras guide's run_training(): restore the newest model or make one."""
        state = new_state()
        with CheckpointManager(ckpt) as mgr:
            restored = mgr.restore(target=state)
        if restored is not None:
            state = restored.state
        trainer = Trainer(strategy, train_step)
        return trainer.fit(state, pipeline(), epochs=epochs, callbacks=[cb.ModelCheckpoint(ckpt)])[
            0
        ]

    first = run_training()
    second = run_training()  # resumes from `first` and trains one more epoch
    assert int(second.step) == 10
    with CheckpointManager(ckpt) as mgr:
        assert mgr.all_steps() == [5, 10]  # the second run's save was written
        newest = mgr.restore(target=new_state())
    assert newest.step == 10
    for a, b in zip(_leaves(newest.state), _leaves(second), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(_leaves(newest.state.params), _leaves(first.params))


def test_model_checkpoint_resumed_by_backup_keeps_the_trainer_step_numbering(strategy, tmp_path):
    def crash(info):
        if info.step >= 7:
            raise RuntimeError("simulated crash")

    def callbacks(crash_at=None):
        found = [
            cb.ModelCheckpoint(tmp_path / "mc", save_freq=5, max_to_keep=None),
            cb.BackupAndRestore(tmp_path / "bk", save_freq=3),
        ]
        return found + ([cb.LambdaCallback(on_train_batch_end=crash)] if crash_at else [])

    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(strategy, train_step).fit(new_state(), pipeline(), epochs=3, callbacks=callbacks(7))
    Trainer(strategy, train_step).fit(new_state(), pipeline(), epochs=3, callbacks=callbacks())
    with CheckpointManager(tmp_path / "mc") as mgr:
        assert mgr.all_steps() == [5, 10, 15]


def test_finished_backup_kept_on_disk_restores_instead_of_retraining(strategy, tmp_path, capsys):
    def fit(epochs):
        trainer = Trainer(strategy, train_step)
        backup = cb.BackupAndRestore(tmp_path / "bk", save_freq=3, delete_checkpoint=False)
        state, history = trainer.fit(new_state(), pipeline(), epochs=epochs, callbacks=[backup])
        return trainer, state, history

    _, first, _ = fit(2)  # 10 steps; the last periodic backup is step 9
    with CheckpointManager(tmp_path / "bk") as mgr:
        assert mgr.latest_step() == 10  # the finished state is backed up too
    capsys.readouterr()
    trainer, again, history = fit(2)
    assert trainer.loop.initial_step == 10 and history.epoch == [0, 1]  # nothing retrained
    assert capsys.readouterr().out == (
        f"BackupAndRestore: training had finished: the backup of step 10 in {tmp_path / 'bk'} "
        "is its final state, so nothing is left to train\n"
    )
    for a, b in zip(_leaves(first), _leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)
    trainer, more, _ = fit(3)  # more epochs continue from the finished state
    assert trainer.loop.initial_step == 10 and int(more.step) == 15


def test_delete_backups_after_fit_and_not_during_it(strategy, tmp_path):
    """What distrain train does after its final evaluation (delete_checkpoint=False)."""
    backup = cb.BackupAndRestore(tmp_path / "bk", save_freq=3, delete_checkpoint=False)
    too_early = cb.LambdaCallback(on_train_batch_end=lambda info: backup.delete_backups())
    with pytest.raises(
        RuntimeError,
        match=r"delete_backups\(\) deletes the backups once fit has returned, but it was "
        r"called during fit .*Call it after fit, on every process",
    ):
        Trainer(strategy, train_step).fit(
            new_state(), pipeline(), epochs=1, callbacks=[backup, too_early]
        )
    Trainer(strategy, train_step).fit(new_state(), pipeline(), epochs=1, callbacks=[backup])
    with CheckpointManager(tmp_path / "bk") as mgr:
        assert mgr.all_steps() == [3, 5]  # kept at the end of fit
    backup.delete_backups()
    assert not (tmp_path / "bk").exists()


def test_nan_at_the_end_keeps_the_last_good_backup(strategy, tmp_path):
    backup = cb.BackupAndRestore(tmp_path / "bk", save_freq=1)  # delete_checkpoint=True
    with pytest.warns(Warning) as record:
        Trainer(strategy, train_step, log_every=1).fit(
            new_state(), nan_batches(), epochs=1, callbacks=[backup]
        )
    messages = [str(w.message) for w in record]
    assert any("backups in" in m and "are kept (not deleted)" in m for m in messages), messages
    assert any("step 3, is the last good state" in m for m in messages), messages
    with CheckpointManager(tmp_path / "bk") as mgr:
        restored = mgr.restore(target=new_state())
    assert restored.step == 3
    assert all(np.isfinite(x).all() for x in _leaves(restored.state))


def test_sigterm_with_a_nan_state_does_not_exit_with_the_saved_status(strategy, tmp_path):
    def preempt(info):
        if info.step == 5:  # the state went NaN at step 4
            os.kill(os.getpid(), signal.SIGTERM)

    callbacks = [
        cb.LambdaCallback(on_train_batch_end=preempt),
        cb.BackupAndRestore(tmp_path / "bk", save_freq=1),
    ]
    with pytest.warns(Warning) as record:  # NaN metrics; "not saving step 4" and 5
        with pytest.raises(
            FloatingPointError,
            match=r"preempted at step 5, but the state holds NaN or infinity, so it was not "
            r"saved; the newest backup in .* is step 3",
        ):
            Trainer(strategy, train_step, log_every=1).fit(
                new_state(), nan_batches(), epochs=1, callbacks=callbacks
            )
    assert any("not saving step 4" in str(w.message) for w in record)
    with CheckpointManager(tmp_path / "bk") as mgr:
        assert mgr.latest_step() == 3


@pytest.mark.parametrize("make", [cb.ModelCheckpoint, cb.BackupAndRestore])
def test_checkpoint_callbacks_refuse_an_empty_directory(make):
    with pytest.raises(ValueError, match=f"{make.__name__}: expected a checkpoint directory"):
        make("")
