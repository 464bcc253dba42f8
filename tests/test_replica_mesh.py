"""A replica is a named mesh: 2-D layouts, logical names, the context mesh inside a
step, abstract memory analysis, and replicas that span processes (real processes on
loopback through ``distrain launch``)."""

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import distrain as dt
from tests.processes import run_together, xla_flags

SCRIPT = str(Path(__file__).parent / "scripts" / "mw_mesh.py")
MESH_42 = {"fsdp": 4, "tensor": 2}
RULES_42 = {"w1": ["fsdp", "tensor"], "w2": ["tensor", "fsdp"]}


def make_state():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "up": {"kernel": jax.random.normal(k1, (64, 256)) * 0.1, "bias": jnp.zeros(256)},
        "down": {"kernel": jax.random.normal(k2, (256, 8)) * 0.1},
    }
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    return dt.TrainState.create(params=params, tx=tx)


def step(state, batch):
    def loss_fn(p):
        h = batch["x"] @ p["up"]["kernel"] + p["up"]["bias"]
        if "tensor" in dt.get_strategy().inner_axes:  # an activation laid out by the user
            h = jax.lax.with_sharding_constraint(h, P("fsdp", "tensor"))
        err = jax.nn.relu(h) @ p["down"]["kernel"] - batch["y"]
        return dt.compute_average_loss((err**2).mean(-1))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def batch(rows=32):
    r = np.random.default_rng(0)
    return {
        "x": r.normal(size=(rows, 64)).astype(np.float32),
        "y": r.normal(size=(rows, 8)).astype(np.float32),
    }


def train(strategy, steps=3):
    with strategy.scope():
        state = strategy.put_replicated(make_state())
        b = strategy.distribute_batch(batch())
        for _ in range(steps):
            state, _ = strategy.run(step, args=(state, b))
    return state


TP = {"up/kernel": P("fsdp", "tensor"), "down/kernel": P("tensor", None)}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(devices_per_replica=MESH_42, layout=TP),
        dict(devices_per_replica={"fsdp": 2, "tensor": 2}, layout=TP),
        dict(devices_per_replica={"fsdp": 8}),
        dict(devices_per_replica={"data": 2, "fsdp": 2, "tensor": 2}, layout=TP),
    ],
    ids=["fsdp4_tensor2", "2_replicas_fsdp2_tensor2", "fsdp8", "three_axes"],
)
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_named_meshes_train_as_mirrored(devices, kwargs):
    """clip_by_global_norm + Adam with an activation constraint: the same parameters as
    8 mirrored replicas, and the state laid out as the rules say (moments too)."""
    want = train(dt.MirroredStrategy())
    strategy = dt.MirroredStrategy(min_shard_bytes=0, **kwargs)
    got = train(strategy)
    inner = kwargs["devices_per_replica"]
    assert strategy.inner_axes == inner
    assert strategy.mesh.axis_names == ("replica", *inner)
    assert strategy.num_replicas_in_sync == 8 // int(np.prod(list(inner.values())))
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    want_spec = TP["up/kernel"] if "layout" in kwargs else P(None, "fsdp")
    assert got.params["up"]["kernel"].sharding.spec == want_spec
    assert got.opt_state[1][0].mu["up"]["kernel"].sharding.spec == want_spec


def test_logical_names_and_a_tree_of_specs(devices):
    """A pytree of specs in logical names (flax's form) with logical_axis_rules."""
    specs = {"up": {"kernel": P("embed", "mlp")}, "down": {"kernel": P("mlp", None)}}
    strategy = dt.MirroredStrategy(
        devices_per_replica=MESH_42,
        layout=specs,
        logical_axis_rules={"embed": "fsdp", "mlp": "tensor"},
    )
    state = strategy.put_replicated(make_state())
    assert state.params["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert state.opt_state[1][0].nu["down"]["kernel"].sharding.spec == P("tensor", None)
    assert state.params["up"]["bias"].sharding.spec == P()  # small: under min_shard_bytes


def test_abstract_memory_analysis_allocates_nothing_and_agrees(devices):
    strategy = dt.MirroredStrategy(devices_per_replica=MESH_42, layout=TP)
    with strategy.scope():
        abstract = jax.eval_shape(make_state)
        rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch())
        ab_batch = strategy.distribute_batch(rows)
        assert isinstance(ab_batch.value["x"], jax.ShapeDtypeStruct)
        planned = strategy.memory_analysis(step, args=(abstract, ab_batch))
        state = strategy.put_replicated(make_state())
        real = strategy.memory_analysis(step, args=(state, strategy.distribute_batch(batch())))
    assert planned == real
    assert planned["peak_bytes"] > planned["argument_bytes"] > 0


def test_layout_errors_name_what_is_wrong(devices):
    with pytest.raises(ValueError, match=r"\['nope/kernel'\] match no leaf"):
        dt.MirroredStrategy(
            devices_per_replica=MESH_42, layout={"nope/kernel": P("fsdp")}
        ).put_replicated(make_state())
    with pytest.raises(
        ValueError,
        match=r"names 'model', which is neither an axis of the replica \['fsdp', 'tensor'\]",
    ):
        dt.MirroredStrategy(devices_per_replica=MESH_42, layout={"up": P("model")})
    with pytest.raises(ValueError, match=r"names 'mlp'.*give logical_axis_rules"):
        dt.MirroredStrategy(devices_per_replica=MESH_42, layout={"up": P("mlp")})
    with pytest.raises(
        ValueError, match=r"logical_axis_rules names \['vocab'\], which no layout spec uses"
    ):
        dt.MirroredStrategy(
            devices_per_replica=MESH_42,
            layout={"up/kernel": P("embed")},
            logical_axis_rules={"embed": "fsdp", "vocab": "tensor"},
        ).put_replicated(make_state())
    with pytest.raises(ValueError, match=r"maps 'embed' to \['model'\], which the replica lacks"):
        dt.MirroredStrategy(devices_per_replica=MESH_42, logical_axis_rules={"embed": "model"})
    with pytest.raises(ValueError, match=r"uses an axis twice"):
        dt.MirroredStrategy(devices_per_replica=MESH_42, layout={"up": P("fsdp", "fsdp")})
    with pytest.raises(
        ValueError, match=r"dimension 1 of the leaf 'w' \(shape \(4, 6\)\) over 8 devices"
    ):
        dt.MirroredStrategy(
            devices_per_replica=MESH_42, layout={"w": P(None, ("fsdp", "tensor"))}
        ).put_replicated({"w": jnp.zeros((4, 6))})
    with pytest.raises(
        ValueError, match=r"pytree must have PartitionSpec leaves .* at 'up/kernel'"
    ):
        dt.MirroredStrategy(devices_per_replica=MESH_42, layout={"up": {"kernel": 3}})
    for bad, match in [
        ({}, r"at least one inner axis"),
        ({"replica": 2}, r"other than 'replica'"),
        ({"fsdp": 0}, r"\['fsdp'\] must be a positive int. Received: 0"),
        ({"fsdp": 3}, r"needs 3 devices per replica, which must divide .* \(8\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            dt.MirroredStrategy(devices_per_replica=bad)


def test_configs_take_a_named_mesh_layout_and_logical_rules(devices):
    from distrain._src.train.config import config_from_dict
    from distrain._src.train.strategy_from_config import build_strategy

    code = {"model": {"fn": "m:f"}, "data": {"fn": "d:f"}, "train": {"train_step": "s:f"}}
    strategy_cfg = {
        "devices_per_replica": {"fsdp": 4, "tensor": 2},
        "layout": {"up/kernel": ["embed", "mlp"], "down/kernel": [["fsdp", "tensor"], None]},
        "logical_axis_rules": {"embed": "fsdp", "mlp": "tensor"},
        "batch_layout": {"x": [None, "tensor"]},
    }
    strategy = build_strategy(config_from_dict({**code, "strategy": strategy_cfg}).strategy)
    state = strategy.put_replicated(make_state())
    assert state.params["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert state.params["down"]["kernel"].sharding.spec == P(("fsdp", "tensor"), None)
    assert strategy.distribute_batch(batch()).value["x"].sharding.spec == P(
        ("replica", "fsdp"), "tensor"
    )


# ------------------------------------------------------------- across processes
def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTRAIN_")}
    env.pop("TF_CONFIG", None)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _one_process(tmp_path, name, *args):
    out = tmp_path / name
    out.mkdir()
    env = {**_env(), "XLA_FLAGS": xla_flags(8)}
    cmd = [sys.executable, SCRIPT, "--out", str(out), "--backup", str(out / "backup"), *args]
    [(code, log, _)] = run_together([(cmd, env)], 150)
    assert code == 0, log
    return dict(np.load(out / "result_0.npz"))


def _two_processes(tmp_path, name, *args, restarts=0):
    out = tmp_path / name
    out.mkdir()
    cmd = [sys.executable, "-m", "distrain._src.cluster.launch", "--nproc", "2"]
    cmd += ["--devices-per-proc", "4", "--timeout", "30", "--grace-period", "1"]
    cmd += ["--max-restarts", str(restarts), "--"]
    cmd += [sys.executable, SCRIPT, "--out", str(out), "--backup", str(out / "backup"), *args]
    [(code, log, _)] = run_together([(cmd, _env())], 240)
    assert code == 0, log
    return [dict(np.load(out / f"result_{pid}.npz")) for pid in (0, 1)], log, out / "backup"


@pytest.fixture(scope="module")
def mirrored_1x8(tmp_path_factory):
    return _one_process(tmp_path_factory.mktemp("ref"), "mirrored")


def _assert_params_equal(got, want, exact=False):
    for name in ("w1", "b1", "w2", "b2"):
        if exact:
            np.testing.assert_array_equal(got[name], want[name])
        else:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-6)


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_one_replica_over_two_processes_equals_mirrored(tmp_path, mirrored_1x8):
    """devices_per_replica=8 on 2 processes x 4 devices: one replica across both; each
    process holds half of the state that one process of 8 devices holds."""
    whole = _one_process(tmp_path, "one_process", "--devices-per-replica", "8")
    results, _, _ = _two_processes(tmp_path, "spans", "--devices-per-replica", "8")
    assert str(whole["refused"]) == ""  # inside one process: 12 rows stay whole per replica
    for got in results:
        assert int(got["replicas"]) == 1
        _assert_params_equal(got, mirrored_1x8)
        assert int(got["state_bytes_here"]) <= 0.55 * int(whole["state_bytes_here"])
        assert "rows per replica (12 // 1 = 12) must be divisible by 8" in str(got["refused"])


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_a_checkpointed_2d_mesh_across_processes_restores_anywhere_and_resumes_exactly(
    tmp_path, devices, mirrored_1x8
):
    """{fsdp: 4, tensor: 2} over 2 processes x 4 devices: equals mirrored; its backup
    restores bit for bit on 1 process x 8 devices and on 1 device (data position too);
    a SIGKILL of one process and a restart by the launcher end with the same bits."""
    args = ["--devices-per-replica", json.dumps(MESH_42), "--layout", json.dumps(RULES_42)]
    results, _, backup = _two_processes(tmp_path, "mesh", *args)
    for got in results:
        assert int(got["replicas"]) == 1
        _assert_params_equal(got, mirrored_1x8)
    final = results[0]
    restored = [
        _restore(backup, dt.MirroredStrategy()),
        _restore(backup, dt.OneDeviceStrategy(devices[0])),
    ]
    for r in restored:
        assert r.step == 8
        _assert_params_equal(
            {k: np.asarray(v) for k, v in r.state.params.items()}, final, exact=True
        )
    assert restored[0].data_state == restored[1].data_state  # the data position, too

    killed, log, _ = _two_processes(tmp_path, "killed", *args, "--kill-at", "5", restarts=1)
    assert "[1] killing myself at step 5" in log
    assert "[launch] restarting all processes (1 of 1)" in log
    for got in killed:
        # Resumed from the newest committed backup (step 4's async write may be cut).
        assert 1 <= int(got["start"]) <= 4
        _assert_params_equal(got, final, exact=True)


def _restore(backup, strategy):
    sys.path.insert(0, str(Path(SCRIPT).parent))
    import mw_train

    with strategy.scope():
        target = strategy.put_replicated(mw_train.initial_state())
    with dt.checkpoint.CheckpointManager(backup) as mgr:
        return mgr.restore(target=target)


# ------------------------------------------------------------------ batch layout
CONTEXT = {"fsdp": 2, "context": 4}


def token_step(state, batch):
    """A toy sequence model: embeddings averaged over positions, one dense layer."""

    def loss_fn(p):
        h = p["embed"][batch["tokens"]]  # [B, T, D]: split over T by the batch layout
        err = h.mean(1) @ p["out"] - batch["y"]
        return dt.compute_average_loss((err**2).mean(-1))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def token_data():
    r = np.random.default_rng(1)
    return {
        "tokens": r.integers(0, 32, (64, 16)).astype(np.int32),
        "y": r.normal(size=(64, 4)).astype(np.float32),
    }


def token_state():
    r = np.random.default_rng(2)
    params = {
        "embed": (r.normal(size=(32, 8)) * 0.3).astype(np.float32),
        "out": (r.normal(size=(8, 4)) * 0.3).astype(np.float32),
    }
    return dt.TrainState.create(params=params, tx=optax.adam(1e-2))


def test_a_batch_layout_splits_the_sequence_over_context(devices):
    strategy = dt.MirroredStrategy(
        devices_per_replica=CONTEXT, batch_layout={"tokens": P(None, "context")}
    )
    placed = strategy.distribute_batch(token_data())
    assert placed.value["tokens"].sharding.spec == P(("replica", "fsdp"), "context")
    assert placed.value["tokens"].addressable_shards[0].data.shape == (32, 4)  # 64 / 2, 16 / 4
    assert placed.value["y"].sharding.spec == P(("replica", "fsdp", "context"))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), token_data())
    assert strategy.distribute_batch(abstract).value["tokens"].sharding.spec == P(
        ("replica", "fsdp"), "context"
    )
    results = {}
    for name, s in (("mirrored", dt.MirroredStrategy()), ("context", strategy)):
        for mode in ("host", "device"):  # streamed from the host; gathered in the step
            pipe = dt.data.ArrayPipeline(token_data(), global_batch_size=16, seed=0)
            trainer = dt.Trainer(s, token_step, input_mode=mode)
            state, _ = trainer.fit(token_state(), pipe, epochs=1)
            results[name, mode] = jax.device_get(state.params)
            if mode == "device":  # whole on every device: a row gather needs no all-gather
                placed = jax.tree.leaves(trainer._input.resident.arrays)
                assert all(x.sharding.is_fully_replicated for x in placed)
    for mode in ("host", "device"):
        got, want = results["context", mode], results["mirrored", mode]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_batch_layout_speaks_the_layout_rules_dialect(devices):
    """One rule engine: tuples, (pattern, spec) pairs and logical names, as for state."""
    want = P(("replica", "fsdp"), "context")
    rules = {"embed": "fsdp", "sequence": "context"}

    def make(batch_layout, logical=rules):
        return dt.MirroredStrategy(
            devices_per_replica={"fsdp": 2, "context": 4},
            layout={"w": P("embed")},
            logical_axis_rules=logical,
            batch_layout=batch_layout,
        )

    state = {"w": np.zeros((4, 2), np.float32)}
    for strategy in (
        make({"tokens": (None, "context")}, {"embed": "fsdp"}),
        make([("tokens", P(None, "context"))], {"embed": "fsdp"}),
        make({"tokens": P(None, "sequence")}),
    ):
        batch = strategy.distribute_batch({"tokens": np.zeros((4, 8), np.int32)})
        assert batch.value["tokens"].sharding.spec == want
        assert strategy.put_replicated(state)["w"].sharding.spec == P("fsdp")
    # A logical name that neither the state's nor the batches' specs use is an error.
    with pytest.raises(ValueError, match=r"names \['sequence'\], which no layout spec uses"):
        make({"tokens": (None, "context")}).put_replicated(state)


def test_batch_layout_errors(devices):
    def make(layout, dpr=CONTEXT):
        return dt.MirroredStrategy(devices_per_replica=dpr, batch_layout=layout)

    with pytest.raises(ValueError, match=r"`batch_layout` lays values out .* needs"):
        make({"tokens": P(None, "context")}, dpr=1)
    with pytest.raises(ValueError, match=r"first entry stands for the rows"):
        make({"tokens": P("context")})
    with pytest.raises(ValueError, match=r"names 'seq', which is neither an axis of the replica"):
        make({"tokens": P(None, "seq")})
    with pytest.raises(ValueError, match=r"must give a jax.sharding.PartitionSpec \(or a tuple\)"):
        make({"tokens": "context"})
    strategy = make({"tokens": P(None, "context")})
    odd = {"tokens": np.zeros((16, 6), np.int32)}
    with pytest.raises(
        ValueError,
        match=r"dimension 1 of the leaf 'tokens' \(shape \(16, 6\)\) over 4 .* multiple of 4",
    ):
        strategy.distribute_batch(odd)
    with pytest.raises(ValueError, match=r"leaf 'tokens' has shape \(16,\) .* does not exist"):
        strategy.distribute_batch({"tokens": np.zeros((16,), np.int32)})
    with pytest.raises(
        ValueError, match=r"entries \['tokens'\] match no leaf of the batch .*\['ids'\]"
    ):
        strategy.distribute_batch({"ids": np.zeros((16, 8), np.int32)})
