"""A replica that spans several devices (``devices_per_replica=k``): FSDP and tensor
parallelism inside the same per-replica ``train_step``.

The conformance suite (tests/test_strategy_conformance.py) pins the common properties
for k = 2, 4, 8 and a tensor-parallel layout (same parameters as one device, placement,
donation, Trainer, reduce/gather, one compilation, checkpoints). Here: the layout and
its memory, ``clip_by_global_norm`` against mirrored, the Trainer's features,
checkpoints and an exact resume across layouts, collectives with one replica, the
errors, and 2 processes x 4 devices against 1 x 8.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import distrain as dt
from distrain import callbacks as cb
from distrain.metrics import Mean
from tests.test_sharded_state import train_1x8_and_2x4


def mlp_state(tx=None, policy=None):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "hidden": {"kernel": jax.random.normal(k1, (32, 256)) * 0.1, "bias": jnp.zeros(256)},
        "out": {"kernel": jax.random.normal(k2, (256, 8)) * 0.1, "bias": jnp.zeros(8)},
    }
    tx = tx or optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5))
    return dt.TrainState.create(params=params, tx=tx, policy=policy)


def data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 32)).astype(np.float32)
    y = (np.tanh(x[:, :8]) * 3).astype(np.float32)
    return {"x": x, "y": y}


def train_step(state, batch):
    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["hidden"]["kernel"] + p["hidden"]["bias"])
        err = jnp.sum((h @ p["out"]["kernel"] + p["out"]["bias"] - batch["y"]) ** 2, -1)
        return dt.compute_average_loss(err), err

    (_, err), grads = state.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), {"loss": Mean.from_values(err)}


def eval_step(state, batch):
    h = jnp.tanh(batch["x"] @ state.params["hidden"]["kernel"] + state.params["hidden"]["bias"])
    err = jnp.sum((h @ state.params["out"]["kernel"] - batch["y"]) ** 2, -1)
    return {"loss": Mean.from_values(err, mask=batch.get("mask"))}


def pipeline(arrays):
    return dt.data.ArrayPipeline(arrays, global_batch_size=16)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_the_replica_axis_and_fsdp_layout(devices):
    strategy = dt.MirroredStrategy(devices_per_replica=4)
    assert strategy.num_replicas_in_sync == 2 and strategy.devices_per_replica == 4
    assert dict(strategy.mesh.shape) == {"replica": 2, "model": 4}
    assert strategy.replica_devices(1) == tuple(devices[4:])  # neighbours
    state = strategy.put_replicated(mlp_state())
    hidden = state.params["hidden"]["kernel"]  # 32 KiB: split on its largest dimension
    assert hidden.sharding.spec == P(None, "model")
    assert hidden.addressable_shards[0].data.shape == (32, 64)
    out = state.params["out"]["kernel"]  # (256, 8) but 8 KiB: below min_shard_bytes
    assert out.sharding.spec == P()
    # Adam-free state: the small leaves stay whole inside the replica.
    assert state.params["out"]["bias"].sharding.spec == P()
    assert "k=" not in repr(dt.MirroredStrategy()) and "devices_per_replica=4" in repr(strategy)


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_clip_by_global_norm_equals_mirrored(devices, k):
    """The clip (active here: the gradient norm is far above 0.05) sees the global
    norm although each device holds a slice of every gradient."""
    batches = [{key: v[i : i + 32] for key, v in data().items()} for i in range(0, 96, 32)]
    finals = []
    for strategy in (dt.MirroredStrategy(), dt.MirroredStrategy(devices_per_replica=k)):
        state = strategy.put_replicated(mlp_state())
        for batch in strategy.experimental_distribute_dataset(batches):
            state, _ = strategy.run(train_step, args=(state, batch))
        finals.append(state)
    assert finals[1].params["hidden"]["kernel"].sharding.spec == P(None, "model")
    assert_trees_close(finals[1], finals[0])
    init = mlp_state().params["out"]["kernel"]
    moved = np.asarray(finals[0].params["out"]["kernel"]) - np.asarray(init)
    assert 0 < np.abs(moved).max() < 0.5 * 0.05 * 3 + 1e-6  # clipped: 3 steps of <= lr * 0.05


def test_memory_falls_with_devices_per_replica(devices):
    """State bytes per device ~1/k of mirrored; the compiled step's peak falls too."""
    tx = optax.adam(1e-3)
    batch = {k: v[:64] for k, v in data().items()}
    report = {}
    for k in (1, 8):
        strategy = dt.MirroredStrategy(devices_per_replica=k, min_shard_bytes=0)
        state = strategy.put_replicated(mlp_state(tx))
        dist = strategy.distribute_batch(batch)
        analysis = strategy.memory_analysis(train_step, args=(state, dist))
        assert set(analysis) == {
            "argument_bytes",
            "output_bytes",
            "temp_bytes",
            "alias_bytes",
            "peak_bytes",
        }
        assert analysis["peak_bytes"] == (
            analysis["argument_bytes"]
            + analysis["output_bytes"]
            + analysis["temp_bytes"]
            - analysis["alias_bytes"]
        )
        report[k] = (strategy.memory_report(state)["bytes_per_device"], analysis["peak_bytes"])
        assert strategy._compiler.num_programs == 1  # compiled, and nothing ran twice
        # As the Trainer runs it (state donated): the new state reuses the old's buffers.
        donated = strategy.memory_analysis(train_step, args=(state, dist), donate_argnums=0)
        state_bytes = strategy.memory_report(state)["bytes_per_device"]
        assert analysis["alias_bytes"] == 0
        assert donated["alias_bytes"] >= 0.9 * state_bytes
        assert donated["peak_bytes"] < analysis["peak_bytes"]  # (XLA may add temporaries)
    assert report[8][0] <= 1.3 / 8 * report[1][0]
    assert report[8][1] < 0.35 * report[1][1]


@pytest.mark.split_ends  # a slow test: see tests/conftest.py
@pytest.mark.parametrize("k", [4, 8, {"fsdp": 4, "tensor": 2}], ids=["4", "8", "fsdp4_tensor2"])
def test_trainer_features_equal_mirrored(devices, k):
    """fit (steps_per_execution, grad_accum_steps, mixed precision, device-resident and
    host input), evaluate and predict give mirrored's numbers."""
    results = []
    for strategy in (dt.MirroredStrategy(), dt.MirroredStrategy(devices_per_replica=k)):
        out = []
        for input_mode, policy in (("device", None), ("host", "mixed_bfloat16")):
            trainer = dt.Trainer(
                strategy,
                train_step,
                eval_step,
                predict_step=lambda s, b: {"y": b["x"] @ s.params["hidden"]["kernel"]},
                steps_per_execution=2,
                grad_accum_steps=2,
                input_mode=input_mode,
            )
            pipe = dt.data.ArrayPipeline(data(), global_batch_size=32, num_epochs=None)
            state, history = trainer.fit(mlp_state(policy=policy), pipe, steps=6)
            assert trainer.input_mode == input_mode
            evaluation = trainer.evaluate(state, pipeline(data(40, 1)))
            prediction = trainer.predict(state, pipeline(data(32, 2)))
            out.append((state, history.history["loss"], evaluation, prediction))
        results.append(out)
    for (s0, l0, e0, p0), (s1, l1, e1, p1) in zip(*results, strict=True):
        assert_trees_close(s1.params, s0.params, rtol=2e-3, atol=2e-4)  # bf16 compute
        np.testing.assert_allclose(l1, l0, rtol=2e-3)
        np.testing.assert_allclose(e1["loss"], e0["loss"], rtol=2e-3)
        np.testing.assert_allclose(p1["y"], p0["y"], rtol=2e-3, atol=2e-3)


def test_checkpoints_move_between_layouts(tmp_path, devices):
    saver = dt.MirroredStrategy(devices_per_replica=4)
    state = saver.put_replicated(mlp_state(optax.adam(1e-3)))
    manager = dt.checkpoint.CheckpointManager(tmp_path / "ckpt", async_save=False)
    manager.save(1, state)
    manager.close()
    for loader in (
        dt.MirroredStrategy(),
        dt.MirroredStrategy(devices_per_replica=8),
        dt.MirroredStrategy(devices[:4], devices_per_replica=2),
        dt.OneDeviceStrategy("cpu:0"),
    ):
        target = loader.put_replicated(mlp_state(optax.adam(1e-3)))
        restored = dt.checkpoint.CheckpointManager(tmp_path / "ckpt").restore(target=target).state
        for got, want, tmpl in zip(
            jax.tree.leaves(restored), jax.tree.leaves(state), jax.tree.leaves(target), strict=True
        ):
            assert got.sharding == tmpl.sharding  # the loader's layout
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_run_resumes_exactly_on_another_layout(tmp_path, devices):
    """Crash on 8 mirrored replicas, resume on 1 replica of 8 devices: the same batches
    (data position restored) and the parameters of a run that never crashed."""

    def run(strategy, backup, crash_at=None):
        def crash(info):
            if crash_at is not None and info.step >= crash_at:
                raise RuntimeError("simulated crash")

        trainer = dt.Trainer(
            strategy,
            train_step,
            callbacks=[
                cb.BackupAndRestore(backup, save_freq=2, delete_checkpoint=False),
                cb.LambdaCallback(on_train_batch_end=crash),
            ],
        )
        pipe = dt.data.ArrayPipeline(data(), global_batch_size=16, seed=3)
        state, _ = trainer.fit(mlp_state(), pipe, epochs=2)
        return trainer, state

    _, reference = run(dt.MirroredStrategy(), tmp_path / "a")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(dt.MirroredStrategy(), tmp_path / "b", crash_at=5)
    trainer, resumed = run(dt.MirroredStrategy(devices_per_replica=8), tmp_path / "b")
    assert 4 <= trainer.loop.initial_step <= 5
    assert_trees_close(resumed, reference)


def test_collectives_with_one_replica_of_eight_devices(devices):
    """XLA rejects a cross-replica all-reduce over a manual axis of size 1; with one
    replica the replica context's collectives must still work (and be identities)."""
    strategy = dt.MirroredStrategy(devices_per_replica=8)

    def fn(x):
        ctx = dt.get_replica_context()
        total = ctx.all_reduce("sum", x)
        return (
            total,
            ctx.all_gather(x, axis=0),
            ctx.replica_id_in_sync_group,
            jax.lax.psum(x, strategy.axis_name),
        )

    x = jnp.arange(16.0).reshape(8, 2)
    total, gathered, rid, psummed = strategy.run(fn, args=(strategy.put_replicated(x),))
    np.testing.assert_array_equal(total, x)
    np.testing.assert_array_equal(psummed, x)
    np.testing.assert_array_equal(strategy.reduce("sum", gathered), x)
    assert int(strategy.reduce("sum", rid)) == 0


def test_values_that_vary_only_inside_a_replica_are_mirrored(devices):
    """The replica analysis: results identical on every replica come back as one
    (mirrored) array, whatever XLA does over a replica's devices; per-replica results
    keep one row per replica."""
    strategy = dt.MirroredStrategy(devices_per_replica=2)
    state = strategy.put_replicated(mlp_state())
    batch = strategy.distribute_batch({k: v[:32] for k, v in data().items()})
    new, metrics = strategy.run(train_step, args=(state, batch))
    assert not isinstance(new.params["hidden"]["kernel"], dt.PerReplica)
    assert new.params["hidden"]["kernel"].sharding.spec == P(None, "model")
    sums = strategy.experimental_local_results(metrics["loss"].total)
    assert len(sums) == 4 and len({float(s) for s in sums}) == 4  # each replica's rows
    rows = strategy.experimental_local_results(batch)
    np.testing.assert_array_equal(np.concatenate([r["x"] for r in rows]), data()["x"][:32])


def test_tensor_parallel_rules_lay_out_parameters_and_their_moments(devices):
    strategy = dt.MirroredStrategy(
        devices_per_replica=4,
        layout={"hidden/kernel": P(None, "model"), "out/kernel": ("model", None)},
        min_shard_bytes=1 << 30,  # no FSDP: only the rules split anything
    )
    state = strategy.put_replicated(mlp_state(optax.adam(1e-3)))
    mu = state.opt_state[0].mu
    assert state.params["hidden"]["kernel"].sharding.spec == P(None, "model")
    assert mu["hidden"]["kernel"].sharding.spec == P(None, "model")  # follows its parameter
    assert mu["out"]["kernel"].addressable_shards[0].data.shape == (64, 8)  # rows split
    assert state.params["hidden"]["bias"].sharding.spec == P()
    batch = strategy.distribute_batch({k: v[:32] for k, v in data().items()})
    new, _ = strategy.run(train_step, args=(state, batch))
    assert new.opt_state[0].mu["out"]["kernel"].addressable_shards[0].data.shape == (64, 8)


def test_errors(devices):
    with pytest.raises(ValueError, match=r"=3 needs 3 devices .* \(8\).*\[1, 2, 4, 8\]"):
        dt.MirroredStrategy(devices_per_replica=3)
    for bad in (0, -2, True, "all", 2.0):
        with pytest.raises(ValueError, match=r"positive int, 'process', or a mapping.*Received"):
            dt.MirroredStrategy(devices_per_replica=bad)
    with pytest.raises(ValueError, match="needs devices_per_replica > 1"):
        dt.MirroredStrategy(layout={"w": P("model")})
    with pytest.raises(ValueError, match="not a regular expression"):
        dt.MirroredStrategy(devices_per_replica=2, layout={"(": P("model")})
    with pytest.raises(
        ValueError, match=r"'replica', which is neither an axis of the replica \['model'\]"
    ):
        dt.MirroredStrategy(devices_per_replica=2, layout={"w": P("replica")})
    with pytest.raises(ValueError, match="must give a jax.sharding.PartitionSpec"):
        dt.MirroredStrategy(devices_per_replica=2, layout={"w": "model"})
    with pytest.raises(ValueError, match=r"dict or \(pattern, spec\) pairs, or a pytree"):
        dt.MirroredStrategy(devices_per_replica=2, layout=[("w",)])
    with pytest.raises(ValueError, match="shard_state splits the state over replicas"):
        dt.MirroredStrategy(devices_per_replica=2, shard_state=True)
    strategy = dt.MirroredStrategy(devices_per_replica=8, layout={"hidden/bias": P(None, "model")})
    with pytest.raises(ValueError, match=r"'hidden/bias' has shape \(256,\) \(1 dimensions\)"):
        strategy.put_replicated(mlp_state().params)
    strategy = dt.MirroredStrategy(
        devices[:3], devices_per_replica=3, layout={"out/kernel": P(None, "model")}
    )
    with pytest.raises(
        ValueError, match=r"dimension 1 of the leaf 'out/kernel' \(shape \(256, 8\)\)"
    ):
        strategy.put_replicated(mlp_state().params)
    with pytest.raises(TypeError, match="needs a function as `fn`"):
        strategy.memory_analysis(42)


@pytest.mark.split_ends  # a slow test: see tests/conftest.py
@pytest.mark.parametrize("k", ["4", "process"])
def test_two_processes_of_four_devices_match_one_of_eight(tmp_path, k):
    """One replica per process (k=4 or 'process': HSDP) on 2 processes x 4 devices
    trains as 8 mirrored replicas on one process."""
    args = ["--shard-state", "0"]
    want, results = train_1x8_and_2x4(tmp_path, args, [*args, "--devices-per-replica", k])
    for got in results:
        assert int(got["replicas"]) == 2 and int(want["replicas"]) == 8
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
        for name in ("w1", "b1", "w2", "b2"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
        assert int(got["bytes_per_device"]) < int(want["bytes_per_device"])
    assert want["losses"][0] != want["losses"][-1]


@pytest.mark.parametrize("k", [2, 8, {"fsdp": 2, "tensor": 2}])
def test_replica_ids_and_a_raw_axis_index(devices, k):
    """The replica context's id works when replicas span devices (also inside scan and
    random keys), and so does a raw jax.lax.axis_index over the replica axis (the
    replica's named mesh is the context mesh while the step is traced)."""
    strategy = dt.MirroredStrategy(devices_per_replica=k)

    def ids(x):
        i = dt.get_replica_context().replica_id_in_sync_group
        key = jax.random.fold_in(jax.random.key(0), i)
        raw = jax.lax.axis_index(strategy.axis_name)
        return jax.lax.scan(lambda c, _: (c + i, None), x, None, length=3)[0], key, raw

    total, keys, raw = strategy.run(ids, args=(jnp.float32(0),))
    n = strategy.num_replicas_in_sync
    got = [float(t) for t in strategy.experimental_local_results(total)]
    assert got == [3.0 * i for i in range(n)]
    assert [int(r) for r in strategy.experimental_local_results(raw)] == list(range(n))


def test_devices_per_replica_across_processes():
    """The process checks, on device records of 2 processes (real 2-process jobs are
    test_two_processes_of_four_devices_match_one_of_eight and tests/test_replica_mesh.py)."""
    from types import SimpleNamespace

    from distrain._src.strategy.replica_mesh import resolve_inner_axes, spans_processes

    def check(value, devices):
        return resolve_inner_axes(value, devices, "replica")

    two_by_four = [SimpleNamespace(process_index=i // 4) for i in range(8)]
    assert check("process", two_by_four) == {"model": 4}
    assert check(2, two_by_four) == {"model": 2}  # inside a process
    assert check(8, two_by_four) == {"model": 8}  # whole processes
    assert check({"fsdp": 4, "tensor": 2}, two_by_four) == {"fsdp": 4, "tensor": 2}
    assert spans_processes(two_by_four, 8) and not spans_processes(two_by_four, 4)
    three = [SimpleNamespace(process_index=i // 2) for i in range(6)]
    with pytest.raises(ValueError, match=r"divide the devices of every process or be a multiple"):
        check(3, three)  # a replica would cut process 1 in two
    uneven = [SimpleNamespace(process_index=0)] * 6 + [SimpleNamespace(process_index=1)] * 2
    with pytest.raises(ValueError, match=r"'process' needs the same number .* \{0: 6, 1: 2\}"):
        check("process", uneven)
    with pytest.raises(ValueError, match=r"divide the devices of every process or be a multiple"):
        check(4, uneven)


def test_configs_take_devices_per_replica(devices):
    from distrain._src.train.config import config_from_dict
    from distrain._src.train.strategy_from_config import build_strategy
    from distrain.config import ConfigError

    code = {"model": {"fn": "m:f"}, "data": {"fn": "d:f"}, "train": {"train_step": "s:f"}}
    for k, replicas in ((2, 4), ("process", 1)):
        cfg = config_from_dict({**code, "strategy": {"devices_per_replica": k}})
        strategy = build_strategy(cfg.strategy)
        assert strategy.num_replicas_in_sync == replicas
    with pytest.raises(ConfigError, match=r"strategy.devices_per_replica applies to .* mirrored"):
        config_from_dict({**code, "strategy": {"name": "one_device", "devices_per_replica": 2}})
