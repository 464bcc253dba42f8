"""Re-iterating a dataset (the TF idiom `for epoch ...: for x in dist_dataset`) reshuffles
each pass, deterministically, and resumes exactly."""

import numpy as np
import pytest

import distrain as dt
from distrain.data import ArrayPipeline

N, B = 48, 16


def _pipe(**kw):
    kw = {
        "global_batch_size": B,
        "seed": 3,
        "num_epochs": 1,
        "process_index": 0,
        "process_count": 1,
        **kw,
    }
    return ArrayPipeline({"i": np.arange(N)}, **kw)


def _order(it):
    return np.concatenate([b["i"] for b in it])


def test_each_pass_over_a_one_epoch_pipeline_is_a_new_shuffle():
    pipe = _pipe()
    passes = [_order(iter(pipe)) for _ in range(3)]
    for p in passes:
        assert sorted(p) == list(range(N))
    assert not np.array_equal(passes[0], passes[1])
    assert not np.array_equal(passes[1], passes[2])
    # Deterministic: a new pipeline with the same seed repeats the same passes.
    again = _pipe()
    for p in passes:
        np.testing.assert_array_equal(_order(iter(again)), p)
    # Pass p of a 1-epoch pipeline is epoch p of a longer one.
    np.testing.assert_array_equal(_order(iter(_pipe(num_epochs=3))), np.concatenate(passes))


def test_no_reshuffle_when_asked_or_not_shuffling():
    for kw in ({"reshuffle_each_epoch": False}, {"shuffle": False}):
        pipe = _pipe(**kw)
        np.testing.assert_array_equal(_order(iter(pipe)), _order(iter(pipe)))


def test_distributed_dataset_reshuffles_per_pass(devices):
    strategy = dt.MirroredStrategy()
    dist = strategy.experimental_distribute_dataset(_pipe())
    orders = []
    for _epoch in range(2):
        orders.append(np.concatenate([np.asarray(strategy.gather(batch)["i"]) for batch in dist]))
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(N))
    assert not np.array_equal(orders[0], orders[1])


def test_resume_mid_second_pass_is_exact():
    pipe = _pipe()
    _order(iter(pipe))  # pass 0
    it = iter(pipe)  # pass 1
    next(it)
    state = it.get_state()
    assert state["pass"] == 1 and state["step"] == 1
    rest = _order(it)
    following = _order(iter(pipe))  # pass 2

    fresh = _pipe()  # a new process: nothing iterated yet
    it2 = iter(fresh)
    it2.set_state(state)
    np.testing.assert_array_equal(_order(it2), rest)
    # The pass after the restored one is pass 2, as in the original run.
    np.testing.assert_array_equal(_order(iter(fresh)), following)


def test_state_without_pass_means_pass_zero_and_bad_pass_is_refused():
    pipe = _pipe()
    first = _order(iter(pipe))
    it = iter(_pipe())
    it.set_state({"step": 0})
    np.testing.assert_array_equal(_order(it), first)
    with pytest.raises(ValueError, match=r"state\['pass'\] must be an int >= 0.*-1"):
        iter(pipe).set_state({"step": 0, "pass": -1})


def test_trainer_epochs_over_a_one_epoch_pipeline_see_new_orders(devices):
    import optax

    strategy = dt.MirroredStrategy()

    def step(state, batch):
        return state, {"first": batch["i"][0].astype(np.float32)}

    # One batch per epoch (global batch = N): the mean over replicas of each share's first
    # row changes when the order does.
    pipe = ArrayPipeline({"i": np.arange(N)}, global_batch_size=N, seed=3, num_epochs=1)
    state = dt.TrainState.create(params={"w": np.zeros(1, np.float32)}, tx=optax.sgd(0.1))
    _, history = dt.Trainer(strategy, step).fit(state, pipe, epochs=3)
    firsts = history.history["first"]
    assert len(firsts) == 3 and len(set(firsts)) == 3


class _StopAfterEpoch(dt.callbacks.Callback):
    """Simulates a crash at the end of an epoch (after BackupAndRestore saved it)."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt("simulated crash")


@pytest.mark.parametrize("crash_epoch", [0, 1])
def test_backup_resume_over_a_one_epoch_pipeline_is_exact(devices, tmp_path, crash_epoch):
    """Epochs over a reshuffling 1-epoch pipeline resume with the same later shuffles."""
    import jax

    from tests.linear_problem import new_state, problem, train_step

    strategy = dt.MirroredStrategy()

    def pipe():
        return ArrayPipeline(problem(96), global_batch_size=32, seed=5, num_epochs=1)

    ref, _ = dt.Trainer(strategy, train_step).fit(new_state(), pipe(), epochs=3)

    backup = str(tmp_path / f"backup{crash_epoch}")
    crashing = dt.Trainer(
        strategy,
        train_step,
        callbacks=[dt.callbacks.BackupAndRestore(backup), _StopAfterEpoch(crash_epoch)],
    )
    with pytest.raises(KeyboardInterrupt):
        crashing.fit(new_state(), pipe(), epochs=3)
    resumed = dt.Trainer(strategy, train_step, callbacks=[dt.callbacks.BackupAndRestore(backup)])
    got, _ = resumed.fit(new_state(), pipe(), epochs=3)  # a fresh pipeline: a new process
    assert resumed.loop.initial_epoch == crash_epoch + 1
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(got.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
