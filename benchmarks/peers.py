"""Peers: Keras 3 ``Model.fit`` on JAX (``DataParallel``) and on TensorFlow (``MirroredStrategy``).

Optional: each runs in its own worker process (``benchmarks/worker.py``) only when
``keras`` (and, for TensorFlow, ``tensorflow``) is installed. The models are the
layers of ``benchmarks/workloads.py`` built with Keras: same shapes, Glorot-uniform
kernels, Adam(1e-3), sparse softmax cross-entropy on logits, the same global batch.

Each is fed the input its guides use: Keras on JAX gets in-memory NumPy arrays
(shuffled every epoch); TensorFlow gets a ``tf.data`` pipeline over the same arrays
(shuffle, batch, repeat, prefetch). Keras 3 on TensorFlow with NumPy input under
``MirroredStrategy`` was measured at 35-80 s per 32-step epoch here, so it would be
no comparison at all.
Timing is steady state, inside one long ``fit`` call (see :class:`KerasFit`). Only
epoch-level callbacks are used, so Keras keeps its asynchronous per-step path.

Example (inside a worker whose environment already set ``KERAS_BACKEND``):
  >>> bench = KerasFit(WORKLOADS["mlp"], backend="jax", num_devices=8)
  >>> bench.setup(); bench.time(200)["steps_per_sec"]
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any

from benchmarks.loops import Bench, Sample, Stopwatch
from benchmarks.workloads import (
    IMAGE_SHAPE,
    LEARNING_RATE,
    NUM_CLASSES,
    Workload,
    max_pool_2x2,
    synthetic_data,
)

MAX_BATCHES_PER_EPOCH = 32
_TF_STRATEGIES: dict[int, Any] = {}


def _keras_model(keras: Any, name: str) -> Any:
    layers = keras.layers
    if keras.backend.backend() == "jax":
        # The max-pool of benchmarks/workloads.py (XLA:CPU's reduce_window gradient is
        # ~15x slower); TensorFlow keeps its native oneDNN MaxPooling2D.
        pool = layers.Lambda(max_pool_2x2, output_shape=_pooled_shape)
    else:
        pool = layers.MaxPooling2D(2)
    if name == "mlp":
        body = [
            layers.Flatten(),
            layers.Dense(256, activation="relu"),
            layers.Dense(256, activation="relu"),
        ]
    else:
        body = [
            layers.Conv2D(32, 3, activation="relu"),
            pool,
            layers.Conv2D(64, 3, activation="relu"),
            layers.Flatten(),
            layers.Dense(64, activation="relu"),
        ]
    return keras.Sequential([keras.Input(IMAGE_SHAPE), *body, layers.Dense(NUM_CLASSES)])


def _pooled_shape(shape: tuple[Any, ...]) -> tuple[Any, ...]:
    return (shape[0], shape[1] // 2, shape[2] // 2, shape[3])


class KerasFit(Bench):
    """Keras 3 ``Model.fit`` on ``backend`` ("jax" or "tensorflow") over ``num_devices``.

    One ``fit`` call runs for the life of the worker, on a background thread, and a
    callback holds it at every epoch start until :meth:`time` releases it. A repeat is
    then ``E`` epochs of ``M`` steps timed from ``on_epoch_begin`` to ``on_epoch_end``
    (where Keras has synchronised to compute the epoch's logs). Calling ``fit`` once
    per repeat instead would time Keras' and TensorFlow's per-call start-up and
    teardown (measured: 10 to 200 s per call for TensorFlow under MirroredStrategy on
    this machine), which a long training run pays only once.
    """

    def __init__(self, workload: Workload, backend: str, num_devices: int, steps: int) -> None:
        self.w, self.backend, self.n = workload, backend, num_devices
        # Epochs of about half a repeat, so a repeat is whole epochs.
        self.batches_per_epoch = min(MAX_BATCHES_PER_EPOCH, max(2, steps // 2))

    def setup(self) -> None:
        import keras

        if keras.backend.backend() != self.backend:
            raise RuntimeError(
                f"Keras runs on {keras.backend.backend()!r} but this bench needs "
                f"{self.backend!r}; set KERAS_BACKEND before keras is imported."
            )
        self.keras = keras
        with self._distribution_scope():
            self.model = _keras_model(keras, self.w.name)
            self.model.compile(
                optimizer=keras.optimizers.Adam(LEARNING_RATE),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        data = synthetic_data(self.w.global_batch_size * self.batches_per_epoch, seed=1)
        self._go: queue.Queue[bool] = queue.Queue()
        self._done: queue.Queue[Sample | BaseException] = queue.Queue()
        self._thread = threading.Thread(target=self._fit, args=(data,), daemon=True)
        self._thread.start()
        self._epoch(timeout=900)  # compiles and warms the data path

    def _input(self, data: dict[str, Any]) -> dict[str, Any]:
        m, b = self.batches_per_epoch, self.w.global_batch_size
        if self.backend == "jax":
            return {"x": data["x"], "y": data["y"], "batch_size": b, "shuffle": True}
        import tensorflow as tf

        ds = (
            tf.data.Dataset.from_tensor_slices((data["x"], data["y"]))
            .shuffle(len(data["y"]), seed=0, reshuffle_each_iteration=True)
            .batch(b, drop_remainder=True)
            .repeat()
            .prefetch(tf.data.AUTOTUNE)
        )
        return {"x": ds, "steps_per_epoch": m}

    def _fit(self, data: dict[str, Any]) -> None:
        m = self.batches_per_epoch
        go, done = self._go, self._done
        clock: dict[str, Any] = {}

        class Gate(self.keras.callbacks.Callback):
            def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
                if not go.get():
                    self.model.stop_training = True
                clock["watch"] = Stopwatch()

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                done.put(clock["watch"].sample(m))

        if self.backend == "jax":  # Keras keeps the distribution per thread
            self.keras.distribution.set_distribution(self._dist)
        try:
            self.model.fit(epochs=10**9, verbose=0, callbacks=[Gate()], **self._input(data))
        except BaseException as e:  # noqa: BLE001 - handed to the thread that asked
            done.put(e)

    def close(self) -> None:
        """Ends the parked ``fit`` (two live fits in one TensorFlow process conflict)."""
        self._go.put(False)
        self._thread.join(timeout=120)

    def _epoch(self, timeout: float) -> Sample:
        self._go.put(True)
        out = self._done.get(timeout=timeout)
        if isinstance(out, BaseException):
            raise RuntimeError(f"Keras fit failed: {out!r}") from out
        return out

    def _distribution_scope(self) -> Any:
        if self.backend == "jax":
            import jax

            devices = jax.devices()[: self.n]
            self._dist = self.keras.distribution.DataParallel(devices=devices)
            self.keras.distribution.set_distribution(self._dist)
            return contextlib.nullcontext()
        import tensorflow as tf

        # One strategy per process: a second MirroredStrategy reuses collective instance
        # keys of the first and its all-reduces fail with "Shape mismatch in the
        # collective instance" (seen with TensorFlow 2.21).
        if self.n not in _TF_STRATEGIES:
            devices = [f"/cpu:{i}" for i in range(self.n)]
            _TF_STRATEGIES[self.n] = tf.distribute.MirroredStrategy(devices=devices)
        return _TF_STRATEGIES[self.n].scope()

    def time(self, steps: int) -> Sample:
        epochs = [
            self._epoch(timeout=900) for _ in range(max(1, round(steps / self.batches_per_epoch)))
        ]
        # Steps-weighted means over the epochs (all epochs have the same number of steps).
        wall = sum(1 / e["steps_per_sec"] for e in epochs)
        return {
            "steps_per_sec": len(epochs) / wall,
            "host_us_per_step": sum(e["host_us_per_step"] for e in epochs) / len(epochs),
            "cpu_ms_per_step": sum(e["cpu_ms_per_step"] for e in epochs) / len(epochs),
            "gap_us": None,
            "startup_ms": None,
        }


def configure_tensorflow(num_devices: int) -> None:
    """Splits the host CPU into ``num_devices`` logical devices (before TF starts)."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)]
    )
