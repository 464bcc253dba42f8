"""Trainer: fit/evaluate/predict semantics, fused steps, host syncs and error paths."""

import collections
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distrain as dt
from distrain import DataEndedError, Trainer
from distrain.callbacks import LambdaCallback
from distrain.data import ArrayPipeline
from tests.linear_problem import DIM, apply_fn, eval_step, new_state, problem, train_step


def predict_step(state, batch):
    return apply_fn(state.params, batch["x"])


def pipeline(n=96, batch=32, **kw):
    return ArrayPipeline(problem(n), global_batch_size=batch, seed=0, **kw)


@pytest.fixture
def mirrored(devices):
    strategy = dt.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 8
    return strategy


def count_runs(strategy):
    calls = []
    run = strategy.run

    def counting(fn, args=(), kwargs=None, **options):
        calls.append(fn)
        return run(fn, args, kwargs, **options)

    strategy.run = counting
    return calls


def test_fit_learns_and_records_history(mirrored):
    trainer = Trainer(mirrored, train_step, eval_step)
    state, history = trainer.fit(new_state(), pipeline(), epochs=4, validation_data=pipeline())
    assert trainer.loop.global_step == 12 and int(state.step) == 12
    assert history.epoch == [0, 1, 2, 3]
    losses = history.history["loss"]
    assert losses[-1] < losses[0] / 4
    assert history.last("val_loss") == pytest.approx(trainer.evaluate(state, pipeline())["loss"])
    assert set(history.history) == {"loss", "val_loss"}
    with pytest.raises(KeyError, match="No metric named 'acc'"):
        history.last("acc")


def test_one_and_eight_replicas_give_the_same_parameters(mirrored, devices):
    one = Trainer(dt.OneDeviceStrategy(devices[0]), train_step)
    eight = Trainer(mirrored, train_step)
    s1, h1 = one.fit(new_state(), pipeline(), epochs=2)
    s8, h8 = eight.fit(new_state(), pipeline(), epochs=2)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s8.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h1.history["loss"], h8.history["loss"], rtol=1e-5)


def test_steps_per_execution_fuses_steps_and_matches(mirrored):
    """k=4 on 5-step epochs: one fused dispatch + one single step per epoch."""
    data = pipeline(n=160, batch=32)  # 5 steps per epoch
    plain = Trainer(mirrored, train_step)
    s1, h1 = plain.fit(new_state(), data, epochs=2)
    fused = Trainer(mirrored, train_step, steps_per_execution=4)
    calls = count_runs(mirrored)
    s4, h4 = fused.fit(new_state(), data, epochs=2)
    assert len(calls) == 4 and fused.loop.global_step == 10
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s4), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h1.history["loss"], h4.history["loss"], rtol=1e-5)


def test_host_syncs_only_when_logging(mirrored, monkeypatch):
    seen = []
    cb = LambdaCallback(on_train_batch_end=lambda info: seen.append((info.step, info.logs)))
    trainer = Trainer(mirrored, train_step, log_every=4, callbacks=[cb])
    gets, blocks, waits = [], [], []
    device_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: (gets.append(1), device_get(x))[1])
    monkeypatch.setattr(jax, "block_until_ready", lambda x: blocks.append(x) or x)

    class Queue(collections.deque):  # records what is still queued when the host waits
        def popleft(self):
            waits.append(len(self) - 1)
            return super().popleft()

    mirrored._compiler._in_flight = Queue()
    trainer.fit(new_state(), pipeline(n=384), steps=12)
    # Besides these reads the loop only waits to bound the dispatches in flight: on the
    # step before the newest, never on the step it just dispatched, and never on a state.
    assert blocks == [] and waits == [1] * 10
    assert [s for s, logs in seen if logs is not None] == [4, 8, 12]
    assert all(logs is None for s, logs in seen if s % 4)
    assert len(gets) == 3  # one read per log; the epoch end had nothing new to read
    assert seen[3][1]["loss"] > seen[11][1]["loss"]


def test_bad_train_step_outputs_say_what_was_expected(mirrored):
    data = pipeline()
    cases = [
        (lambda s, b: s, r"must return a tuple \(new_state, metrics\)"),
        (lambda s, b: (s, {}, 1), "tuple of length 3"),
        (
            lambda s, b: ({"loss": 1.0}, s),
            r"same pytree structure.*looks like \(metrics, new_state\)",
        ),
        (
            lambda s, b: (s.replace(step=s.step.astype(jnp.float32)), {}),
            r"leaf \.step changed from int32\[\] to float32\[\]",
        ),
        (lambda s, b: (s, {"err": b["y"]}), "must be a scalar or a dt.metrics object"),
        (lambda s, b: (s, [1.0]), "must return metrics as a dict"),
    ]
    for step, message in cases:
        with pytest.raises(TypeError, match=message):
            Trainer(mirrored, step).fit(new_state(), data, steps=1)


def test_bad_eval_and_predict_outputs(mirrored):
    trainer = Trainer(mirrored, train_step, lambda s, b: (s, {}), lambda s, b: jnp.sum(b["x"]))
    with pytest.raises(TypeError, match="must return a dict of metrics"):
        trainer.evaluate(new_state(), pipeline())
    with pytest.raises(TypeError, match="per-example outputs"):
        trainer.predict(new_state(), pipeline())


def test_data_that_ends_before_steps_names_both_numbers(mirrored):
    batches = [problem(32, seed=i) for i in range(4)]
    with pytest.raises(DataEndedError, match=r"ended after 4 steps, but fit asked for steps=10"):
        Trainer(mirrored, train_step).fit(new_state(), iter(batches), steps=10)
    # A re-iterable list is passed over again: 10 steps are 4 + 4 + 2.
    trainer = Trainer(mirrored, train_step)
    _, history = trainer.fit(new_state(), batches, steps=10)
    assert trainer.loop.global_step == 10 and history.epoch == [0, 1, 2]
    with pytest.raises(DataEndedError, match=r"2 epochs x 4 steps"):
        Trainer(mirrored, train_step).fit(new_state(), iter(batches), epochs=2, steps_per_epoch=4)


def test_epochs_and_steps_together_cap_the_run(mirrored):
    trainer = Trainer(mirrored, train_step)
    _, history = trainer.fit(new_state(), pipeline(), epochs=5, steps=7)
    assert trainer.loop.global_step == 7 and history.epoch == [0, 1, 2]


def test_any_pytree_state_gan_style(mirrored):
    """Two models and two optimizers in a dict; the step updates both."""

    def gan_step(state, batch):
        def g_loss(p):
            return dt.compute_average_loss((apply_fn(p, batch["x"]) - batch["y"]) ** 2)

        def d_loss(p):
            return dt.compute_average_loss(apply_fn(p, batch["x"]) ** 2)

        gen = state["gen"].apply_gradients(grads=jax.grad(g_loss)(state["gen"].params))
        disc = state["disc"].apply_gradients(grads=jax.grad(d_loss)(state["disc"].params))
        return {"gen": gen, "disc": disc}, {"g": g_loss(gen.params), "d": d_loss(disc.params)}

    state = {"gen": new_state(), "disc": new_state(0.01)}
    out, history = Trainer(mirrored, gan_step).fit(state, pipeline(), epochs=2)
    assert int(out["gen"].step) == 6 and int(out["disc"].step) == 6
    assert history.history["g"][1] < history.history["g"][0]


def test_predict_drops_padding_and_keeps_order(mirrored):
    data = problem(13)
    state = new_state()
    state = state.replace(params={"w": jnp.arange(DIM, dtype=jnp.float32), "b": jnp.ones(())})
    pipe = ArrayPipeline(
        data,
        global_batch_size=8,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        mask_key="mask",
    )
    out = Trainer(mirrored, train_step, predict_step=predict_step).predict(state, pipe)
    np.testing.assert_allclose(out, data["x"] @ np.arange(DIM) + 1.0, rtol=1e-6)


def test_missing_steps_and_empty_data_are_errors(mirrored):
    with pytest.raises(ValueError, match="needs a train_step"):
        Trainer(mirrored).fit(new_state(), pipeline())
    with pytest.raises(ValueError, match="needs an eval_step"):
        Trainer(mirrored, train_step).evaluate(new_state(), pipeline())
    with pytest.raises(ValueError, match="validation_data` needs an eval_step"):
        Trainer(mirrored, train_step).fit(new_state(), pipeline(), validation_data=pipeline())
    with pytest.raises(ValueError, match="needs a predict_step"):
        Trainer(mirrored, train_step).predict(new_state(), pipeline())
    with pytest.raises(ValueError, match="yielded no batches"):
        Trainer(mirrored, train_step, eval_step).evaluate(new_state(), [])
    with pytest.raises(TypeError, match=r"Received a dict of arrays: wrap it as"):
        Trainer(mirrored, train_step).fit(new_state(), problem(), epochs=1)
    other = dt.MirroredStrategy(jax.devices()[:2])
    with pytest.raises(ValueError, match="distributed with another strategy"):
        Trainer(mirrored, train_step).fit(
            new_state(), other.experimental_distribute_dataset(pipeline()), epochs=1
        )


def test_constructor_checks(mirrored):
    with pytest.raises(ValueError, match="steps_per_execution` must be a positive int"):
        Trainer(mirrored, train_step, steps_per_execution=0)
    with pytest.raises(ValueError, match="log_every"):
        Trainer(mirrored, train_step, log_every=-1)
    with pytest.raises(TypeError, match="must be a distrain strategy"):
        Trainer("mirrored", train_step)
    with pytest.raises(TypeError, match="must be a function"):
        Trainer(mirrored, "train_step")
    with pytest.raises(TypeError, match="dt.callbacks.Callback"):
        Trainer(mirrored, train_step, callbacks=[print])
    with pytest.raises(ValueError, match="`epochs` must be a positive int"):
        Trainer(mirrored, train_step).fit(new_state(), pipeline(), epochs=0)


def test_stop_training_from_a_callback(mirrored):
    def stop(info):
        if info.step == 2:
            trainer.stop_training = True

    trainer = Trainer(mirrored, train_step, callbacks=[LambdaCallback(on_train_batch_end=stop)])
    _, history = trainer.fit(new_state(), pipeline(), epochs=3)
    assert trainer.loop.global_step == 2 and history.epoch == [0]


def test_validation_freq(mirrored):
    trainer = Trainer(mirrored, train_step, eval_step)
    _, history = trainer.fit(
        new_state(), pipeline(), epochs=4, validation_data=pipeline(), validation_freq=2
    )
    val = history.history["val_loss"]
    assert np.isnan(val[0]) and np.isnan(val[2]) and not np.isnan(val[1]) and val[3] < val[1]


def test_state_that_differs_across_replicas_warns(mirrored):
    def local_step(state, batch):
        grads = jax.grad(lambda p: jnp.sum((apply_fn(p, batch["x"]) - batch["y"]) ** 2))(
            state.params
        )
        return state.apply_gradients(grads=grads, all_reduce=False), {}

    with pytest.warns(UserWarning, match="differ across replicas"):
        Trainer(mirrored, local_step).fit(new_state(), pipeline(), steps=2)


def test_ordinary_fit_emits_no_warning(mirrored):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(mirrored, train_step).fit(new_state(), pipeline(), steps=2)


def test_fit_donates_the_state_but_not_the_callers_arrays(mirrored):
    state = mirrored.put_replicated(new_state())
    trainer = Trainer(mirrored, train_step)
    final, _ = trainer.fit(state, pipeline(n=160, batch=32), steps=3)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # still usable
    snapshot = trainer.state_snapshot()
    trainer.fit(final, pipeline(n=160, batch=32), steps=2)
    assert not any(x.is_deleted() for x in jax.tree.leaves(snapshot))


def test_a_step_without_metrics_fits_and_evaluates_on_every_replica(mirrored):
    """No zero-size buffer crosses the replica program: jaxlib 0.11.2's XLA:CPU died
    (SIGSEGV) compiling a metric-less step whose accumulator was f32[replicas, 0]."""
    from distrain._src.train import _functions

    assert _functions.Layout({}).size == 1 and _functions.pack({}).shape == (1,)

    def no_metrics(state, batch):
        return train_step(state, batch)[0], {}

    trainer = Trainer(mirrored, no_metrics, lambda state, batch: {}, steps_per_execution=2)
    state, history = trainer.fit(new_state(), pipeline(), steps=4, validation_data=pipeline())
    assert int(state.step) == 4 and history.history == {}
    assert trainer.evaluate(state, pipeline()) == {}
