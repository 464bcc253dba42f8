"""``dt.experimental.DiLoCoStrategy``: islands on a mesh axis, the user's train_step.

Every figure is checked against the framework-free reference driver
(``islands/outer.py``, itself checked against torchft's and MaxText's numbers in
test_islands_outer.py), against MaxText's case directly, and against data parallelism
at H = 1.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import distrain as dt
from distrain._src.islands import outer
from distrain._src.islands.schedule import DiLoCoConfig
from tests.processes import run_together

NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)


def _params(rng: np.random.Generator) -> dict:
    return {
        "dense": {
            "kernel": jnp.asarray(rng.standard_normal((4, 8)).astype(np.float32)),
            "bias": jnp.zeros((8,)),
        },
        "out": {"kernel": jnp.asarray(rng.standard_normal((8, 2)).astype(np.float32) * 0.3)},
    }


def _loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
    return jnp.sum(jnp.square(h @ params["out"]["kernel"] - y), axis=-1)  # per example


def train_step(state, batch):
    def loss_fn(p):
        return dt.compute_average_loss(_loss(p, batch))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def _data(rng: np.random.Generator, steps: int, rows: int = 16) -> list:
    return [
        (
            rng.standard_normal((rows, 4)).astype(np.float32),
            rng.standard_normal((rows, 2)).astype(np.float32),
        )
        for _ in range(steps)
    ]


def _reference(config, params, tx, batches, islands):
    """The reference driver: each island's step is the mean-loss step on its rows."""

    def island_step(state, batch):
        grads = jax.grad(lambda p: jnp.mean(_loss(p, batch)))(state.params)
        return state.apply_gradients(grads=grads), None

    state = outer.init(config, dt.TrainState.create(params=params, tx=tx), islands=islands)
    step = jax.jit(lambda s, b: outer.diloco_step(config, s, island_step, b)[0])
    states = []
    for x, y in batches:
        split = jax.tree.map(lambda a: a.reshape(islands, -1, *a.shape[1:]), (x, y))
        state = step(state, split)
        states.append(state)
    return states


CASES = {
    "diloco": ({"sync_every": 3}, {}),
    "streaming": (
        {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5},
        {},
    ),
    "int8": ({"sync_every": 2, "outer_dtype": "int8"}, {}),
    "fsdp_inside": ({"sync_every": 3}, {"devices_per_replica": {"fsdp": 2}, "min_shard_bytes": 0}),
    "batch_layout": (
        {"sync_every": 3},
        {"devices_per_replica": {"context": 2}, "batch_layout": {r"^0$": P(None, "context")}},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_every_step_equals_the_reference_driver(devices, case):
    """2 islands of 8 devices: the global parameters, each island's parameters and inner
    optimizer state, and the counter after every step equal the reference driver's (the
    island's all-reduced gradient is the gradient of its rows' mean)."""
    diloco, extra = CASES[case]
    strategy = dt.experimental.DiLoCoStrategy(
        islands=2, outer_optimizer=NESTEROV, **diloco, **extra
    )
    config = DiLoCoConfig(outer_optimizer=NESTEROV, **diloco)
    rng = np.random.default_rng(0)
    params, tx = _params(rng), optax.adam(0.05)
    batches = _data(rng, 9)
    expected = _reference(config, params, tx, batches, islands=2)

    state = strategy.put_replicated(dt.TrainState.create(params=params, tx=tx))
    assert isinstance(state, dt.experimental.DiLoCoState)
    for i, batch in enumerate(batches):
        state, _ = strategy.run(train_step, args=(state, strategy.distribute_batch(batch)))
        want = expected[i]
        assert int(state.step) == int(want.step) == i + 1
        for got, ref in (
            (state.params, want.params),
            (state.inner.params, want.inner.params),
            (state.inner.opt_state, want.inner.opt_state),
        ):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"step {i + 1}")


def test_maxtext_diloco_case_through_the_strategy(devices):
    """MaxText's DiLoCoTest (see test_islands_outer.py) with the user's step as it would
    be written for MirroredStrategy: 2 islands of one replica, losses 1.0, 0.65, 0.4481,
    0.574244, and the global model after the sync at step 3 equal to both islands'."""
    strategy = dt.experimental.DiLoCoStrategy(
        islands=2,
        sync_every=3,
        outer_optimizer=optax.sgd(1.0, momentum=0.9, nesterov=True),
        devices=devices[:2],
    )
    params = {"kernel": jnp.array([[2.0], [1.0]]), "bias": jnp.ones((1,))}

    def step(state, batch):
        x, y = batch

        def loss_fn(p):
            return dt.compute_average_loss(jnp.square(x @ p["kernel"] + p["bias"] - y)[:, 0])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    x = np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], np.float32)  # island-major
    y = np.array([[1.0], [2.0], [2.0], [3.0]], np.float32)
    state = strategy.put_replicated(dt.TrainState.create(params=params, tx=optax.sgd(0.1)))
    losses, states = [], []
    for _ in range(4):
        state, loss = strategy.run(step, args=(state, strategy.distribute_batch((x, y))))
        losses.append(float(strategy.reduce("mean", loss)))
        states.append(state)
    np.testing.assert_allclose(losses, [1.0, 0.65, 0.4481, 0.574244], rtol=1e-6)
    for s in states[:2]:
        jax.tree.map(np.testing.assert_array_equal, s.params, params)
    np.testing.assert_allclose(states[2].params["kernel"], [[1.5345], [1.0494]], atol=1e-4)
    np.testing.assert_allclose(states[2].params["bias"], [0.5839], atol=1e-4)
    for island in range(2):
        jax.tree.map(
            lambda g, i, k=island: np.testing.assert_array_equal(g, i[k]),
            states[2].params,
            states[2].inner.params,
        )


def test_sync_every_1_with_sgd_equals_mirrored_data_parallel(devices):
    """H = 1, outer SGD 1.0 and an SGD inner optimizer is synchronous data parallelism:
    4 islands of 2 replicas against MirroredStrategy over the same 8 devices and batches,
    to float rounding (4 ulps of the parameters per step)."""
    rng = np.random.default_rng(1)
    params, tx = _params(rng), optax.sgd(0.1)
    batches = _data(rng, 6)
    diloco = dt.experimental.DiLoCoStrategy(islands=4, sync_every=1, outer_optimizer=optax.sgd(1.0))
    mirrored = dt.MirroredStrategy()
    d_state = diloco.put_replicated(dt.TrainState.create(params=params, tx=tx))
    m_state = mirrored.put_replicated(dt.TrainState.create(params=params, tx=tx))

    def mean_step(state, batch):  # the global batch's mean, over the islands' replicas
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(_loss(p, batch)))(state.params)
        ctx = dt.get_replica_context()
        grads = ctx.all_reduce("mean", grads)
        return state.apply_gradients(grads=grads, all_reduce=False), loss

    for batch in batches:
        d_state, _ = diloco.run(mean_step, args=(d_state, diloco.distribute_batch(batch)))
        m_state, _ = mirrored.run(mean_step, args=(m_state, mirrored.distribute_batch(batch)))
    for a, b in zip(jax.tree.leaves(d_state.params), jax.tree.leaves(m_state.params), strict=True):
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(a, b, rtol=0, atol=len(batches) * 4 * 2.0**-23 * scale)


def test_the_replica_context_inside_a_step_is_the_islands(devices):
    """Inside a step: the island's replica count, replica ids 0..3 in each island, and an
    all_reduce that stays in the island; outside, every replica of every island."""
    strategy = dt.experimental.DiLoCoStrategy(islands=2, sync_every=4, outer_optimizer=NESTEROV)
    assert (strategy.num_replicas_in_sync, strategy.replicas_per_island) == (8, 4)
    assert [strategy.island_of(r) for r in range(8)] == [0] * 4 + [1] * 4

    def step(x):
        ctx = dt.get_replica_context()
        return ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group, ctx.all_reduce("sum", x)

    rows = strategy.distribute_batch(np.arange(8, dtype=np.float32))
    n, ids, sums = strategy.run(step, args=(rows,))
    assert int(n) == 4
    assert [int(i) for i in strategy.experimental_local_results(ids)] == [0, 1, 2, 3] * 2
    assert [float(s[0]) for s in strategy.experimental_local_results(sums)] == [6.0] * 4 + [
        22.0
    ] * 4


def test_island_state_in_the_cross_replica_api(devices):
    """experimental_local_results of an island-varying leaf: one component per replica,
    its island's row; reduce and gather count every replica of every island; the global
    view is a TrainState with the global parameters; put_replicated of a placed
    DiLoCoState returns it unchanged (the Trainer calls it again)."""
    strategy = dt.experimental.DiLoCoStrategy(islands=2, sync_every=5, outer_optimizer=NESTEROV)
    rng = np.random.default_rng(2)
    state = strategy.put_replicated(dt.TrainState.create(params=_params(rng), tx=optax.sgd(0.1)))
    assert strategy.put_replicated(state) is state
    state, loss = strategy.run(
        train_step, args=(state, strategy.distribute_batch(_data(rng, 1)[0]))
    )
    bias = state.inner.params["dense"]["bias"]
    assert bias.shape == (2, 8) and bias.sharding.spec == P("island")
    local = strategy.experimental_local_results(bias)
    assert len(local) == 8
    for r, component in enumerate(local):
        np.testing.assert_array_equal(component, bias[r // 4])
    assert not np.array_equal(bias[0], bias[1])  # the islands trained apart
    np.testing.assert_allclose(strategy.reduce("mean", bias), jnp.mean(bias, 0), rtol=1e-6)
    assert strategy.gather(bias).shape == (64,)
    # The loss is each replica's share of its island's mean: summed over all replicas it
    # is the sum of the islands' means.
    assert strategy.reduce("sum", loss).shape == ()

    view = strategy.global_view(state)
    assert isinstance(view, dt.TrainState)
    jax.tree.map(np.testing.assert_array_equal, view.params, state.params)
    assert int(view.step) == 1


def test_layout_rules_lay_out_each_islands_state(devices):
    """devices_per_replica inside islands: an island's copy of a leaf is split over its
    replica's devices by the layout rules, the island axis first; the global parameters
    as MirroredStrategy keeps them."""
    strategy = dt.experimental.DiLoCoStrategy(
        islands=2,
        sync_every=2,
        outer_optimizer=NESTEROV,
        devices_per_replica={"fsdp": 2},
        layout={"dense/kernel": P(None, "fsdp")},
    )
    rng = np.random.default_rng(3)
    state = strategy.put_replicated(dt.TrainState.create(params=_params(rng), tx=optax.sgd(0.1)))
    assert state.inner.params["dense"]["kernel"].sharding.spec == P("island", None, "fsdp")
    assert state.params["dense"]["kernel"].sharding.spec == P(None, "fsdp")
    state, _ = strategy.run(train_step, args=(state, strategy.distribute_batch(_data(rng, 1)[0])))
    assert state.inner.params["dense"]["kernel"].sharding.spec == P("island", None, "fsdp")


def test_a_restored_state_resumes_mid_round_exactly(devices, tmp_path):
    """Every counter is an array leaf: a DiLoCoState saved with orbax after step 3 of a
    round of 4 (fragment 0 in flight) and restored into a fresh template continues
    exactly as the run that was not interrupted."""
    strategy = dt.experimental.DiLoCoStrategy(
        islands=2,
        sync_every=4,
        outer_optimizer=NESTEROV,
        fragments=2,
        fragment_sync_delay=1,
    )
    rng = np.random.default_rng(4)
    params = _params(rng)
    batches = [strategy.distribute_batch(b) for b in _data(rng, 8)]

    def fresh():
        return strategy.put_replicated(dt.TrainState.create(params=params, tx=optax.adam(0.01)))

    straight = fresh()
    for b in batches:
        straight, _ = strategy.run(train_step, args=(straight, b))

    state = fresh()
    for b in batches[:3]:
        state, _ = strategy.run(train_step, args=(state, b))
    manager = dt.checkpoint.CheckpointManager(tmp_path)
    manager.save(3, state)
    manager.wait_until_finished()
    template = fresh()
    restored = manager.restore(3, target=template).state
    assert int(restored.step) == 3
    assert (
        restored.inner.params["dense"]["bias"].sharding
        == template.inner.params["dense"]["bias"].sharding
    )
    for b in batches[3:]:
        restored, _ = strategy.run(train_step, args=(restored, b))
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_inner_step_has_no_collective_across_islands(devices):
    """In the compiled step, every collective whose replica groups cross islands is in
    a branch of the outer step's conditional; the inner step's all-reduces stay inside
    an island."""
    from benchmarks.islands import collectives

    strategy = dt.experimental.DiLoCoStrategy(islands=2, sync_every=4, outer_optimizer=NESTEROV)
    rng = np.random.default_rng(5)
    state = strategy.put_replicated(dt.TrainState.create(params=_params(rng), tx=optax.sgd(0.1)))
    batch = strategy.distribute_batch(_data(rng, 1)[0])
    hlo = strategy.compile(train_step, (state, batch)).as_text()
    found = collectives(hlo, island_of=lambda d: d // 4)
    inner = [c for c in found if not c.in_branch]
    assert inner and all(not c.crosses for c in inner)
    # The outer step: one all-reduce of every leaf's difference at once (each replica's
    # share of it; then an all-gather inside the island).
    assert [c.op for c in found if c.crosses] == ["all-reduce"]


# --- wrong input -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"islands": 3}, ValueError, r"islands=3 must divide the 8 devices"),
        ({"islands": 0}, ValueError, r"islands must be an int >= 1"),
        ({"islands": 4, "devices_per_replica": 4}, ValueError, r"Each island has 2 devices"),
        ({"islands": 2, "devices_per_replica": {"island": 2}}, ValueError, r"'island'"),
        ({"islands": 2, "sync_every": 0}, ValueError, r"sync_every"),
        ({"islands": 2, "outer_optimizer": optax.sgd}, TypeError, r"call it"),
        ({"islands": 2, "fragments": 3, "sync_every": 4}, ValueError, r"divisible"),
        ({"islands": 2, "fragment_update_alpha": 1.5}, ValueError, r"\[0, 1\]"),
        ({"islands": 2, "fragment_sync_delay": 2, "sync_every": 2}, ValueError, r"delay"),
    ],
)
def test_constructor_errors(devices, kwargs, error, match):
    full = {"sync_every": 4, "outer_optimizer": NESTEROV, **kwargs}
    with pytest.raises(error, match=match):
        dt.experimental.DiLoCoStrategy(**full)


def test_run_errors(devices):
    strategy = dt.experimental.DiLoCoStrategy(islands=2, sync_every=4, outer_optimizer=NESTEROV)
    rng = np.random.default_rng(6)
    state = strategy.put_replicated(dt.TrainState.create(params=_params(rng), tx=optax.sgd(0.1)))
    batch = strategy.distribute_batch(_data(rng, 1)[0])

    def no_state(state, batch):
        return jnp.mean(_loss(state.params, batch))

    with pytest.raises(TypeError, match=r"global_view"):
        strategy.run(no_state, args=(state, batch))

    def not_reduced(state, batch):  # each replica applies its own gradient
        grads = jax.grad(lambda p: jnp.mean(_loss(p, batch)))(state.params)
        return state.apply_gradients(grads=grads, all_reduce=False)

    with pytest.raises(ValueError, match=r"differs across the replicas of one island"):
        strategy.run(not_reduced, args=(state, batch))

    with pytest.raises(ValueError, match=r"2 DiLoCoState arguments"):
        strategy.run(lambda a, b: (a, b), args=(state, state))

    with pytest.raises(TypeError, match=r"train state with `params`"):
        strategy.put_replicated({"w": jnp.ones(3)})

    with pytest.raises(TypeError, match=r"global_view takes the DiLoCoState"):
        strategy.global_view(strategy.global_view(state))


def test_repr_and_config(devices):
    strategy = dt.experimental.DiLoCoStrategy(islands=4, sync_every=8, outer_optimizer=NESTEROV)
    assert re.fullmatch(
        r"DiLoCoStrategy\(islands=4, sync_every=8, num_replicas_in_sync=8\)", repr(strategy)
    )
    assert strategy.config.sync_every == 8 and strategy.islands == 4
    assert strategy.mesh.axis_names == ("island", "replica")


# --- the Trainer ----------------------------------------------------------------------


def _trainer_step(state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: dt.compute_average_loss(_loss(p, (batch["x"], batch["y"])))
    )(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def _eval_step(state, batch):
    return {"loss": dt.compute_average_loss(_loss(state.params, (batch["x"], batch["y"])))}


@pytest.mark.parametrize("steps_per_execution", [1, 3])
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_trainer_fit_counts_every_batch_as_an_inner_step(devices, steps_per_execution):
    """Trainer.fit with fused dispatches runs one inner step per batch (the outer step
    after every H-th, inside the dispatch): the state after 12 batches equals 12
    strategy.run calls; evaluate and predict use the global parameters."""
    strategy = dt.experimental.DiLoCoStrategy(islands=2, sync_every=4, outer_optimizer=NESTEROV)
    rng = np.random.default_rng(7)
    params = _params(rng)
    data = _data(rng, 12)
    batches = [{"x": x, "y": y} for x, y in data]

    def fresh():
        return dt.TrainState.create(params=params, tx=optax.adam(0.01))

    manual = strategy.put_replicated(fresh())
    for b in batches:
        manual, _ = strategy.run(_trainer_step, args=(manual, strategy.distribute_batch(b)))

    trainer = dt.Trainer(
        strategy,
        _trainer_step,
        eval_step=_eval_step,
        steps_per_execution=steps_per_execution,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, _ = trainer.fit(fresh(), batches, epochs=1)
    assert not [w for w in caught if "replica" in str(w.message)]  # island-varying is fine
    assert isinstance(state, dt.experimental.DiLoCoState) and int(state.step) == 12
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(manual), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    logs = trainer.evaluate(state, batches[:2])
    expected = np.mean([float(np.mean(_loss(state.params, d))) for d in data[:2]])
    np.testing.assert_allclose(logs["loss"], expected, rtol=1e-5)
    trainer = dt.Trainer(
        strategy, _trainer_step, predict_step=lambda s, b: b["x"] @ s.params["dense"]["kernel"]
    )
    out = trainer.predict(state, batches[:1])
    # atol: an entry near zero differs by 3.5e-9 between XLA's and NumPy's float32
    # matmul on jaxlib 0.11.2 (1.2e-5 relative).
    np.testing.assert_allclose(
        out, data[0][0] @ np.asarray(state.params["dense"]["kernel"]), rtol=1e-5, atol=1e-6
    )


def test_trainer_fit_on_xla_cpu_keeps_one_step_in_flight(devices):
    """With two steps in flight XLA:CPU aborted the process in the islands' outer
    all-reduce under load ("Expected 4 threads to join the rendezvous, but only 3 of them
    arrived"), so on the CPU backend a step is dispatched once the one before it is done.
    Trainer.fit on 8 CPU devices, 4 islands, an outer step every 2 steps, 200 steps: each
    dispatch returns only after the step before it has finished (every step holds a
    device 5 ms in a host callback, so with two in flight the one before is still
    running), and the fit ends at step 200 with finite losses."""
    done: list[int] = []  # one entry per device per step: the step's 0-based index
    lock = threading.Lock()

    def hold(step):
        with lock:
            first = int(step) not in done
        if first:  # one device per step waits: the step ends when its last device does
            time.sleep(0.005)
        with lock:
            done.append(int(step))

    def slow_step(state, batch):
        jax.debug.callback(hold, state.step)
        return _trainer_step(state, batch)

    strategy = dt.experimental.DiLoCoStrategy(islands=4, sync_every=2, outer_optimizer=NESTEROV)
    finished_at_return: list[int] = []  # per training dispatch: steps done when it returned
    run = strategy.run

    def observed_run(fn, args=(), kwargs=None, **options):
        out = run(fn, args, kwargs, **options)
        if any(isinstance(x, dt.experimental.DiLoCoState) for x in args):
            with lock:
                counts = np.bincount(done, minlength=len(finished_at_return) + 1)
            finished_at_return.append(int(np.sum(counts == len(devices))))
        return out

    strategy.run = observed_run  # the real run, observed from outside
    rng = np.random.default_rng(9)
    batches = [{"x": x, "y": y} for x, y in _data(rng, 200)]
    trainer = dt.Trainer(strategy, slow_step, steps_per_execution=1)
    state, history = trainer.fit(
        dt.TrainState.create(params=_params(rng), tx=optax.adam(0.01)), batches, epochs=1
    )
    assert int(state.step) == 200 and len(finished_at_return) == 200
    # The k-th dispatch (0-based) returned with at least the k steps before it done.
    late = [k for k, n in enumerate(finished_at_return) if n < k]
    assert not late, f"{len(late)} of 200 dispatches returned before the step before them"
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.parametrize("outer_dtype", ["bfloat16", "int8", "int4"])
def test_quantized_outer_gradients_cross_islands_at_their_width(devices, outer_dtype):
    """The outer step's cross-island all-gathers carry the codec's bytes, per island:
    2 per value (bfloat16 travels as 16-bit words: XLA:CPU would widen a bfloat16
    all-gather to float32), 1 (int8) or half a byte per value rounded up per tensor
    (int4), plus one float32 scale per tensor for the integer codecs; each of the
    island's 2 replicas sends half of them (the hierarchical outer step)."""
    from benchmarks.islands import collectives

    strategy = dt.experimental.DiLoCoStrategy(
        islands=4, sync_every=2, outer_optimizer=NESTEROV, outer_dtype=outer_dtype
    )
    rng = np.random.default_rng(8)
    params = _params(rng)
    state = strategy.put_replicated(dt.TrainState.create(params=params, tx=optax.sgd(0.1)))
    batch = strategy.distribute_batch(_data(rng, 1)[0])
    found = collectives(strategy.compile(train_step, (state, batch)).as_text(), lambda d: d // 2)
    gathered = [c for c in found if c.crosses]
    assert len(gathered) == 1 and gathered[0].op == "all-gather" and gathered[0].in_branch
    sizes = [x.size for x in jax.tree.leaves(params)]
    per_island = {
        "bfloat16": sum(2 * n for n in sizes),
        "int8": sum(n + 4 for n in sizes),
        "int4": sum(-(-n // 2) + 4 for n in sizes),
    }[outer_dtype]
    assert sum(c.bytes for c in gathered) == 4 * -(-per_island // 2)


def test_benchmark_arms_and_their_merge_into_a_result_file(devices, tmp_path):
    """benchmarks/islands.py --arms: each arm's name builds its strategy; a result file
    that describes other runs (or none, without data-parallel runs) is refused before
    training; a merge keeps every field of the file and scores the arm against the
    file's data-parallel runs of the same seeds."""
    from benchmarks import islands as bench

    config = bench.strategy_of("diloco_h10_streaming", 4).config
    assert (config.sync_every, config.num_fragments, config.fragment_sync_delay) == (10, 2, 1)
    assert bench.strategy_of("diloco_h10_int4", 4).config.outer_dtype == "int4"
    with pytest.raises(SystemExit, match="unknown arm 'diloco_h10_fp8'"):
        bench.strategy_of("diloco_h10_fp8", 4)

    def run(final):
        return {"curve": [[600, final]], "final": final, "seconds": 1.0}

    shape = {"steps": 600, "islands": 4}
    path = tmp_path / "islands.json"
    with pytest.raises(SystemExit, match="no .* to merge into"):
        bench._check_mergeable(path, shape, 1, new_dp=False)
    kept = {**shape, "command": "full", "runs": {"data_parallel": [run(2.0), run(2.1)]}}
    path.write_text(json.dumps(kept))
    with pytest.raises(SystemExit, match=r"describes other runs .*'steps': \(600, 10\)"):
        bench._check_mergeable(path, {**shape, "steps": 10}, 1, new_dp=False)
    with pytest.raises(SystemExit, match="'data-parallel seeds': \\(2, 3\\)"):
        bench._check_mergeable(path, shape, 3, new_dp=False)
    bench._check_mergeable(path, shape, 1, new_dp=False)
    result = bench._merge(path, shape, {"diloco_h10_int8": [run(2.5)]}, "python -m ... --arms")
    assert json.loads(path.read_text()) == result and result["command"] == "full"
    assert result["runs"]["data_parallel"] == kept["runs"]["data_parallel"]
    assert result["loss_gap_int8_h10"] == pytest.approx(0.5)  # seed 0 against seed 0
    assert result["quality_target"] == pytest.approx(0.3)  # 3 x the spread 0.1 > 2 %
    assert result["within_target_int8_h10"] is False
    assert result["merged_commands"] == ["python -m ... --arms"]


# --- several processes ----------------------------------------------------------------


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_one_island_per_process_trains_as_one_process(tmp_path):
    """2 processes x 2 devices on 127.0.0.1, one island each, against 1 process x 4
    devices: the same losses, global parameters and islands' parameters (each process
    holds its own island's)."""
    from tests.test_multi_worker import clean_env, cluster, load

    script = str(pathlib.Path(__file__).parent / "scripts" / "diloco_mp.py")
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    [(code, log, _)] = run_together(
        [([sys.executable, script, "--out", str(ref_dir)], clean_env(4))], 120
    )
    assert code == 0, log
    ref = load(ref_dir)
    assert (int(ref["nproc"]), int(ref["replicas"]), int(ref["step"])) == (1, 4, 7)

    results = cluster([script, "--out", str(tmp_path)], nproc=2, devices=2)
    for code, log, _ in results:
        assert code == 0, log
    for pid in (0, 1):
        got = load(tmp_path, pid)
        assert (int(got["nproc"]), int(got["replicas"])) == (2, 4)
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
        np.testing.assert_allclose(got["global_kernel"], ref["global_kernel"], rtol=1e-5, atol=1e-6)
        mine = ref["island_kernels"][2 * pid : 2 * pid + 2]  # this process's two replicas
        np.testing.assert_allclose(got["island_kernels"], mine, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ref["island_kernels"][0], ref["island_kernels"][2])  # apart since step 6


def test_backup_and_restore_resumes_a_crashed_fit_mid_round(devices, tmp_path):
    """Trainer.fit with BackupAndRestore every 2 steps crashes after step 7 (the backup
    of step 6 is mid-round: H = 4); the next fit resumes from it and ends where an
    uninterrupted fit ends, bit for bit."""
    strategy = dt.experimental.DiLoCoStrategy(islands=2, sync_every=4, outer_optimizer=NESTEROV)
    rng = np.random.default_rng(9)
    params = _params(rng)
    batches = [{"x": x, "y": y} for x, y in _data(rng, 10)]

    def fresh():
        return dt.TrainState.create(params=params, tx=optax.adam(0.01))

    straight, _ = dt.Trainer(strategy, _trainer_step).fit(fresh(), batches, epochs=1)

    def crash(info):
        if info.step >= 7:
            raise RuntimeError("simulated crash")

    backup = dt.callbacks.BackupAndRestore(tmp_path / "bk", save_freq=2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        dt.Trainer(strategy, _trainer_step).fit(
            fresh(),
            batches,
            epochs=1,
            callbacks=[backup, dt.callbacks.LambdaCallback(on_train_batch_end=crash)],
        )
    trainer = dt.Trainer(strategy, _trainer_step)
    backup = dt.callbacks.BackupAndRestore(tmp_path / "bk", save_freq=2)
    resumed, _ = trainer.fit(fresh(), batches, epochs=1, callbacks=[backup])
    assert trainer.loop.initial_step == 6
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def test_memory_report_counts_the_global_copy_and_one_island_row(devices):
    """Per device: the global parameters and outer state whole, and of each island-
    varying leaf the one row of its island."""
    strategy = dt.experimental.DiLoCoStrategy(
        islands=2, sync_every=4, outer_optimizer=optax.sgd(0.7, momentum=0.9)
    )
    params = _params(np.random.default_rng(10))
    state = strategy.put_replicated(dt.TrainState.create(params=params, tx=optax.adam(0.01)))
    p = sum(x.nbytes for x in jax.tree.leaves(params))
    per_device = strategy.memory_report(state)["bytes_per_device"]
    # The global params and the outer momentum; the island's params and Adam's two
    # moments; three int32 counters (the inner steps, the island's step, Adam's count).
    assert per_device == 2 * p + 3 * p + 3 * 4


# --- YAML configs and distrain plan ---------------------------------------------------

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
DILOCO = [
    "strategy.name=diloco",
    "strategy.islands.islands=4",
    "strategy.islands.sync_every=10",
]


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_a_config_names_islands_and_plan_counts_the_global_copy(devices):
    """strategy.name: diloco builds the strategy the config describes (DiLoCo's outer
    optimizer by default); distrain plan's state per device is mirrored's plus the
    global parameters and the outer momentum."""
    from distrain._src.train.plan import plan_config
    from distrain._src.train.strategy_from_config import build_strategy

    cfg = dt.config.load_config(QUICKSTART, [*DILOCO, "strategy.islands.fragments=2"])
    strategy = build_strategy(cfg.strategy)
    assert isinstance(strategy, dt.experimental.DiLoCoStrategy)
    assert (strategy.islands, strategy.config.sync_every, strategy.config.num_fragments) == (
        4,
        10,
        2,
    )

    from distrain._src.train.plan import abstract_state

    diloco = plan_config(cfg)
    mirrored = plan_config(dt.config.load_config(QUICKSTART))
    p = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_state(cfg).state.params))
    # Beside an island's state (mirrored's): the global copy, the outer momentum (one per
    # fragment, each over its own leaves) and the inner-step counter.
    extra = diloco["state_bytes_per_device"] - mirrored["state_bytes_per_device"]
    assert extra == 2 * p + 4


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["strategy.name=diloco"], r"strategy.name=diloco needs strategy.islands"),
        (
            ["strategy.islands.islands=2", "strategy.islands.sync_every=2"],
            r"applies to strategy.name=diloco only",
        ),
        ([*DILOCO, "strategy.shard_state=true"], r"shard_state does not apply"),
        ([*DILOCO, "strategy.islands.fragment_update_alpha=2.0"], r"fragment_update_alpha"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(dt.config.ConfigError, match=match):
        dt.config.load_config(QUICKSTART, overrides)


def test_an_unknown_outer_optimizer_names_its_config_field(devices):
    from distrain._src.train.strategy_from_config import build_strategy

    cfg = dt.config.load_config(
        QUICKSTART, [*DILOCO, "strategy.islands.outer_optimizer.name=nesterov_sgd"]
    )
    with pytest.raises(dt.config.ConfigError, match=r"'strategy.islands.outer_optimizer.name'"):
        build_strategy(cfg.strategy)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_mixed_precision_inside_islands(devices, policy):
    """Under a mixed-precision policy the parameters stay float32 (the global copy and
    the islands'), the loss scale of mixed_float16 is island state (one per island, a
    row each), and the step is the reference driver's with the same policy."""
    strategy = dt.experimental.DiLoCoStrategy(islands=2, sync_every=2, outer_optimizer=NESTEROV)
    config = DiLoCoConfig(sync_every=2, outer_optimizer=NESTEROV)
    rng = np.random.default_rng(11)
    params, tx = _params(rng), optax.adam(0.01)
    batches = _data(rng, 4)

    def step(state, batch):
        loss, grads = state.value_and_grad(lambda p: dt.compute_average_loss(_loss(p, batch)))(
            state.params
        )
        return state.apply_gradients(grads=grads), loss

    def island_step(state, batch):
        grads = state.value_and_grad(lambda p: jnp.mean(_loss(p, batch)))(state.params)[1]
        return state.apply_gradients(grads=grads), None

    state = strategy.put_replicated(dt.TrainState.create(params=params, tx=tx, policy=policy))
    ref = outer.init(config, dt.TrainState.create(params=params, tx=tx, policy=policy), islands=2)
    ref_step = jax.jit(lambda s, b: outer.diloco_step(config, s, island_step, b)[0])
    for x, y in batches:
        state, _ = strategy.run(step, args=(state, strategy.distribute_batch((x, y))))
        ref = ref_step(ref, (x.reshape(2, 8, -1), y.reshape(2, 8, -1)))
    assert {x.dtype for x in jax.tree.leaves((state.params, state.inner.params))} == {
        np.dtype("float32")
    }
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)


def test_values_from_function_number_replicas_across_islands(devices):
    """experimental_distribute_values_from_function: replica ids 0..7 across islands,
    island by island, and each replica's island id."""
    strategy = dt.experimental.DiLoCoStrategy(islands=4, sync_every=2, outer_optimizer=NESTEROV)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array(
            [ctx.replica_id_in_sync_group, ctx.island_id, ctx.num_replicas_in_sync]
        )
    )
    got = [tuple(int(v) for v in x) for x in strategy.experimental_local_results(values)]
    assert got == [(r, r // 2, 8) for r in range(8)]


def test_config_errors_name_the_config_fields(devices):
    """Issue 51: on a 1-device machine the DiLoCo config command said `islands=4 must
    divide the 1 devices ... or pass `devices`` (the Python argument), and a missing
    sync_every said `... is required: None.`"""
    from distrain._src.train.strategy_from_config import build_strategy

    with pytest.raises(dt.config.ConfigError) as missing:
        dt.config.load_config(QUICKSTART, DILOCO[:2])
    assert str(missing.value).endswith(
        "Config field 'strategy.islands.sync_every' is required: H, the inner steps between "
        "outer steps, e.g. 50."
    )
    with pytest.raises(dt.config.ConfigError) as shape:  # a required field with no text
        dt.config.load_config(QUICKSTART, ["data.abstract={x: {dtype: float32}}"])
    assert str(shape.value).endswith("is required (it has no default).")
    cfg = dt.config.load_config(QUICKSTART, [*DILOCO, "strategy.devices=[cpu:0, cpu:1, cpu:2]"])
    with pytest.raises(
        dt.config.ConfigError,
        match=r"^Config field 'strategy.islands.islands' \(4\) must divide the 3 devices \(equal "
        r"islands\). Use one of \[1, 3\], choose the devices with strategy.devices=\[...\], or "
        r"on a CPU start more \(virtual\) devices, as docs/islands.md does: "
        r"XLA_FLAGS=--xla_force_host_platform_device_count=8 distrain train ...$",
    ):
        build_strategy(cfg.strategy)
