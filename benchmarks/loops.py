"""The timed JAX training loops: the hand-written floor and the distrain paths.

Each configuration is a :class:`Bench`: ``setup()`` builds and compiles it and runs a
few warm-up steps; ``time(steps)`` trains ``steps`` more steps from a drained device
queue and returns throughput plus host-side costs. State carries over between
repeats, so repeats of different configurations can be interleaved.

Configurations (the letters are those of ``docs/performance.md``):

* ``jax_shard_map`` (a): ``jax.jit(jax.shard_map(step, check_vma=False))`` with an
  explicit ``psum`` of the gradients, donated state, and at most two steps in flight
  (wait on step ``i-2``) - the floor for framework overhead;
* ``jax_shard_map_numpy`` (a'): the same loop fed the way a hand-written loop reads
  shuffled host data: ``x[perm[k*B:(k+1)*B]]`` and an asynchronous ``jax.device_put``
  two batches ahead - what any loop pays for a shuffled input, with no distrain code;
* ``jax_shard_map_spe`` (a"): (a) with ``SPE`` steps unrolled in each compiled call, as
  ``Trainer(steps_per_execution=SPE)`` does - what fewer dispatches give any loop;
* ``distrain_run`` (b): ``strategy.run(step, args=(state, batch), donate_argnums=(0,))``
  on pre-staged per-replica batches;
* ``distrain_run_pipeline`` (c): the same, fed by
  ``strategy.experimental_distribute_dataset(ArrayPipeline(..., shuffle=True))``;
* ``distrain_fit`` (d): ``Trainer.fit`` on pre-staged batches;
* ``distrain_fit_spe`` (d'): ``Trainer(steps_per_execution=SPE)``;
* ``distrain_fit_pipeline``: ``Trainer.fit`` on a shuffled ``ArrayPipeline``.

Measured per repeat: ``steps_per_sec``; ``host_us_per_step`` (CPU time of the
dispatching thread per step: Python, tracing-cache lookups, dispatch); ``gap_us``
(median time from one dispatch returning to the next starting, not counting the
wait for step ``i-2``: what the loop itself adds between steps).
"""

from __future__ import annotations

import collections
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.workloads import LEARNING_RATE, Workload, host_batches, synthetic_data

NUM_STAGED = 8  # distinct pre-staged batches cycled through
PIPELINE_BATCHES = 32  # rows in the shuffled pipeline: 32 global batches
SPE = 8  # steps_per_execution of ``distrain_fit_spe``
WARMUP_STEPS = 6

Sample = dict[str, float | None]


class Bench:
    """One timed configuration."""

    def setup(self) -> None:
        raise NotImplementedError

    def time(self, steps: int) -> Sample:
        raise NotImplementedError

    def close(self) -> None:
        """Releases what ``setup`` started (nothing by default)."""


def _median_us(values: list[float]) -> float | None:
    return statistics.median(values) * 1e6 if values else None


class HandWritten(Bench):
    """(a) ``jit(shard_map(...))`` + explicit ``psum``: the floor for framework overhead.

    With ``numpy_feed``, (a'): batches gathered from shuffled host arrays every step;
    with ``steps_per_call=k``, (a"): k steps unrolled in one compiled call.
    """

    def __init__(
        self, workload: Workload, numpy_feed: bool = False, steps_per_call: int = 1
    ) -> None:
        self.w, self.numpy_feed, self.k = workload, numpy_feed, steps_per_call

    def setup(self) -> None:
        w, b = self.w, self.w.global_batch_size
        tx = optax.adam(LEARNING_RATE)
        mesh = Mesh(np.array(jax.devices()), ("d",))

        def one_step(params, opt_state, x, y):  # per replica: local rows of x, y
            def loss_fn(p):
                return w.per_example_loss(p, x, y).sum() / b

            loss, grads = jax.value_and_grad(loss_fn)(params)
            grads = jax.lax.psum(grads, "d")
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        def step(params, opt_state, *xys):  # k (x, y) pairs, unrolled
            for x, y in zip(xys[::2], xys[1::2], strict=True):
                params, opt_state, loss = one_step(params, opt_state, x, y)
            return params, opt_state, loss[None]

        self.fn = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(P(), P(), *[P("d")] * (2 * self.k)),
                out_specs=(P(), P(), P("d")),
                check_vma=False,
            ),
            donate_argnums=(0, 1),
        )
        rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
        params = jax.device_put(w.init(jax.random.key(0)), rep)
        self.state = (params, jax.device_put(tx.init(params), rep))
        if self.numpy_feed:
            self.batches: Iterator[Any] = _numpy_feed(w, split)
        else:
            staged = [
                jax.device_put((hb["x"], hb["y"]), split) for hb in host_batches(w, NUM_STAGED)
            ]
            self.batches = itertools.cycle(staged)
        self.time(WARMUP_STEPS)

    def time(self, steps: int) -> Sample:
        params, opt_state = self.state
        batches, fn, pc = self.batches, self.fn, time.perf_counter
        in_flight: collections.deque = collections.deque()
        calls_n = max(1, steps // self.k)
        waits, calls, rets = [0.0] * calls_n, [0.0] * calls_n, [0.0] * calls_n
        watch = Stopwatch()
        for i in range(calls_n):
            if len(in_flight) >= 2:  # bounded: wait on call i-2 (see field notes)
                tw = pc()
                in_flight.popleft().block_until_ready()
                waits[i] = pc() - tw
            xys = [a for _ in range(self.k) for a in next(batches)]
            calls[i] = pc()
            params, opt_state, loss = fn(params, opt_state, *xys)
            rets[i] = pc()
            in_flight.append(loss)
        jax.block_until_ready((params, opt_state))
        gaps = [calls[i + 1] - rets[i] - waits[i + 1] for i in range(calls_n - 1)]
        sample = watch.sample(calls_n * self.k, gaps)
        self.state = (params, opt_state)
        return sample


def _numpy_feed(w: Workload, sharding: NamedSharding) -> Iterator[Any]:
    """Shuffled batches from host arrays, put on the devices two batches ahead."""
    data = synthetic_data(w.global_batch_size * PIPELINE_BATCHES, seed=1)
    x, y, b = data["x"], data["y"], w.global_batch_size
    rng = np.random.default_rng(0)
    ahead: collections.deque = collections.deque()
    while True:
        perm = rng.permutation(len(y))
        for k in range(len(y) // b):
            idx = perm[k * b : (k + 1) * b]
            ahead.append(jax.device_put((x[idx], y[idx]), sharding))
            if len(ahead) > 2:
                yield ahead.popleft()


class Stopwatch:
    """Wall time, this thread's CPU time and the whole process's CPU time, from ``start``."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.thread = time.thread_time()
        self.process = time.process_time()

    def sample(self, steps: int, gaps: list[float] | None = None) -> Sample:
        wall = time.perf_counter() - self.wall
        return {
            "steps_per_sec": steps / wall,
            "host_us_per_step": (time.thread_time() - self.thread) / steps * 1e6,
            # All threads (XLA's compute threads included): less sensitive to what else
            # runs on the machine than wall time, but it counts spin-waiting too.
            "cpu_ms_per_step": (time.process_time() - self.process) / steps * 1e3,
            "gap_us": _median_us(gaps) if gaps else None,
        }


def _distrain_step(w: Workload) -> Callable[..., Any]:
    """The per-replica step of the custom loop: returns the replica's loss."""
    import distrain as dt

    def train_step(state, batch):
        def loss_fn(p):
            per_example = w.per_example_loss(p, batch["x"], batch["y"])
            return dt.compute_average_loss(per_example, global_batch_size=w.global_batch_size)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return train_step


def _trainer_step(w: Workload) -> Callable[..., Any]:
    """The per-replica step handed to ``Trainer``: returns ``(state, metrics)``."""
    import distrain as dt
    from distrain.metrics import Mean

    def train_step(state, batch):
        def loss_fn(p):
            per_example = w.per_example_loss(p, batch["x"], batch["y"])
            loss = dt.compute_average_loss(per_example, global_batch_size=w.global_batch_size)
            return loss, per_example

        grads, per_example = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), {"loss": Mean.from_values(per_example)}

    return train_step


def _initial_state(w: Workload) -> Any:
    import distrain as dt

    return dt.TrainState.create(params=w.init(jax.random.key(0)), tx=optax.adam(LEARNING_RATE))


def _pipeline(w: Workload) -> Any:
    from distrain.data import ArrayPipeline

    data = synthetic_data(w.global_batch_size * PIPELINE_BATCHES, seed=1)
    return ArrayPipeline(data, global_batch_size=w.global_batch_size, seed=0, shuffle=True)


class StrategyRun(Bench):
    """(b) ``strategy.run`` on pre-staged batches, or (c) fed by a distributed pipeline."""

    def __init__(self, workload: Workload, pipeline: bool) -> None:
        self.w, self.pipeline = workload, pipeline

    def setup(self) -> None:
        import distrain as dt

        self.strategy = dt.MirroredStrategy()
        self.step = _distrain_step(self.w)
        self.state = self.strategy.put_replicated(_initial_state(self.w))
        if self.pipeline:
            dist = self.strategy.experimental_distribute_dataset(_pipeline(self.w))
            self.batches: Iterator[Any] = iter(dist)
        else:
            staged = [self.strategy.distribute_batch(b) for b in host_batches(self.w, NUM_STAGED)]
            self.batches = itertools.cycle(staged)
        self.time(WARMUP_STEPS)

    def time(self, steps: int) -> Sample:
        state, run, step, batches = self.state, self.strategy.run, self.step, self.batches
        pc = time.perf_counter
        calls, rets = [0.0] * steps, [0.0] * steps
        watch = Stopwatch()
        for i in range(steps):
            batch = next(batches)
            calls[i] = pc()
            # run bounds the steps in flight itself; the old state is donated (updated in place)
            state, _ = run(step, args=(state, batch), donate_argnums=(0,))
            rets[i] = pc()
        jax.block_until_ready(state)
        gaps = [calls[i + 1] - rets[i] for i in range(steps - 1)]
        sample = watch.sample(steps, gaps)
        self.state = state
        return sample


class Forever:
    """An unsized, endless iterable of pre-staged batches (one ``fit`` epoch); the
    LM benchmarks use it too."""

    def __init__(self, batches: list[Any]) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[Any]:
        return itertools.cycle(self._batches)


class TrainerFit(Bench):
    """(d) ``Trainer.fit``, timed in steady state inside one ``fit`` call.

    The clock starts in ``on_train_batch_end`` once ``4 * steps_per_execution`` warm
    steps are done, after draining the device queue, and stops when ``fit`` has
    returned and the state is ready; ``fit``'s start-up (first-batch tracing of the
    metric shapes, iterator start) is reported apart as ``startup_ms``.
    """

    def __init__(
        self,
        workload: Workload,
        steps_per_execution: int | str,
        pipeline: bool,
        input_mode: str = "device",
    ) -> None:
        self.w, self.spe, self.pipeline = workload, steps_per_execution, pipeline
        self.k = SPE if steps_per_execution == "auto" else steps_per_execution
        self.input_mode = input_mode

    def setup(self) -> None:
        import distrain as dt
        from distrain import Trainer

        self.strategy = dt.MirroredStrategy()
        self.trainer = Trainer(
            self.strategy,
            _trainer_step(self.w),
            steps_per_execution=self.spe,
            input_mode=self.input_mode,
        )
        self.state = self.strategy.put_replicated(_initial_state(self.w))
        if self.pipeline:
            self.data: Any = _pipeline(self.w)
        else:
            staged = [
                self.strategy.distribute_batch(b).value for b in host_batches(self.w, NUM_STAGED)
            ]
            self.data = Forever(staged)
        self.time(WARMUP_STEPS)

    def time(self, steps: int) -> Sample:
        from distrain.callbacks import Callback

        warm = 4 * self.k
        steps = max(self.k, steps - steps % self.k)
        total = warm + steps
        pc = time.perf_counter
        clock: dict[str, Any] = {}

        class Clock(Callback):
            def on_train_batch_end(self, info: Any) -> None:
                if "first" not in clock:
                    clock["first"] = pc()
                if "watch" not in clock and info.step >= warm:
                    jax.block_until_ready(info.state)  # drain: no step is half-counted
                    clock.update(watch=Stopwatch(), step0=info.step)

        t_call = pc()
        kwargs = {"steps_per_epoch": total} if self.pipeline else {}
        state, _ = self.trainer.fit(
            self.state, self.data, steps=total, callbacks=[Clock()], **kwargs
        )
        jax.block_until_ready(state)
        sample = clock["watch"].sample(total - int(clock["step0"]))
        self.state = state
        sample["startup_ms"] = (clock["first"] - t_call) * 1e3
        return sample


def make_bench(config: str, workload: Workload) -> Bench:
    """The :class:`Bench` named ``config`` (see the module docstring)."""
    factories: dict[str, Callable[[], Bench]] = {
        "jax_shard_map": lambda: HandWritten(workload),
        "jax_shard_map_numpy": lambda: HandWritten(workload, numpy_feed=True),
        "jax_shard_map_spe": lambda: HandWritten(workload, steps_per_call=SPE),
        "distrain_run": lambda: StrategyRun(workload, pipeline=False),
        "distrain_run_pipeline": lambda: StrategyRun(workload, pipeline=True),
        "distrain_fit": lambda: TrainerFit(workload, 1, pipeline=False),
        "distrain_fit_spe": lambda: TrainerFit(workload, SPE, pipeline=False),
        "distrain_fit_pipeline": lambda: TrainerFit(workload, 1, pipeline=True),
        "distrain_fit_pipeline_host": lambda: TrainerFit(
            workload, 1, pipeline=True, input_mode="host"
        ),
        "distrain_fit_auto": lambda: TrainerFit(workload, "auto", pipeline=True),
    }
    if config not in factories:
        raise ValueError(f"Unknown JAX config {config!r}. Expected one of {sorted(factories)}.")
    return factories[config]()


JAX_CONFIGS = (
    "jax_shard_map",
    "jax_shard_map_numpy",
    "jax_shard_map_spe",
    "distrain_run",
    "distrain_run_pipeline",
    "distrain_fit",
    "distrain_fit_spe",
    "distrain_fit_pipeline",
    "distrain_fit_pipeline_host",
    "distrain_fit_auto",
)
