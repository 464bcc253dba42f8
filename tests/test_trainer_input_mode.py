"""Device-resident input: ArrayPipeline data placed once, batches gathered in the step.

The batches are the host pipeline's value for value, so training gives the same
parameters, checkpointed positions are interchangeable between the modes, and only
row ids cross to the devices per step.
"""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distrain as dt
from distrain._src.train import _input
from tests.linear_problem import new_state, problem, train_step


@pytest.fixture(scope="module")
def mirrored():
    strategy = dt.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 8
    return strategy


def masked_step(state, batch):
    def loss_fn(p):
        pred = batch["x"] @ p["w"] + p["b"]
        return dt.compute_average_loss((pred - batch["y"]) ** 2, mask=batch["mask"])

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {
        "loss": dt.metrics.Mean.from_values((batch["x"] @ state.params["w"]) ** 2, batch["mask"]),
        # Padded rows are zeros in both modes: a sum over all rows shows it.
        "x_sum": dt.metrics.Sum.from_values(jnp.sum(batch["x"], -1)),
    }


def pipe(**kw):
    args = dict(global_batch_size=32, seed=4, num_epochs=None)
    args.update(kw)
    return dt.data.ArrayPipeline(problem(100), **args)


@pytest.mark.parametrize(
    "kw, step",
    [
        ({}, train_step),
        ({"num_epochs": 2, "drop_remainder": False, "mask_key": "mask"}, masked_step),
    ],
    ids=["full_batches", "padded_last_batch"],
)
def test_device_mode_trains_exactly_like_host_mode(mirrored, kw, step):
    results = {}
    for mode in ("host", "device"):
        trainer = dt.Trainer(mirrored, step, input_mode=mode, steps_per_execution=2)
        state, history = trainer.fit(new_state(), pipe(**kw), epochs=2)
        assert trainer.input_mode == mode
        results[mode] = (state, history.history)
    # The same batches; XLA may fuse the gather into what reads it, so equal up to the
    # rounding of a different summation order.
    for a, b in zip(
        jax.tree.leaves(results["host"][0]), jax.tree.leaves(results["device"][0]), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    for key, values in results["host"][1].items():
        np.testing.assert_allclose(values, results["device"][1][key], rtol=1e-6)


def test_auto_chooses_device_for_small_data_and_host_otherwise(mirrored, monkeypatch):
    trainer = dt.Trainer(mirrored, train_step)
    trainer.fit(new_state(), pipe(), steps=2)
    assert trainer.input_mode == "device"
    monkeypatch.setattr(_input, "device_memory_bytes", lambda strategy: 1000)  # tiny devices
    trainer.fit(new_state(), pipe(), steps=2)
    assert trainer.input_mode == "host"
    trainer.fit(new_state(), [problem(32)], steps=1)  # not an ArrayPipeline
    assert trainer.input_mode == "host"


def test_only_row_ids_cross_per_step(mirrored, monkeypatch):
    trainer = dt.Trainer(mirrored, train_step, input_mode="device")
    seen = []
    original = mirrored.run

    def spy(fn, args=(), **kwargs):
        seen.extend(args[2:])  # (state, metric sums, *batches)
        return original(fn, args=args, **kwargs)

    monkeypatch.setattr(mirrored, "run", spy)
    trainer.fit(new_state(), pipe(), steps=3)
    assert len(seen) == 3
    for arrays, ids in seen:
        assert arrays is trainer._input.resident.arrays  # placed once, before the steps
        assert isinstance(ids, dt.PerReplica)
        leaves = jax.tree.leaves(ids.value)
        assert [x.dtype for x in leaves] == [np.int32] and leaves[0].shape == (32,)


def test_a_second_fit_on_device_input_compiles_nothing(mirrored):
    """The gathering step is one function per strategy, step and batch structure:
    strategy.run compiles per function object, so a wrapper made per fit recompiled
    the whole step every fit."""
    state = new_state()
    dt.Trainer(mirrored, train_step, input_mode="device").fit(state, pipe(), steps=2)
    programs = mirrored._compiler.num_programs
    trainer = dt.Trainer(mirrored, train_step, input_mode="device")
    trainer.fit(state, pipe(), steps=2)
    assert trainer.input_mode == "device" and mirrored._compiler.num_programs == programs


def test_a_strategy_used_for_device_input_is_freed_with_its_programs():
    """The cache of gathering steps holds its strategies weakly (a strong reference from
    a cached step kept every such strategy and its compiled programs alive)."""

    def train_once():
        s = dt.MirroredStrategy()
        dt.Trainer(s, train_step, input_mode="device").fit(new_state(), pipe(), steps=2)
        return weakref.ref(s)

    ref = train_once()
    gc.collect()
    assert ref() is None


def test_a_checkpoint_resumes_across_modes(mirrored, tmp_path):
    full, _ = dt.Trainer(mirrored, train_step, input_mode="host").fit(new_state(), pipe(), steps=8)
    backup = dt.callbacks.BackupAndRestore(tmp_path / "b", save_freq=4)

    class Stop(dt.callbacks.Callback):
        def on_train_batch_end(self, info):
            if info.step == 4:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dt.Trainer(mirrored, train_step, input_mode="host", callbacks=[backup, Stop()]).fit(
            new_state(), pipe(), steps=8
        )
    resumed, _ = dt.Trainer(mirrored, train_step, input_mode="device", callbacks=[backup]).fit(
        new_state(), pipe(), steps=8
    )
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_a_bad_mode_is_refused(mirrored):
    with pytest.raises(ValueError, match="`input_mode` must be one of.*'gpu'"):
        dt.Trainer(mirrored, train_step, input_mode="gpu")


def test_device_memory_has_a_cpu_fallback(mirrored):
    assert _input.device_memory_bytes(mirrored) > 2**20


def forgot_metrics(state, batch):
    return train_step(state, batch)[0]  # the state only


@pytest.mark.parametrize(
    "kw",
    [
        {"input_mode": "device"},
        {"input_mode": "host"},
        {"input_mode": "device", "steps_per_execution": 2},
        {"input_mode": "device", "grad_accum_steps": 2},
        {"input_mode": "host", "grad_accum_steps": 2},
    ],
    ids=["device", "host", "device_k2", "device_accum", "host_accum"],
)
def test_errors_name_the_users_step_not_a_wrapper(mirrored, kw):
    # The device-input gather and gradient accumulation wrap the step; an error about
    # what it returns names the user's function, as the docs promise.
    with pytest.raises(TypeError) as e:
        dt.Trainer(mirrored, forgot_metrics, **kw).fit(new_state(), pipe(), steps=2)
    assert str(e.value).startswith("`forgot_metrics` must return a tuple (new_state, metrics)")
