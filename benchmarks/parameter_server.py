"""What parameter-server training costs: host callbacks, and throughput vs MirroredStrategy.

Measures, on ``--devices`` virtual CPU devices (default 8, as the other benchmarks):

1. **One host callback's round trip**: a jitted function that calls an ordered
   ``jax.experimental.io_callback`` (one float in, one float out) minus the same
   function without it; and the same with a params-sized result (the MNIST MLP,
   1.07 MB, host -> device), which is what a worker's pull costs.
2. **Training throughput** on the suite's MLP (784-256-256-10, Adam 1e-3, random
   MNIST-shaped data, ``--batch`` examples per worker step / per replica):

   * ``mirrored``: ``dt.MirroredStrategy`` on all devices, global batch
     ``devices * batch`` (one synchronous step = ``devices`` worker steps' worth);
   * ``ps_async``: ``ParameterServerStrategy`` in-process, one worker per device,
     ``max_staleness=None``, 2 parameter servers (FixedShardsPartitioner(2));
   * ``ps_sync``: the same with ``max_staleness=0`` (rounds of ``devices`` steps);
   * ``ps_one_worker`` and ``jit_one_device``: one worker against a plain jitted
     step on one device: the per-step cost of pull + push + server update.

   Reported as examples/s (comparable across rows) and steps/s. Runs alternate
   between configurations, ``--repeats`` times, and medians are reported.

Usage:
  python -m benchmarks.parameter_server [--devices 8] [--steps 400] [--repeats 3]
      [--batch 64] [--quick] [--json PATH]

Prints a table and writes JSON (``--json``, default
benchmarks/results/parameter_server.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # the device count must be set before JAX starts
    _n = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), None)
    if _n is None and "--devices" in sys.argv:
        _n = sys.argv[sys.argv.index("--devices") + 1]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (
            f"{_flags} --xla_force_host_platform_device_count={_n or 8}".strip()
        )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import io_callback  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distrain as dt  # noqa: E402
from benchmarks.workloads import WORKLOADS, synthetic_data  # noqa: E402
from distrain.experimental import ParameterServerStrategy  # noqa: E402
from distrain.experimental.coordinator import ClusterCoordinator  # noqa: E402
from distrain.experimental.partitioners import FixedShardsPartitioner  # noqa: E402

MLP = WORKLOADS["mlp"]
TX = optax.adam(1e-3)


def _median_us(fn: Any, calls: int, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def callback_round_trip(device: jax.Device, calls: int = 300) -> dict[str, float]:
    """Microseconds per call: plain jit, + one io_callback, + a params-sized pull."""
    x = jax.device_put(np.ones((), np.float32), device)
    params = jax.tree.leaves(MLP.init(jax.random.key(0)))
    host = [np.asarray(p) for p in params]
    specs = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in host]

    plain = jax.jit(lambda x: x + 1)
    one = jax.jit(
        lambda x: (
            io_callback(lambda v: v, jax.ShapeDtypeStruct((), jnp.float32), x, ordered=True) + 1
        )
    )
    pull = jax.jit(
        lambda x: sum(jnp.sum(a) for a in io_callback(lambda v: host, specs, x, ordered=True)) + x
    )
    for f in (plain, one, pull):
        jax.block_until_ready(f(x))
    t_plain = _median_us(lambda: plain(x), calls)
    t_one = _median_us(lambda: one(x), calls)
    t_pull = _median_us(lambda: pull(x), calls // 3)
    return {
        "plain_jit_us": round(t_plain, 1),
        "one_callback_us": round(t_one, 1),
        "callback_round_trip_us": round(t_one - t_plain, 1),
        "params_pull_us": round(t_pull - t_plain, 1),
        "params_mb": round(sum(a.nbytes for a in host) / 2**20, 2),
    }


def _loss(params: Any, batch: Any) -> jax.Array:
    x, y = batch
    return jnp.mean(MLP.per_example_loss(params, x, y))


def _step_fn(params: Any, batch: Any) -> tuple[Any, Any]:
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    return grads, {"loss": loss}


class Bench:
    """One timed configuration: ``setup`` compiles and warms up; ``time`` measures."""

    def setup(self) -> None: ...

    def time(self, steps: int) -> dict[str, float]:
        raise NotImplementedError

    def close(self) -> None: ...


class Mirrored(Bench):
    """``dt.MirroredStrategy``: ``steps / n`` synchronous steps of ``n * batch`` examples."""

    def __init__(self, devices: list, batch: int):
        self.n, self.batch = len(devices), batch
        self.strategy = dt.MirroredStrategy(devices=devices)
        data = synthetic_data(self.n * batch * 4)
        self.batches = [
            self.strategy.distribute_batch((data["x"][i::4], data["y"][i::4])) for i in range(4)
        ]

    def setup(self) -> None:
        with self.strategy.scope():
            self.state = self.strategy.put_replicated(
                dt.TrainState.create(params=MLP.init(jax.random.key(0)), tx=TX)
            )

        def step(state, batch):
            x, y = batch

            def loss_fn(params):
                return dt.compute_average_loss(MLP.per_example_loss(params, x, y))

            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), loss

        self.step = step
        self.time(8 * self.n)

    def time(self, steps: int) -> dict[str, float]:
        sync_steps = max(1, steps // self.n)
        t0 = time.perf_counter()
        with self.strategy.scope():
            for i in range(sync_steps):
                self.state, _ = self.strategy.run(
                    self.step, args=(self.state, self.batches[i % len(self.batches)])
                )
        jax.block_until_ready(self.state)
        dt_s = time.perf_counter() - t0
        return {
            "steps_per_s": sync_steps / dt_s,
            "examples_per_s": sync_steps * self.n * self.batch / dt_s,
        }


class ParameterServer(Bench):
    """``ParameterServerStrategy`` (in-process): ``steps`` worker steps of ``batch`` examples."""

    def __init__(self, batch: int, num_workers: int, max_staleness: int | None):
        self.batch = batch
        self.strategy = ParameterServerStrategy(
            num_workers=num_workers,
            num_ps=2,
            variable_partitioner=FixedShardsPartitioner(2),
            max_staleness=max_staleness,
        )
        data = synthetic_data(batch * 8)
        self.batches = [(data["x"][i::8], data["y"][i::8]) for i in range(8)]

    def setup(self) -> None:
        self.strategy.create_variables(MLP.init(jax.random.key(0)), TX)
        self.step = self.strategy.worker_step(_step_fn)
        self.coordinator = ClusterCoordinator(self.strategy)
        self.time(8 * self.strategy.num_workers)

    def time(self, steps: int) -> dict[str, float]:
        t0 = time.perf_counter()
        for i in range(steps):
            self.coordinator.schedule(self.step, args=(self.batches[i % len(self.batches)],))
        self.coordinator.join()
        dt_s = time.perf_counter() - t0
        return {"steps_per_s": steps / dt_s, "examples_per_s": steps * self.batch / dt_s}

    def close(self) -> None:
        self.strategy.shutdown()


class OneDevice(Bench):
    """A plain jitted step (grad + Adam) on one device, for the per-step PS overhead."""

    def __init__(self, device: jax.Device, batch: int):
        self.device, self.batch = device, batch
        data = synthetic_data(batch * 8)
        self.batches = [
            jax.device_put((data["x"][i::8], data["y"][i::8]), device) for i in range(8)
        ]

    def setup(self) -> None:
        params = jax.device_put(MLP.init(jax.random.key(0)), self.device)
        self.state = (params, TX.init(params))

        @jax.jit
        def update(state, batch):
            params, opt_state = state
            grads, _ = _step_fn(params, batch)
            updates, opt_state = TX.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self.update = update
        self.time(8)

    def time(self, steps: int) -> dict[str, float]:
        t0 = time.perf_counter()
        for i in range(steps):
            self.state = self.update(self.state, self.batches[i % 8])
            if i >= 2:  # at most two steps in flight, as every distrain loop
                jax.block_until_ready(self.state)
        jax.block_until_ready(self.state)
        dt_s = time.perf_counter() - t0
        return {"steps_per_s": steps / dt_s, "examples_per_s": steps * self.batch / dt_s}


def make_benches(devices: list, batch: int) -> dict[str, Bench]:
    return {
        "mirrored": Mirrored(devices, batch),
        "ps_async": ParameterServer(batch, len(devices), None),
        "ps_sync": ParameterServer(batch, len(devices), 0),
        "ps_one_worker": ParameterServer(batch, 1, None),
        "jit_one_device": OneDevice(devices[0], batch),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--steps", type=int, default=400, help="worker steps per timed run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="examples per worker step / replica")
    p.add_argument("--quick", action="store_true", help="100 steps, 2 repeats")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats = 100, 2
    devices = jax.devices()[: args.devices]
    if len(devices) != args.devices:
        raise SystemExit(f"expected {args.devices} devices, JAX has {len(jax.devices())}")
    result: dict[str, Any] = {
        "benchmark": "parameter_server",
        "setting": f"{len(devices)} virtual CPU devices, in-process backend, 2 servers",
        "model": f"MLP 784-256-256-10, Adam 1e-3, {args.batch} examples per worker step",
        "steps": args.steps,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "jax": jax.__version__,
    }
    result["callback"] = callback_round_trip(devices[0])
    benches = make_benches(devices, args.batch)
    for bench in benches.values():
        bench.setup()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in benches}
    names = list(benches)
    for r in range(args.repeats):  # rotated order: a slow spell hits every config alike
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(benches[name].time(args.steps))
    for bench in benches.values():
        bench.close()
    table = {
        name: {key: round(statistics.median(s[key] for s in samples), 1) for key in samples[0]}
        for name, samples in runs.items()
    }
    result["throughput"] = table
    result["all_runs"] = runs
    result["ps_async_vs_mirrored_examples"] = round(
        table["ps_async"]["examples_per_s"] / table["mirrored"]["examples_per_s"], 2
    )
    result["ps_step_overhead_ms"] = round(
        1e3 / table["ps_one_worker"]["steps_per_s"] - 1e3 / table["jit_one_device"]["steps_per_s"],
        2,
    )
    result["loadavg_end"] = os.getloadavg()

    print(f"host callbacks (us): {result['callback']}")
    print(f"{'config':<16}{'examples/s':>12}{'steps/s':>10}")
    for name, row in table.items():
        print(f"{name:<16}{row['examples_per_s']:>12.0f}{row['steps_per_s']:>10.1f}")
    print(f"ps_async / mirrored, examples/s: {result['ps_async_vs_mirrored_examples']}")
    print(f"pull + push + apply per worker step: {result['ps_step_overhead_ms']} ms")
    out = Path(args.json or Path(__file__).parent / "results" / "parameter_server.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "all_runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
