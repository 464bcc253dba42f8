"""CheckpointManager in one process: round trips, policies, errors, corruption, elastic restore.

Everything here writes real orbax checkpoints to tmp_path and reads them back; the
corruption tests damage the real files on disk.
"""

import os
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import distrain as dt
from distrain._src.checkpoint import _fingerprint
from distrain.checkpoint import (
    PREEMPTION_EXIT_CODE,
    CheckpointCorruptionError,
    CheckpointManager,
    PreemptionHandler,
    Restored,
)

_TX = optax.adam(1e-3)  # one instance: it is part of the TrainState's tree structure


def _state(seed=0, shape=(3, 4)):
    k = jax.random.key(seed)
    params = {"w": jax.random.normal(k, shape), "b": jnp.arange(shape[1], dtype=jnp.float32)}
    return dt.TrainState.create(params=params, tx=_TX, rng=jax.random.key(seed + 1))


def _assert_tree_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), strict=True)


def _step_files(directory, step):
    root = os.path.join(directory, str(step))
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


# ------------------------------------------------------------------ round trips
def test_round_trip_restores_state_rng_data_position_and_metadata(tmp_path):
    state = _state()
    state = state.apply_gradients(grads=jax.tree.map(jnp.ones_like, state.params))
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(target=state) is None
        assert mgr.save(
            1,
            state,
            data_state={"step": 1, "seed": 3},
            metadata={"epoch": 0, "history": {"loss": [np.float32(0.5), float("nan")]}},
        )
        mgr.wait_until_finished()
        restored = mgr.restore(target=_state(seed=9))
    assert isinstance(restored, Restored)
    assert restored.step == 1
    assert isinstance(restored.state, dt.TrainState)
    _assert_tree_equal(restored.state, state)
    assert jax.dtypes.issubdtype(restored.state.rng.dtype, jax.dtypes.prng_key)
    assert restored.data_state == {"step": 1, "seed": 3}
    assert restored.metadata["epoch"] == 0
    loss = restored.metadata["history"]["loss"]
    assert loss[0] == 0.5 and np.isnan(loss[1])


def test_restore_without_target_gives_numpy_and_typed_keys(tmp_path):
    state = _state()
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(2, state)
        restored = mgr.restore()
    assert restored.data_state is None and restored.metadata is None
    tree = restored.state
    np.testing.assert_array_equal(tree["params"]["w"], np.asarray(state.params["w"]))
    assert isinstance(tree["params"]["w"], np.ndarray)
    # optax's (ScaleByAdamState, EmptyState) tuple comes back as a list of dicts
    np.testing.assert_array_equal(tree["opt_state"][0]["mu"]["b"], np.zeros(4, np.float32))
    assert jax.dtypes.issubdtype(tree["rng"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(tree["rng"]), jax.random.key_data(state.rng))


def test_numpy_python_and_low_precision_leaves_keep_their_types(tmp_path):
    bf16 = jnp.linspace(-2, 2, 7, dtype=jnp.bfloat16)
    state = {"np": np.arange(5, dtype=np.int16), "count": 7, "scale": 0.25, "bf16": bf16}
    target = {"np": np.zeros(5, np.int16), "count": 0, "scale": 0.0, "bf16": jnp.zeros_like(bf16)}
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state)
        r = mgr.restore(target=target)
    assert r.state["count"] == 7 and type(r.state["count"]) is int
    assert r.state["scale"] == 0.25 and type(r.state["scale"]) is float
    np.testing.assert_array_equal(r.state["np"], state["np"], strict=True)
    assert r.state["bf16"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(r.state["bf16"]), np.asarray(bf16))


def test_empty_state_is_refused(tmp_path):
    with (
        CheckpointManager(tmp_path) as mgr,
        pytest.raises(ValueError, match="at least one array leaf"),
    ):
        mgr.save(1, {"nothing": None})


def test_restore_into_other_dtype_casts(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": jnp.full((2,), 1.5, jnp.float32)})
        r = mgr.restore(target={"w": jnp.zeros((2,), jnp.bfloat16)})
    assert r.state["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(r.state["w"], np.float32), [1.5, 1.5])


# --------------------------------------------------------------------- policies
def test_interval_force_and_stale_steps(tmp_path):
    state = _state()
    with CheckpointManager(tmp_path, save_interval_steps=5) as mgr:
        assert [s for s in range(1, 12) if mgr.save(s, state)] == [5, 10]
        assert mgr.save(12, state, force=True)
        assert not mgr.save(12, state, force=True)  # already saved: nothing to do
        with pytest.warns(UserWarning, match="already holds the newer step 12"):
            assert not mgr.save(11, state, force=True)
        mgr.wait_until_finished()
        assert mgr.latest_step() == 12


def test_old_checkpoints_are_deleted_only_after_the_new_one_is_committed(tmp_path):
    # Watch the directory while step 3 is written (a few MB, so writing takes a while):
    # deleting step 1 before step 3 is committed would show as a moment with one step.
    def on_disk():
        return sorted(int(n) for n in os.listdir(tmp_path) if n.isdigit())

    state = _state(shape=(1024, 1024))
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            seen.append(tuple(on_disk()))

    with CheckpointManager(tmp_path, max_to_keep=2) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        mgr.wait_until_finished()
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            assert mgr.save(3, state)
            mgr.wait_until_finished()
        finally:
            done.set()
            watcher.join()
        assert on_disk() == [2, 3] and mgr.all_steps() == [2, 3]
    # Only these states, and the watcher saw step 3 committed while step 1 still existed.
    assert seen[0] == (1, 2) and (1, 2, 3) in seen, sorted(set(seen))
    assert set(seen) <= {(1, 2), (1, 2, 3), (2, 3)}, sorted(set(seen))


def test_max_to_keep_none_keeps_everything(tmp_path):
    with CheckpointManager(tmp_path, max_to_keep=None, async_save=False) as mgr:
        for s in range(1, 5):
            mgr.save(s, {"x": jnp.ones(2)})
        assert mgr.all_steps() == [1, 2, 3, 4]


def test_reopening_sees_previous_steps_and_cleans_unfinished_saves(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"x": jnp.ones(2)})
    # What a process killed mid-save leaves behind:
    leftover = tmp_path / "4.orbax-checkpoint-tmp-1234567"
    leftover.mkdir()
    (leftover / "junk").write_text("partial")
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() == 3
        assert mgr.save(4, {"x": jnp.zeros(2)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]
    assert not leftover.exists()


# ----------------------------------------------------------------------- errors
def test_unwritable_directory_fails_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="Expected a checkpoint directory this process can create"):
        CheckpointManager(blocker / "ckpt")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"max_to_keep": 0},
            r"`max_to_keep` must be a positive int or None\. Received: max_to_keep=0",
        ),
        (
            {"save_interval_steps": 0},
            r"`save_interval_steps` must be a positive int\. Received: save_interval_steps=0",
        ),
        ({"save_interval_steps": 2.5}, r"`save_interval_steps` must be a positive int"),
    ],
)
def test_invalid_options(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CheckpointManager(tmp_path, **kwargs)


def test_invalid_step_and_unknown_step(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(ValueError, match=r"`step` to be a non-negative int; received -1"):
            mgr.save(-1, {"x": jnp.ones(1)})
        mgr.save(1, {"x": jnp.ones(1)})
        with pytest.raises(ValueError, match=r"one of the checkpoints in .*\[1\]; received 7"):
            mgr.restore(7)


def test_unsupported_state_leaf_and_non_json_metadata(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(TypeError, match="leaf of type str"):
            mgr.save(1, {"x": jnp.ones(1), "name": "mlp"})
        with pytest.raises(TypeError, match=r"`metadata`\['when'\] must be JSON-compatible"):
            mgr.save(1, {"x": jnp.ones(1)}, metadata={"when": object()})
        with pytest.raises(TypeError, match="must have string keys"):
            mgr.save(1, {"x": jnp.ones(1)}, data_state={1: 2})
        assert mgr.all_steps() == []


def test_use_after_close(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.close()
    mgr.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"save\(\) called after close\(\)"):
        mgr.save(1, {"x": jnp.ones(1)})


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (
            _state(shape=(5, 4)),
            r"at 'params/w' the checkpoint has shape \(3, 4\) \(float32\), the target has "
            r"shape \(5, 4\)",
        ),
        (
            {"params": {"w": jnp.zeros((3, 4))}},
            r"the checkpoint has a leaf at 'params/b' with shape \(4,\), the target has no leaf",
        ),
        (
            {"params": {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4), "c": jnp.zeros(2)}},
            r"the target has a leaf at 'params/c' with shape \(2,\), the checkpoint has no leaf",
        ),
    ],
)
def test_incompatible_target_names_path_and_shapes(tmp_path, target, match):
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state() if isinstance(target, dt.TrainState) else {"params": _state().params})
        with pytest.raises(ValueError, match=match):
            mgr.restore(target=target)
        assert mgr.all_steps() == [1]  # a bad target is not mistaken for corruption


def test_target_that_cannot_hold_the_array_is_not_mistaken_for_corruption(tmp_path, devices):
    mesh = jax.make_mesh((8,), ("d",), devices=devices)
    bad = {"a": jax.ShapeDtypeStruct((5, 3), jnp.float32, sharding=NamedSharding(mesh, P("d")))}
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"a": jnp.ones((5, 3))})
        with pytest.raises(ValueError, match="dimension size is 5"):  # 5 rows over 8 devices
            mgr.restore(target=bad)
        assert mgr.all_steps() == [1]
        assert mgr.restore().step == 1


def test_foreign_orbax_checkpoint_is_refused(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path, item_names=("state",)) as raw:
        raw.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"x": jnp.ones(2)})))
    with (
        CheckpointManager(tmp_path) as mgr,
        pytest.raises(ValueError, match="has no 'meta' item"),
    ):
        mgr.restore()


# ------------------------------------------------------------------- corruption
_BIG = (32, 64)  # large enough for orbax to store the chunks in data files, not inline


def _two_checkpoints(directory):
    mgr = CheckpointManager(directory, max_to_keep=3, async_save=False)
    good, bad = _state(seed=1, shape=_BIG), _state(seed=2, shape=_BIG)
    mgr.save(1, good, data_state={"step": 1})
    mgr.save(2, bad, data_state={"step": 2})
    mgr.close()
    return good


def _is_chunk(path):
    # ocdbt.process_<i>/d/<hash>: array chunks (state/d/ holds the b-tree index)
    return f"ocdbt.process_0{os.sep}d{os.sep}" in path


def _damage(path, how):
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        for i in range(len(data) // 3, min(len(data), len(data) // 3 + 16)):
            data[i] ^= 0x5A
    with open(path, "wb") as f:
        f.write(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "garble"])
@pytest.mark.parametrize("which", ["array_data", "json_items", "everything"])
def test_damaged_newest_checkpoint_falls_back_with_warning(tmp_path, how, which):
    good = _two_checkpoints(tmp_path)
    files = _step_files(tmp_path, 2)
    if which == "array_data":  # the chunks of the arrays themselves
        files = [f for f in files if _is_chunk(f)]
    elif which == "json_items":
        files = [f for f in files if f.endswith(os.path.join("meta", "metadata"))]
    assert files
    for f in files:
        _damage(f, how)
    # Orbax reads garbled chunks without error; the fingerprints catch them.
    reason = "does not match the fingerprint" if (which, how) == ("array_data", "garble") else ""
    with CheckpointManager(tmp_path) as mgr:
        warning = rf"Checkpoint {tmp_path}{os.sep}2 is damaged.*{reason}"
        with pytest.warns(UserWarning, match=warning):
            restored = mgr.restore(target=_state(shape=_BIG))
        assert restored.step == 1 and restored.data_state == {"step": 1}
        _assert_tree_equal(restored.state, good)
        # The damaged step is set aside, so training can save step 2 again.
        assert mgr.all_steps() == [1]
        assert any(n.startswith("2.corrupt-") for n in os.listdir(tmp_path))
        assert mgr.save(2, good, force=True)


def test_damaged_explicit_step_raises_and_is_left_in_place(tmp_path):
    _two_checkpoints(tmp_path)
    for f in _step_files(tmp_path, 2):
        if _is_chunk(f):
            _damage(f, "garble")
    with (
        CheckpointManager(tmp_path) as mgr,
        pytest.raises(CheckpointCorruptionError, match="does not match the fingerprint"),
    ):
        mgr.restore(2, target=_state(shape=_BIG))
    assert sorted(n for n in os.listdir(tmp_path) if n.isdigit()) == ["1", "2"]


@pytest.mark.parametrize("item", ["meta", "data"])
def test_any_changed_byte_of_the_json_items_is_detected(tmp_path, item):
    # Many byte changes leave valid JSON (a renamed key, another digit); the
    # checksum stored in the item catches them all.
    _two_checkpoints(tmp_path)
    path = tmp_path / "2" / item / "metadata"
    original = path.read_bytes()
    with CheckpointManager(tmp_path) as mgr:
        for frac in (0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95):
            i = int(len(original) * frac)
            changed = bytearray(original)
            changed[i] = ord("7") if changed[i] != ord("7") else ord("8")
            path.write_bytes(bytes(changed))
            with pytest.raises(CheckpointCorruptionError):
                mgr.restore(2, target=_state(shape=_BIG))
        path.write_bytes(original)
        assert mgr.restore(2, target=_state(shape=_BIG)).step == 2


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    _two_checkpoints(tmp_path)
    for step in (1, 2):
        for f in _step_files(tmp_path, step):
            _damage(f, "truncate")
    with CheckpointManager(tmp_path) as mgr:
        with (
            pytest.warns(UserWarning, match="is damaged"),
            pytest.raises(CheckpointCorruptionError, match="No checkpoint in .* could be restored"),
        ):
            mgr.restore(target=_state(shape=_BIG))


def test_fingerprints_agree_between_numpy_and_sharded_jax(devices):
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    rs = np.random.default_rng(0)
    for dtype in (np.float32, np.int8, np.bool_, np.uint32, np.float16, jnp.bfloat16, np.complex64):
        a = (rs.normal(size=(16, 5)) * 10).astype(dtype)
        sharded = jax.device_put(a, NamedSharding(mesh, P("x")))
        fp = _fingerprint.fingerprint_numpy(a)
        assert _fingerprint.fingerprint_jax([sharded]) == [fp]
        b = a.copy()
        b.reshape(-1).view(np.uint8)[7] ^= 1  # one flipped bit
        assert _fingerprint.fingerprint_numpy(b) != fp
    # a permutation of the same values is a different fingerprint
    x = np.arange(10, dtype=np.float32)
    assert _fingerprint.fingerprint_numpy(x) != _fingerprint.fingerprint_numpy(x[::-1])


# ---------------------------------------------------------------------- elastic
def test_written_on_8_devices_restores_on_4_and_on_1(tmp_path, devices):
    assert len(devices) == 8
    mesh8 = jax.make_mesh((8,), ("d",), devices=devices)
    rs = np.random.default_rng(0)
    values = {
        "replicated": rs.normal(size=(5, 3)).astype(np.float32),
        "sharded": rs.normal(size=(16, 6)).astype(np.float32),
    }
    state = {
        "replicated": jax.device_put(values["replicated"], NamedSharding(mesh8, P())),
        "sharded": jax.device_put(values["sharded"], NamedSharding(mesh8, P("d"))),
        "rng": jax.device_put(jax.random.key(3), NamedSharding(mesh8, P())),
    }
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(10, state)
        mgr.wait_until_finished()

        mesh4 = jax.make_mesh((4,), ("d",), devices=devices[:4])
        rep4, rows4 = NamedSharding(mesh4, P()), NamedSharding(mesh4, P("d"))
        target4 = {
            "replicated": jax.ShapeDtypeStruct((5, 3), jnp.float32, sharding=rep4),
            "sharded": jax.ShapeDtypeStruct((16, 6), jnp.float32, sharding=rows4),
            "rng": jax.ShapeDtypeStruct((), state["rng"].dtype, sharding=rep4),
        }
        one = SingleDeviceSharding(devices[5])
        target1 = {
            "replicated": jax.device_put(jnp.zeros((5, 3)), one),
            "sharded": jax.device_put(jnp.zeros((16, 6)), one),
            "rng": jax.device_put(jax.random.key(0), one),
        }
        for target in (target4, target1):
            r = mgr.restore(target=target)
            for name, arr in r.state.items():
                assert arr.sharding.is_equivalent_to(target[name].sharding, arr.ndim)
            for name in ("replicated", "sharded"):
                np.testing.assert_array_equal(np.asarray(r.state[name]), values[name], strict=True)
            np.testing.assert_array_equal(
                jax.random.key_data(r.state["rng"]), jax.random.key_data(jax.random.key(3))
            )
        assert len(r.state["sharded"].sharding.device_set) == 1
        assert len(mgr.restore(target=target4).state["sharded"].addressable_shards) == 4


# ------------------------------------------------------------------- preemption
def test_sigterm_sets_stop_flag_and_exit_code():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionHandler() as handler:
        assert not handler.should_stop(1)
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread, right here
        assert handler.signal_received
        assert handler.should_stop(2) and handler.should_stop(3)
        with pytest.raises(SystemExit) as info:
            handler.exit()
        assert info.value.code == PREEMPTION_EXIT_CODE == 143
    assert signal.getsignal(signal.SIGTERM) == before


def test_second_sigterm_falls_through_to_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with PreemptionHandler():
            os.kill(os.getpid(), signal.SIGTERM)
            assert seen == []
            os.kill(os.getpid(), signal.SIGTERM)
            assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_request_stop_without_a_signal():
    with PreemptionHandler(exit_code=99) as handler:
        handler.request_stop()
        assert handler.should_stop(0)
        with pytest.raises(SystemExit, match="99"):
            handler.exit()


def test_preemption_handler_errors():
    with pytest.raises(ValueError, match="`sync_every_steps` must be a positive int or None"):
        PreemptionHandler(sync_every_steps=0)
    errors = []

    def make():
        try:
            PreemptionHandler()
        except ValueError as e:
            errors.append(str(e))

    t = threading.Thread(target=make, name="worker")
    t.start()
    t.join()
    assert errors and "created in the main thread" in errors[0] and "'worker'" in errors[0]
