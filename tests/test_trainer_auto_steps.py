"""``Trainer(steps_per_execution="auto")``: fuse short steps, never past what callbacks need.

The choice depends on measured step time, so the integration tests assert the bounds
and the equivalence; the rule itself is tested on given timings.
"""

import jax
import numpy as np
import pytest

import distrain as dt
from distrain._src.train._steps import auto_steps_per_execution
from tests.linear_problem import new_state, problem, train_step


@pytest.fixture(scope="module")
def mirrored():
    strategy = dt.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 8
    return strategy


def data():
    return dt.data.ArrayPipeline(problem(256), global_batch_size=32, num_epochs=None)


class Every(dt.callbacks.Callback):
    def __init__(self, n):
        self.n, self.sizes = n, []

    @property
    def step_interval(self):
        return self.n

    def on_train_batch_end(self, info):
        self.sizes.append(info.num_steps)


@pytest.mark.parametrize(
    "seconds, cap, k",
    [
        (0.0001, 100, 64),  # 40 wanted -> next power of two
        (0.0001, 16, 16),  # capped by log_every / a callback
        (0.001, 100, 4),
        (0.003, 100, 2),
        (0.010, 100, 1),  # long steps: no fusion
        (0.0000001, 10**6, 64),  # never more than 64
        (0.0001, 12, 8),  # a cap that is no power of two: the power below
    ],
)
def test_the_choice_of_k(seconds, cap, k):
    assert auto_steps_per_execution(seconds, cap) == k


def test_fit_calibrates_within_the_callback_interval(mirrored):
    trainer = dt.Trainer(mirrored, train_step, steps_per_execution="auto")
    every = Every(4)
    state, _ = trainer.fit(new_state(), data(), steps=40, callbacks=[every])
    assert trainer.steps_per_execution in (1, 2, 4)
    assert every.sizes[:5] == [1] * 5  # the timed single steps
    assert max(every.sizes) == trainer.steps_per_execution
    assert int(state.step) == 40 == sum(every.sizes)


def test_auto_gives_the_same_parameters_as_single_steps(mirrored):
    fixed = dt.Trainer(mirrored, train_step).fit(new_state(), data(), steps=40)[0]
    auto = dt.Trainer(mirrored, train_step, steps_per_execution="auto", log_every=8)
    fused = auto.fit(new_state(), data(), steps=40)[0]
    assert auto.steps_per_execution in (1, 2, 4, 8)
    for a, b in zip(jax.tree.leaves(fixed.params), jax.tree.leaves(fused.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_bad_string_is_refused(mirrored):
    with pytest.raises(ValueError, match="positive int or 'auto'.*'fast'"):
        dt.Trainer(mirrored, train_step, steps_per_execution="fast")


def test_setting_steps_per_execution_after_construction_still_works(mirrored):
    """It was a plain attribute: code that sets it keeps working (fixed k, no auto)."""
    trainer = dt.Trainer(mirrored, train_step, steps_per_execution="auto")
    trainer.steps_per_execution = 4
    every = Every(1)
    trainer.fit(new_state(), data(), steps=8, callbacks=[every])
    assert every.sizes == [4, 4] and trainer.steps_per_execution == 4
    with pytest.raises(ValueError, match="`steps_per_execution` must be a positive int"):
        trainer.steps_per_execution = 0


def test_the_step_is_traced_for_its_metrics_then_once_per_step_of_each_program(mirrored):
    """The traces of the user's step, counted: one for the metrics' shapes (the metric
    accumulator is an input of the compiled program, so its layout comes first), then
    one per step that a compiled program holds (a k-step program is unrolled), and
    none for a program already compiled. The first dispatch of a k-step fit is a single
    step, so it compiles the one-step program too."""
    traces = []

    def counted(state, batch):
        traces.append(batch["x"].shape)
        return train_step(state, batch)

    state, _ = dt.Trainer(mirrored, counted, steps_per_execution=1).fit(
        new_state(), data(), steps=5
    )
    assert len(traces) == 2  # the metrics' shapes, the one-step program
    dt.Trainer(mirrored, counted, steps_per_execution=1).fit(state, data(), steps=5)
    assert len(traces) == 3  # a new fit's metrics' shapes; the program is compiled
    traces.clear()
    dt.Trainer(mirrored, counted, steps_per_execution=3).fit(state, data(), steps=7)
    assert len(traces) == 4  # the metrics' shapes and the 3-step program
    assert len(set(traces)) == 1  # every trace is of one replica's batch


def test_one_replica_over_several_devices_traces_each_program_twice(devices):
    """The second trace drops the collectives over the one replica (XLA rejects an
    all-reduce over a manual axis of size 1 beside auto axes): metrics' shapes, then
    two traces of the one-step program."""
    strategy = dt.MirroredStrategy(devices_per_replica=8, min_shard_bytes=0)
    assert strategy.num_replicas_in_sync == 1
    traces = []

    def counted(state, batch):
        traces.append(1)
        return train_step(state, batch)

    dt.Trainer(strategy, counted, steps_per_execution=1).fit(new_state(), data(), steps=3)
    assert len(traces) == 3
