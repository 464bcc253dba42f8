"""Image classification: the models, datasets and steps the shipped configs name.

``configs/quickstart.yaml``, ``mnist_mlp.yaml`` and ``mnist_cnn.yaml`` name these by
import path (``examples.classification:mlp``; run ``distrain train`` from the repository
root). They are ordinary functions with the contracts of a run config
(``dt.config``), so they double as templates for your own:

* models: ``fn(*, key, **kwargs)`` returns a ``flax.nnx.Module``;
* data: ``fn(**kwargs)`` returns ``{"train": arrays, "test": arrays}``;
* steps: ``step(state, batch, *, apply_fn, ...)`` with ``apply_fn(params, x)``.

Example:
  >>> model = mlp(key=jax.random.key(0), input_shape=(8, 8, 1), hidden=(128,))
  >>> graphdef, params = nnx.split(model)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import distrain as dt
from distrain.metrics import Accuracy, Mean

ApplyFn = Callable[[Any, jax.Array], jax.Array]


class MLP(nnx.Module):
    """Flatten, then ``Dense -> ReLU`` per hidden width, then a ``Dense`` to logits."""

    def __init__(
        self, in_features: int, hidden: Sequence[int], num_classes: int, *, rngs: nnx.Rngs
    ) -> None:
        widths = [in_features, *hidden]
        # Named attributes (not a list) keep the parameter tree's keys strings:
        # {"dense_0": {"kernel", "bias"}, ..., "out": ...}, which checkpoints cleanly.
        self.num_hidden = len(hidden)
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
            setattr(self, f"dense_{i}", nnx.Linear(a, b, rngs=rngs))
        self.out = nnx.Linear(widths[-1], num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for i in range(self.num_hidden):
            x = jax.nn.relu(getattr(self, f"dense_{i}")(x))
        return self.out(x)


def mlp(
    *,
    key: jax.Array,
    input_shape: Sequence[int] = (28, 28, 1),
    hidden: Sequence[int] = (256, 256),
    num_classes: int = 10,
) -> MLP:
    """The Keras guide's MLP (784-256-256-10 for MNIST): logits for ``num_classes``."""
    return MLP(math.prod(input_shape), list(hidden), num_classes, rngs=nnx.Rngs(key))


def max_pool_2x2(x: jax.Array) -> jax.Array:
    """``nnx.max_pool(x, (2, 2), strides=(2, 2))`` (NHWC, VALID) as four strided slices.

    Same values and parameter gradients; on XLA:CPU the gradient of ``reduce_window``
    (``select_and_scatter``) costs ~15x more than that of ``maximum`` of slices, which
    made it half of this CNN's training step (docs/performance.md).

    Example:
      >>> max_pool_2x2(jnp.arange(16.0).reshape(1, 4, 4, 1))[0, :, :, 0]
      Array([[ 5.,  7.],
             [13., 15.]], dtype=float32)
    """
    h, w = x.shape[1] // 2 * 2, x.shape[2] // 2 * 2
    top, bottom = x[:, 0:h:2], x[:, 1:h:2]
    return jnp.maximum(
        jnp.maximum(top[:, :, 0:w:2], top[:, :, 1:w:2]),
        jnp.maximum(bottom[:, :, 0:w:2], bottom[:, :, 1:w:2]),
    )


class CNN(nnx.Module):
    """The CNN of the strategy overview: two 3x3 convolutions, a max-pool, two Dense layers."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, *, rngs: nnx.Rngs) -> None:
        h, w, c = input_shape
        self.conv1 = nnx.Conv(c, 32, (3, 3), padding="VALID", rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), padding="VALID", rngs=rngs)
        # VALID 3x3 conv -> pool 2 -> VALID 3x3 conv, as Conv2D/MaxPooling2D/Conv2D in Keras.
        h, w = (h - 2) // 2 - 2, (w - 2) // 2 - 2
        self.dense = nnx.Linear(h * w * 64, 64, rngs=rngs)
        self.out = nnx.Linear(64, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.conv1(x))
        x = max_pool_2x2(x)
        x = jax.nn.relu(self.conv2(x))
        x = x.reshape(x.shape[0], -1)
        x = jax.nn.relu(self.dense(x))
        # Logits: the seed model ends in softmax *and* uses from_logits=True, a known slip.
        return self.out(x)


def cnn(*, key: jax.Array, input_shape: Sequence[int] = (28, 28, 1), num_classes: int = 10) -> CNN:
    """The seed overview's Keras CNN (Conv32-MaxPool-Conv64-Dense64-Dense10) in NNX."""
    return CNN(list(input_shape), num_classes, rngs=nnx.Rngs(key))


# ---------------------------------------------------------------------------- data


def digits(*, test_fraction: float = 0.2, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """scikit-learn's bundled 8x8 digits (offline): ``{"train": ..., "test": ...}``."""
    return {
        split: dt.data.load_digits(split, test_fraction=test_fraction, seed=seed)
        for split in ("train", "test")
    }


def mnist(
    *, cache_dir: str | None = None, num_validation: int = 0
) -> dict[str, dict[str, np.ndarray]]:
    """MNIST (downloaded once into a cache; see ``dt.data.load_mnist``).

    Args:
      cache_dir: where the files are cached (default ``~/.cache/distrain/mnist``).
      num_validation: hold out the last rows of the training set as ``"validation"``
        (the Keras guide holds out 10,000).
    """
    train = dt.data.load_mnist("train", cache_dir=cache_dir)
    out = {"train": train, "test": dt.data.load_mnist("test", cache_dir=cache_dir)}
    if num_validation:
        out["validation"] = {k: v[-num_validation:] for k, v in train.items()}
        out["train"] = {k: v[:-num_validation] for k, v in train.items()}
    return out


# ---------------------------------------------------------------------------- steps


def _mask(batch: dict[str, Any], mask_key: str | None) -> jax.Array | None:
    return batch.get(mask_key) if mask_key is not None else None


def classification_train_step(
    state: Any,
    batch: dict[str, jax.Array],
    *,
    apply_fn: ApplyFn,
    image_key: str = "image",
    label_key: str = "label",
    mask_key: str | None = "mask",
) -> tuple[Any, dict[str, Any]]:
    """One per-replica step of softmax cross-entropy on integer labels.

    The loss is ``dt.compute_average_loss`` of the per-example losses (divided by the
    global batch size, or by the number of real rows when the batch has a mask), so
    ``apply_gradients`` summing gradients over replicas gives the global mean's gradient.
    """
    images, labels, mask = batch[image_key], batch[label_key], _mask(batch, mask_key)

    def loss_fn(params: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        logits = apply_fn(params, images)
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return dt.compute_average_loss(per_example, mask=mask), (logits, per_example)

    # state.value_and_grad: jax.value_and_grad under the state's mixed-precision policy.
    (_, (logits, per_example)), grads = state.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads)
    return state, {
        "loss": Mean.from_values(per_example, mask=mask),
        "accuracy": Accuracy.from_logits(logits, labels, mask=mask),
    }


def classification_eval_step(
    state: Any,
    batch: dict[str, jax.Array],
    *,
    apply_fn: ApplyFn,
    image_key: str = "image",
    label_key: str = "label",
    mask_key: str | None = "mask",
) -> dict[str, Any]:
    """Loss and accuracy of one per-replica batch; padded rows (mask 0) do not count."""
    images, labels, mask = batch[image_key], batch[label_key], _mask(batch, mask_key)
    logits = apply_fn(state.params, images)
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return {
        "loss": Mean.from_values(per_example, mask=mask),
        "accuracy": Accuracy.from_logits(logits, labels, mask=mask),
    }


def classification_predict_step(
    state: Any, batch: dict[str, jax.Array], *, apply_fn: ApplyFn, image_key: str = "image"
) -> jax.Array:
    """Class probabilities ``[rows, num_classes]`` of one per-replica batch."""
    return jax.nn.softmax(apply_fn(state.params, batch[image_key]), axis=-1)


def nnx_apply_fn(graphdef: Any) -> ApplyFn:
    """``apply_fn(params, x)`` for a module split as ``graphdef, params = nnx.split(model)``."""

    def apply_fn(params: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, params)(x)

    return apply_fn
