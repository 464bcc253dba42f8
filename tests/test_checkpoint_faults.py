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
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from distrain._src.checkpoint import _layout, _restore
from distrain.checkpoint import CheckpointCorruptionError, CheckpointManager
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


# ------------------------------- item: a damaged step is one warning, not tracebacks
_DAMAGED_RESTORE = """
import sys
import jax.numpy as jnp
from distrain.checkpoint import CheckpointManager
tree = {f"w{i}": jnp.full((64,), float(i)) for i in range(12)}  # many reads in flight
with CheckpointManager(sys.argv[1]) as mgr:
    if sys.argv[2] == "save":
        for step in (1, 2):
            mgr.save(step, tree, force=True)
    else:
        print("restored", mgr.restore(target=tree).step)
"""


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_a_damaged_array_store_gives_one_warning_in_a_fresh_process(tmp_path):
    """orbax's failed reads used to print ~20 'Event loop is closed' tracebacks (in about
    half the runs): three fresh processes each print the fallback warning and no more."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def child(directory, what):
        return subprocess.run(
            [sys.executable, "-c", _DAMAGED_RESTORE, str(directory), what],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=root,
        )

    saved = tmp_path / "saved"
    assert child(saved, "save").returncode == 0
    for attempt in range(3):  # a copy each: only the restore needs a fresh process
        directory = tmp_path / str(attempt)
        shutil.copytree(saved, directory)
        with open(directory / "2" / "state" / "manifest.ocdbt", "r+b") as f:
            f.write(b"\x00garbled\x00")  # the array store's manifest no longer parses
        proc = child(directory, "restore")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == "restored 1"
        assert "Checkpoint" in proc.stderr and "is damaged" in proc.stderr
        assert "Event loop is closed" not in proc.stderr, proc.stderr[-2000:]
        assert "never retrieved" not in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_ctrl_c_while_orbax_waits_for_a_save_is_not_logged_with_a_traceback(tmp_path, caplog):
    """orbax logs an ERROR with a traceback (through absl) when Ctrl-C lands while it
    waits for a save's finalize thread, then re-raises; `distrain train` says it in one
    line instead (seen once in `test_cli_interruptions_are_one_line_saying_what_was_saved`).
    A CheckpointManager drops that record and keeps every other exception's."""
    import logging
    import sys

    import orbax.checkpoint.checkpoint_manager as orbax_manager

    CheckpointManager(tmp_path / "ckpt")  # installs the filter
    absl = logging.getLogger("absl")  # orbax's `from absl import logging` logs here
    for where in (orbax_manager.__file__, __file__):  # orbax's record, and another's
        for exc in (KeyboardInterrupt(), ValueError("a real failure")):
            try:
                raise exc
            except BaseException:
                info = sys.exc_info()
            absl.handle(absl.makeRecord("absl", logging.ERROR, where, 1, "failed.", (), info))
    records = [(r.pathname, type(r.exc_info[1])) for r in caplog.records if r.name == "absl"]
    assert records == [
        (orbax_manager.__file__, ValueError),
        (__file__, KeyboardInterrupt),
        (__file__, ValueError),
    ]


def test_only_the_closed_loop_echo_and_tensorstore_futures_are_silenced():
    import asyncio
    import logging
    import types

    from distrain._src.checkpoint import _quiet

    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        echo = types.SimpleNamespace(exc_value=e, exc_traceback=e.__traceback__)
    assert _quiet._is_closed_loop_echo(echo)
    try:
        raise RuntimeError("Event loop is closed")  # the same words from user code
    except RuntimeError as e:
        user = types.SimpleNamespace(exc_value=e, exc_traceback=e.__traceback__)
    assert not _quiet._is_closed_loop_echo(user)

    def record(message, exc):
        return logging.LogRecord(
            "asyncio", logging.ERROR, __file__, 1, message, None, (type(exc), exc, None)
        )

    keep = _quiet._UnretrievedReadFilter()
    read = ValueError('DATA_LOSS: Error opening "zarr" driver')
    assert not keep.filter(record("Future exception was never retrieved", read))
    assert not keep.filter(record("Task exception was never retrieved", read))
    assert keep.filter(record("Future exception was never retrieved", ValueError("user")))
    assert keep.filter(record("Task was destroyed but it is pending!", read))
