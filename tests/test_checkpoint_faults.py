"""CheckpointManager under faults and bad input, in one process.

Only evidence of damage sets a step aside; other errors propagate with the path;
empty or partly deleted steps fall back; errors name the step and the path; bad
targets and directories are refused instead of silently doing the wrong thing.
Real orbax checkpoints on tmp_path throughout; where a fault cannot be produced for
real (a bug inside distrain, a permission error while running as root), the function
that would raise it is replaced by one that raises.
"""

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from distrain.checkpoint import CheckpointCorruptionError, CheckpointManager, _layout, _restore
from tests.test_checkpoint import _BIG, _damage, _is_chunk, _state, _step_files, _two_checkpoints


def _set_aside(directory):
    return [n for n in os.listdir(directory) if ".corrupt-" in n]


# ---------------------------------------------- item: only damage quarantines
@pytest.mark.parametrize(
    "error",
    [RuntimeError("simulated bug"), PermissionError(13, "Permission denied")],
    ids=["bug", "permission"],
)
@pytest.mark.parametrize("where", ["json_items", "arrays"])
def test_an_error_that_is_not_damage_propagates_with_the_path_and_keeps_the_step(
    tmp_path, monkeypatch, error, where
):
    _two_checkpoints(tmp_path)

    def fail(*args, **kwargs):
        raise error

    if where == "json_items":
        monkeypatch.setattr(_layout, "unseal", fail)
    else:
        monkeypatch.setattr(_restore, "restore_state", fail)
    with CheckpointManager(tmp_path) as mgr:
        for target in (_state(shape=_BIG), None):
            with pytest.raises(type(error)) as info:
                mgr.restore(target=target)  # no warning, no fallback to step 1
            message = str(info.value)
            assert f"Could not restore checkpoint {tmp_path / '2'}" in message
            assert str(error) in message and "left in place" in message
        assert mgr.all_steps() == [1, 2]
    assert _set_aside(tmp_path) == []


# ----------------------------------------- item: empty / meta-less newest step
@pytest.mark.parametrize("how", ["empty_step_directory", "meta_item_deleted"])
def test_an_empty_or_partial_newest_step_falls_back_to_the_previous_one(tmp_path, how):
    good = _two_checkpoints(tmp_path)
    if how == "empty_step_directory":
        (tmp_path / "3").mkdir()
        newest = 3
    else:
        import shutil

        shutil.rmtree(tmp_path / "2" / "meta")
        newest = 2
    with CheckpointManager(tmp_path) as mgr:
        if how == "meta_item_deleted":
            with pytest.warns(UserWarning, match=rf"{re.escape(str(tmp_path / '2'))} is damaged"):
                restored = mgr.restore(target=_state(shape=_BIG))
            assert restored.step == 1
            np.testing.assert_array_equal(restored.state.params["w"], good.params["w"])
        else:
            with pytest.warns(UserWarning, match="'meta' item is missing"):
                restored = mgr.restore(target=_state(shape=_BIG))
            assert restored.step == 2
    assert any(n.startswith(f"{newest}.corrupt-") for n in _set_aside(tmp_path))


# ------------------------------------------- item: explicit damaged step names
def test_a_damaged_explicit_step_names_the_step_and_its_path(tmp_path):
    _two_checkpoints(tmp_path)
    (tmp_path / "2" / "meta" / "metadata").write_text('{"truncated": ')
    with CheckpointManager(tmp_path) as mgr:
        where = re.escape(str(tmp_path / "2"))
        with pytest.raises(
            CheckpointCorruptionError,
            match=rf"Checkpoint {where} is damaged: step 2 could not be read back intact "
            r"\(JSONDecodeError",
        ):
            mgr.restore(2, target=_state(shape=_BIG))
        assert mgr.all_steps() == [1, 2]  # an explicit step is left where it is


def test_truncated_array_data_is_damage(tmp_path):
    _two_checkpoints(tmp_path)
    for f in _step_files(tmp_path, 2):
        if _is_chunk(f):
            _damage(f, "truncate")
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointCorruptionError, match="OUT_OF_RANGE: Error reading"):
            mgr.restore(2, target=_state(shape=_BIG))


# ------------------------------------------------------------ item: bad input
@pytest.mark.parametrize(
    ("saved", "target", "match"),
    [
        (np.float32, np.int32, r"at 'w' the checkpoint holds float32 values, the target is int32"),
        (np.complex64, np.float32, r"holds complex64 values, the target is float32"),
        (np.int32, np.bool_, r"holds int32 values, the target is bool"),
    ],
)
def test_a_target_dtype_that_would_truncate_is_refused(tmp_path, saved, target, match):
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": np.asarray([1.5, -2.5]).astype(saved)})
        with pytest.raises(ValueError, match=match):
            mgr.restore(target={"w": jnp.zeros((2,), target)})
        # Widening or same-kind casts stay allowed.
        assert mgr.restore(target={"w": jnp.zeros((2,), jnp.complex64)}).step == 1
        assert mgr.all_steps() == [1]


def test_a_python_int_target_for_a_saved_float_is_refused(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": jnp.ones(2), "scale": 0.5})
        with pytest.raises(ValueError, match=r"at 'scale' the checkpoint holds float64"):
            mgr.restore(target={"w": jnp.zeros(2), "scale": 0})


def test_a_directory_with_other_files_but_no_checkpoint_warns(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "run-1").mkdir()
    with CheckpointManager(tmp_path) as mgr:
        with pytest.warns(UserWarning, match=r"holds no checkpoint, but it is not empty: 'notes"):
            assert mgr.restore() is None
    with CheckpointManager(tmp_path / "empty") as mgr:
        assert mgr.restore() is None  # a fresh directory is silent


def test_a_step_directory_given_as_the_checkpoint_directory_gets_a_hint(tmp_path):
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(4, {"w": jnp.ones(2)})
    with CheckpointManager(tmp_path / "run" / "4") as mgr:
        with pytest.warns(UserWarning, match=r"looks like one checkpoint step: pass its parent"):
            assert mgr.restore() is None


@pytest.mark.parametrize("directory", ["", "  "])
def test_an_empty_directory_argument_is_refused(tmp_path, monkeypatch, directory):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="received the empty path .* current directory"):
        CheckpointManager(directory)
    with pytest.raises(TypeError, match="as a str or os.PathLike; received int"):
        CheckpointManager(3)
    assert os.listdir(tmp_path) == []


# ------------------------------- item: a directory that becomes unwritable mid-run
_UNWRITABLE = """
import shutil, sys
import jax.numpy as jnp
from distrain.checkpoint import CheckpointManager
d = sys.argv[1]
mgr = CheckpointManager(d)
mgr.save(1, {"w": jnp.ones(3)})
mgr.wait_until_finished()
shutil.rmtree(d)
open(d, "w").write("the directory is gone")  # nothing can be created under it any more
for step in (2, 3):
    mgr.save(step, {"w": jnp.ones(3)})
mgr.wait_until_finished()
"""


def test_a_directory_that_becomes_unwritable_ends_the_process_at_once(tmp_path):
    import subprocess
    import sys
    import time

    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _UNWRITABLE, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,  # orbax's threads used to hold the process for 300 s
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert elapsed < 60, f"the process took {elapsed:.0f} s to exit after the error"
    assert "OSError: [Errno 20] Could not write checkpoint step 2" in proc.stderr or (
        "Could not write checkpoint step 3, or the save of step 2 before it," in proc.stderr
    ), proc.stderr[-2000:]
    assert "to stay writable for the whole run" in proc.stderr
