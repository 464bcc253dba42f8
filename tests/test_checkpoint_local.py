"""The local checkpoint tier (issue 39, part 2): saves to a node-local directory,
mirrored on a peer process; restore from the newest copy that verifies.

One process on 8 CPU devices: the tier's own copies, damage, a layout change, the
abandoned timeline, a failed write, the exchange's memory, wrong arguments. Two real
processes (tests/scripts/ckpt_local.py): a job saves, loses a process mid-restore and
SIGKILLs itself; a second job restores through lost, garbled and deleted copies (own,
peer, persistent), has one process's write fail, and loses a frozen process mid-restore.
"""

from __future__ import annotations

import gc
import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import distrain as dt
from distrain._src.checkpoint import _process_exchange
from distrain._src.cluster.launch import free_port
from tests.processes import run_together

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_local.py"


def _state(k, sharded=True):
    mesh = jax.make_mesh((8,), ("d",))
    return {
        "w": jax.device_put(
            jnp.arange(32.0).reshape(8, 4) + k, NamedSharding(mesh, P("d" if sharded else None))
        ),
        "b": jax.device_put(jnp.full(3, k, jnp.bfloat16), NamedSharding(mesh, P())),
        "key": jax.random.key(k),
        "host": np.full(2, k),
        "n": k,
    }


def _values(state):
    return [
        np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        if hasattr(x, "dtype")
        else x
        for x in jax.tree.leaves(state)
    ]


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(_values(a), _values(b), strict=True))


def _manager(tmp_path, **kw):
    kw = {"save_interval_steps": 10, "local_save_interval_steps": 2, **kw}
    return dt.checkpoint.CheckpointManager(
        tmp_path / "persistent", local_directory=tmp_path / "local", **kw
    )


def _train(tmp_path, last):
    with _manager(tmp_path) as mgr:
        for k in range(1, last + 1):
            mgr.save(k, _state(k), data_state={"pos": k}, metadata={"k": k})


def test_restores_the_newest_local_step_exactly_with_its_data_position(tmp_path):
    _train(tmp_path, 15)
    local = tmp_path / "local" / "process-0"
    assert sorted(os.listdir(local)) == ["12", "14"]  # local_max_to_keep=2
    assert sorted(os.listdir(tmp_path / "persistent")) == ["10"]  # every 10, not the local steps
    with _manager(tmp_path) as mgr:
        r = mgr.restore(target=_state(0))
        assert (r.step, mgr.restored_from) == (14, "local")
        assert _same(r.state, _state(14)) and (r.data_state, r.metadata) == ({"pos": 14}, {"k": 14})
        assert r.state["w"].sharding == _state(0)["w"].sharding
        assert type(r.state["n"]) is int and r.state["b"].dtype == jnp.bfloat16
        # restore(step=) and restores without a target read the persistent tier.
        assert mgr.restore(step=10, target=_state(0)).step == 10
        assert mgr.restored_from == "persistent"


def test_a_garbled_local_copy_falls_back_with_one_line(tmp_path):
    _train(tmp_path, 15)
    newest = tmp_path / "local" / "process-0" / "14" / "arrays.bin"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with _manager(tmp_path) as mgr, pytest.warns(UserWarning) as caught:
        r = mgr.restore(target=_state(0))
    assert (r.step, mgr.restored_from) == (12, "local") and _same(r.state, _state(12))
    [w] = [str(w.message) for w in caught if "Local checkpoint tier" in str(w.message)]
    assert "step 14" in w and "CRC-32" in w and "\n" not in w


def test_a_layout_change_ignores_the_local_tier_and_says_so(tmp_path):
    _train(tmp_path, 15)
    with _manager(tmp_path) as mgr, pytest.warns(UserWarning, match="layout changed.*'w'"):
        r = mgr.restore(target=_state(0, sharded=False))
    assert (r.step, mgr.restored_from) == (10, "persistent") and _same(r.state, _state(10))
    assert r.state["w"].sharding.spec == P(None)


def test_steps_past_the_restored_one_are_dropped_never_restored_later(tmp_path):
    """A run that fell back to step 10 must not later resume the abandoned step 14."""
    _train(tmp_path, 15)
    with _manager(tmp_path) as mgr, pytest.warns(UserWarning, match="layout changed"):
        assert mgr.restore(target=_state(0, sharded=False)).step == 10
    assert os.listdir(tmp_path / "local" / "process-0") == []
    with _manager(tmp_path) as mgr:
        mgr.save(11, _state(11), data_state={"pos": 11})  # neither tier is due
        mgr.save(12, _state(12), data_state={"pos": 12})
        r = mgr.restore(target=_state(0))
        assert (r.step, mgr.restored_from) == (12, "local") and _same(r.state, _state(12))


def test_save_local_and_delete_local(tmp_path):
    with _manager(tmp_path) as mgr:
        assert mgr.save_local(3, _state(3)) is True  # not a multiple of 2: save_local ignores it
        assert mgr.save_local(5, _state(5)) is True
        # An older step replaces the newer ones (a timeline the caller went back from):
        # decided alike on every process, whatever its own directory holds.
        assert mgr.save_local(4, _state(4)) is True
        mgr.wait_until_finished()
        assert sorted(os.listdir(tmp_path / "local" / "process-0")) == ["3", "4"]
        assert mgr.save(10, _state(10)) is True  # persistent
        assert mgr.save_local(9, _state(9)) is False  # not newer than the persistent step
        mgr.wait_until_finished()
        mgr.delete_local()
        assert not (tmp_path / "local").exists()  # issue 51: nor the empty tier directory
    with dt.checkpoint.CheckpointManager(tmp_path / "p2") as plain:
        with pytest.raises(ValueError, match="needs a local tier: pass local_directory="):
            plain.save_local(1, _state(1))


def test_a_failed_local_write_raises_once_at_the_next_save_or_wait(tmp_path):
    with _manager(tmp_path) as mgr:
        mgr.save_local(2, _state(2))
        mgr.wait_until_finished()
        (tmp_path / "local" / "process-0" / "4").write_text("")  # where step 4's directory goes
        mgr.save_local(4, _state(4))  # its background write fails
        match = r"write of step 4 failed on process 0 \(NotADirectoryError: .*save of step 6"
        with pytest.raises(OSError, match=match):
            mgr.save_local(6, _state(6))
        mgr.save_local(8, _state(8))  # said once: the tier goes on
        (tmp_path / "local" / "process-0" / "12").write_text("")
        mgr.save_local(12, _state(12))
        with pytest.raises(OSError, match=r"write of step 12 failed.*choose another local_dir"):
            mgr.wait_until_finished()
        mgr.wait_until_finished()
        r = mgr.restore(target=_state(0))  # the newest step written whole
        assert (r.step, mgr.restored_from) == (8, "local") and _same(r.state, _state(8))


MIB = 1 << 20


def _rise_in_memory(fn):
    """``fn()``, and how far the process's peak resident memory rose above its memory
    before (Linux: the peak is reset through /proc/self/clear_refs)."""

    def field(name):
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"^{name}:\s+(\d+) kB", text, re.M).group(1)) * 1024

    gc.collect()
    before = field("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    out = fn()
    return out, field("VmHWM") - before


def test_the_exchange_holds_a_few_chunks_whatever_the_state_size(devices):
    """Issue 50, defect 7b: the exchange put the whole state on a device, plus an equal
    output and a host copy; it now sends fixed-size chunks. One process sending to
    itself runs the same code as a ring of processes."""
    sizes = (13, 0, 50 * MIB + 5, 20 * MIB - 3)  # 3 chunks, the last one short
    parts = [
        np.arange(n // 4 + 1, dtype=np.uint32).view(np.uint8)[:n] + i for i, n in enumerate(sizes)
    ]
    # Over glibc's largest mmap threshold (32 MiB): each chunk's buffers go back to the
    # system when freed, so the peak counts what the exchange holds, not the heap's reuse.
    chunk = 33 * MIB
    _process_exchange.exchange([np.ones(chunk, np.uint8)], [(0, 0)], "a warm-up", chunk_bytes=chunk)
    got, rise = _rise_in_memory(
        lambda: _process_exchange.exchange(parts, [(0, 0)], "", chunk_bytes=chunk)
    )
    ends = np.cumsum(sizes)
    for part, end in zip(parts, ends, strict=True):  # chunk borders within and across parts
        assert np.array_equal(got[end - part.size : end], part)
    assert got.size == ends[-1]
    # About 3 chunks beyond what it received (before: 3x the state, 210 MiB).
    assert rise - got.nbytes < 4 * chunk, rise / MIB


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"local_directory": "{p}/local"}, r"needs local_save_interval_steps="),
        ({"local_save_interval_steps": 5}, r"without local_directory"),
        ({"local_directory": "{l}", "local_save_interval_steps": 0}, r"local_save_interval_steps"),
        ({"local_directory": "{p}/inside", "local_save_interval_steps": 5}, r"is inside it"),
        ({"local_directory": "{t}", "local_save_interval_steps": 5}, r"same or contains it"),
        ({"local_directory": "{f}/sub", "local_save_interval_steps": 5}, r"not writable"),
    ],
)
def test_wrong_local_tier_arguments_fail_before_anything_is_saved(tmp_path, kwargs, match):
    (tmp_path / "file").write_text("")
    names = {"p": tmp_path / "p", "l": tmp_path / "l", "t": tmp_path, "f": tmp_path / "file"}
    kwargs = {k: v.format(**names) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        dt.checkpoint.CheckpointManager(tmp_path / "p", **kwargs)


def test_backup_and_restore_refuses_a_local_directory_inside_the_backups(tmp_path):
    with pytest.raises(ValueError, match="is inside it"):
        dt.callbacks.BackupAndRestore(
            tmp_path / "b", local_directory=tmp_path / "b" / "l", local_save_freq=2
        )
    with pytest.raises(ValueError, match="local_save_freq"):
        dt.callbacks.BackupAndRestore(
            tmp_path / "b", local_directory=tmp_path / "l", local_save_freq=0
        )
    with pytest.raises(ValueError, match="local_save_freq was given without local_directory"):
        dt.callbacks.BackupAndRestore(tmp_path / "b", local_save_freq=2)


def _job(tmp_path, port, *extra):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    common = ["--port", str(port), "--dir", str(tmp_path / "p"), "--local", str(tmp_path / "l")]
    return [
        ([sys.executable, str(SCRIPT), "--process-id", str(i), *common, *extra], env)
        for i in range(2)
    ]


@pytest.fixture(scope="module")
def two_process_jobs(tmp_path_factory):
    """The save job and the restore job of tests/scripts/ckpt_local.py, run once."""
    tmp_path = tmp_path_factory.mktemp("two-processes")
    saved = run_together(_job(tmp_path, free_port(), "--save", "15"), timeout=120)
    local = tmp_path / "l"
    listed = [sorted(os.listdir(local / d)) for d in ("process-0", "process-1/peer-of-0")]
    restored = run_together(_job(tmp_path, free_port(), "--scenarios"), timeout=120)
    return listed, saved, restored


def _failures(out):
    """The ``FAILED <seconds> <error>`` lines of a job's process: (seconds, error)."""
    return [
        (float(line.split()[1]), line.split(" ", 2)[2])
        for line in out.splitlines()
        if line.startswith("FAILED ")
    ]


def test_two_processes_restore_from_own_peer_and_persistent_copies(two_process_jobs):
    listed, saved, restored = two_process_jobs
    for rc, out, _ in saved:
        assert rc == -9 and "SAVED" in out, out[-3000:]  # SIGKILLed after its saves
    # What the save job left (its restore, failed when process 1 was killed, deleted nothing).
    assert listed == [["12", "14", "peer-of-1"], ["12", "14"]]

    lines = []
    for _, out, _ in restored:
        lines.append([x for x in out.splitlines() if x.startswith("RESTORED")])
    assert lines[0] == lines[1], restored[0][1][-3000:]  # the processes agree
    assert lines[0] == [
        "RESTORED as_saved 14 local True",
        "RESTORED own_lost 14 peer True",
        "RESTORED peer_garbled 12 local True",
        "RESTORED node_lost 12 peer True",
        "RESTORED peer_deleted 10 persistent True",
    ]
    assert "peer-of-0" in restored[1][1] and "CRC-32" in restored[1][1]  # the garbled copy, said


def test_a_failed_local_write_on_one_process_raises_on_every_process(two_process_jobs):
    """Issue 50, defect 7a: process 1's background write failed; it used to raise alone
    at the next save while process 0 waited for it in the exchange."""
    _, _, restored = two_process_jobs
    errors = [_failures(out)[0][1] for _, out, _ in restored]
    assert errors[0] == errors[1], errors  # both raise, with the same words
    assert errors[0].startswith("OSError: The local checkpoint tier's write of step 4 failed on ")
    assert "process 1 (NotADirectoryError:" in errors[0] and "l-w/process-1/4" in errors[0]
    assert "save of step 6" in errors[0] and "choose another local_directory" in errors[0]


def test_a_peer_killed_mid_restore_ends_the_restore_with_what_to_do(two_process_jobs):
    """Issue 50, defect 7c: process 1 is SIGKILLed mid-restore; process 0 raises at once
    (it used to fail with gloo's bare error), saying what happened and what to do."""
    _, saved, _ = two_process_jobs
    [(seconds, error)] = _failures(saved[0][1])
    assert seconds < 10, error
    assert error.startswith("ConnectionError: Process 0's collective with the other processes")
    assert "local checkpoint tier's restore" in error and "by peer" in error  # gloo's words
    assert "died or was killed" in error and "restart the whole job" in error


def test_a_peer_frozen_mid_restore_times_out_with_what_to_do(two_process_jobs):
    """Issue 50, defect 7c: process 1 is SIGSTOPped mid-restore (a lost host sends
    nothing either); process 0 gives up after the wait bound (2 s here) instead of
    waiting until JAX's heartbeat timeout aborts it."""
    _, _, restored = two_process_jobs
    assert restored[0][0] == 0 and restored[1][0] == -9, restored[0][1][-3000:]
    [_, (seconds, error)] = _failures(restored[0][1])
    assert 2 <= seconds < 10, error
    assert error.startswith("TimeoutError: Process 0 waited 2 s for the other processes")
    assert "local checkpoint tier's restore" in error and "restart the whole job" in error


def test_the_config_needs_backup_dir_local_dir_and_local_freq_together():

    base = {"backup_dir": "/tmp/b", "local_dir": "/dev/shm/r", "local_freq": 10}
    from distrain._src.train.outputs_config import CheckpointConfig

    assert CheckpointConfig(**base).local_freq == 10
    for drop in base:
        with pytest.raises(ValueError, match="checkpoint.local_dir"):
            CheckpointConfig(**{k: v for k, v in base.items() if k != drop})


def test_backup_and_restore_checks_the_local_directory_before_any_step(tmp_path):
    import optax

    (tmp_path / "file").write_text("")
    steps = []

    def train_step(state, batch):
        steps.append(1)
        return state, {}

    backup = dt.callbacks.BackupAndRestore(
        tmp_path / "b", local_directory=tmp_path / "file" / "local", local_save_freq=2
    )
    data = dt.data.ArrayPipeline({"x": np.ones((16, 2))}, global_batch_size=8, num_epochs=None)
    state = dt.TrainState.create(params=jnp.zeros(2), tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match="not writable"):
        dt.Trainer(dt.MirroredStrategy(), train_step, callbacks=[backup]).fit(state, data, steps=4)
    assert not steps  # nothing was traced or run
