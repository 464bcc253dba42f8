"""The benchmark models, in plain JAX, and their synthetic MNIST-shaped data.

Every framework under test trains the same function: the same layers, the same
initialisation scheme, Adam(1e-3), softmax cross-entropy on integer labels, one
global batch per step. The models are plain pytrees of arrays so the hand-written
loop, ``strategy.run`` and ``Trainer.fit`` run byte-identical maths; the Keras and
TensorFlow runs build the same layers with Keras (``benchmarks/peers.py``).

* ``mlp``: 784-256-256-10 with ReLU (the Keras multi-GPU guide's model).
* ``cnn``: Conv32(3x3)-MaxPool(2)-Conv64(3x3)-Dense64-Dense10 (the seed overview's
  CNN), NHWC, VALID padding. The 2x2 max-pool is the maximum of four strided slices:
  the same values and parameter gradients as ``lax.reduce_window``, whose gradient
  (``select_and_scatter``) made half of XLA:CPU's training step
  (``python -m benchmarks.xla_cpu``; docs/performance.md). Keras on JAX gets the same
  form; TensorFlow keeps its native ``MaxPooling2D`` (its oneDNN kernel is fast).

Example:
  >>> w = WORKLOADS["mlp"]
  >>> params = w.init(jax.random.key(0))
  >>> losses = w.per_example_loss(params, x, y)   # [batch]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from examples.classification import max_pool_2x2

Params = dict[str, Any]
IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10
LEARNING_RATE = 1e-3


def _dense(key: jax.Array, n_in: int, n_out: int) -> dict[str, jax.Array]:
    # Glorot-uniform kernel and zero bias: Keras' Dense defaults, so all peers start alike.
    lim = np.sqrt(6.0 / (n_in + n_out))
    return {
        "w": jax.random.uniform(key, (n_in, n_out), jnp.float32, -lim, lim),
        "b": jnp.zeros((n_out,), jnp.float32),
    }


def _conv(key: jax.Array, c_in: int, c_out: int) -> dict[str, jax.Array]:
    fan_in, fan_out = 9 * c_in, 9 * c_out
    lim = np.sqrt(6.0 / (fan_in + fan_out))
    return {
        "w": jax.random.uniform(key, (3, 3, c_in, c_out), jnp.float32, -lim, lim),
        "b": jnp.zeros((c_out,), jnp.float32),
    }


def mlp_init(key: jax.Array) -> Params:
    k1, k2, k3 = jax.random.split(key, 3)
    return {"d1": _dense(k1, 784, 256), "d2": _dense(k2, 256, 256), "out": _dense(k3, 256, 10)}


def mlp_apply(params: Params, x: jax.Array) -> jax.Array:
    h = x.reshape(x.shape[0], -1)
    h = jax.nn.relu(h @ params["d1"]["w"] + params["d1"]["b"])
    h = jax.nn.relu(h @ params["d2"]["w"] + params["d2"]["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


def cnn_init(key: jax.Array) -> Params:
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {
        "c1": _conv(k1, 1, 32),
        "c2": _conv(k2, 32, 64),
        "d1": _dense(k3, 11 * 11 * 64, 64),
        "out": _dense(k4, 64, 10),
    }


def _conv_apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    y = jax.lax.conv_general_dilated(
        x, p["w"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jax.nn.relu(y + p["b"])


def cnn_apply(
    params: Params, x: jax.Array, pool: Callable[[jax.Array], jax.Array] = max_pool_2x2
) -> jax.Array:
    h = _conv_apply(params["c1"], x)  # 26x26x32
    h = pool(h)  # 13x13x32
    h = _conv_apply(params["c2"], h)  # 11x11x64
    h = h.reshape(h.shape[0], -1)
    h = jax.nn.relu(h @ params["d1"]["w"] + params["d1"]["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark model.

    Attributes:
      name: ``"mlp"`` or ``"cnn"``.
      init: ``key -> params``.
      apply: ``(params, images[b, 28, 28, 1]) -> logits[b, 10]``.
      global_batch_size: rows per training step, summed over replicas.
      steps_scale: fraction of ``--steps`` this workload times per repeat (a CNN step
        is ~13x an MLP step on XLA:CPU; scaling keeps every repeat under a second).
    """

    name: str
    init: Callable[[jax.Array], Params]
    apply: Callable[[Params, jax.Array], jax.Array]
    global_batch_size: int
    steps_scale: float

    def per_example_loss(self, params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = self.apply(params, x)
        logz = jax.nn.logsumexp(logits, axis=-1)
        return logz - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]

    def steps(self, requested: int) -> int:
        return max(2, int(round(requested * self.steps_scale)))


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload("mlp", mlp_init, mlp_apply, global_batch_size=512, steps_scale=1.0),
    "cnn": Workload("cnn", cnn_init, cnn_apply, global_batch_size=128, steps_scale=0.1),
}


def synthetic_data(num_examples: int, seed: int = 0) -> dict[str, np.ndarray]:
    """MNIST-shaped random data: ``{"x": float32[n, 28, 28, 1] in [0, 1), "y": int32[n]}``.

    No dataset can be downloaded here, and step time does not depend on pixel values.
    """
    rng = np.random.default_rng(seed)
    return {
        "x": rng.random((num_examples, *IMAGE_SHAPE), dtype=np.float32),
        "y": rng.integers(0, NUM_CLASSES, num_examples).astype(np.int32),
    }


def host_batches(workload: Workload, num_batches: int, seed: int = 0) -> list[dict[str, Any]]:
    """``num_batches`` global batches of :func:`synthetic_data`, in order."""
    b = workload.global_batch_size
    data = synthetic_data(b * num_batches, seed)
    return [{k: v[i * b : (i + 1) * b] for k, v in data.items()} for i in range(num_batches)]
