"""MobileNetV2 (Sandler et al., 2018) as a flax NNX module, sized for small inputs.

The network is the paper's (and ``tf.keras.applications.MobileNetV2``'s): a 3x3
stride-2 stem, seventeen *inverted residual* blocks and a 1x1 convolution to 1280
channels, then global average pooling and a linear classifier. An inverted residual
block widens its input ``t`` times with a 1x1 convolution, filters it with a 3x3
*depthwise* convolution (one filter per channel: ``feature_group_count=channels``)
and projects it back down with a *linear* 1x1 convolution (no ReLU: the paper's
"linear bottleneck"); when the shapes allow, the input is added back.

``width_multiplier`` (Keras' ``alpha``) scales every layer's channels (rounded to a
multiple of 8, as Keras does); the 1280-channel head only grows, never shrinks.
The total downsampling is 32x, so a 32x32 input ends as a 1x1 feature map (224 in
the paper ends as 7x7); nothing else depends on the input size.

Batch normalisation keeps running averages as ``nnx.BatchStat`` variables. With
``bn_axis_name`` set (the strategy's axis, ``"replica"``), batch statistics are
computed over the *global* batch inside ``strategy.run`` (synchronised batch norm);
by default each replica normalises with its own slice, as Keras'
``BatchNormalization`` does under ``MirroredStrategy``.

Example:
  >>> model = MobileNetV2(num_classes=2, width_multiplier=0.35, rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((4, 32, 32, 3)), train=False).shape
  (4, 2)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# (expansion t, output channels c, repeats n, first stride s), the paper's Table 2.
BLOCKS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


# Keras' default (glorot uniform), not flax's lecun normal: it is also much cheaper to
# compile (a truncated normal per layer costs XLA seconds on a CPU for ~50 layers).
_KERNEL_INIT = nnx.initializers.glorot_uniform()


def make_divisible(value: float, divisor: int = 8) -> int:
    """Rounds ``value`` to the nearest multiple of ``divisor`` without losing >10%."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class ConvBN(nnx.Module):
    """Convolution (no bias) -> batch norm -> optional ReLU6."""

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int,
        *,
        rngs: nnx.Rngs,
        stride: int = 1,
        groups: int = 1,
        relu: bool = True,
        bn_axis_name: str | None = None,
        bn_momentum: float = 0.9,
    ) -> None:
        self.conv = nnx.Conv(
            cin,
            cout,
            (kernel, kernel),
            strides=(stride, stride),
            padding="SAME",
            feature_group_count=groups,
            use_bias=False,
            kernel_init=_KERNEL_INIT,
            rngs=rngs,
        )
        # Keras uses epsilon 1e-3; momentum 0.9 (Keras: 0.999) lets the running averages
        # catch up within the few hundred steps a CPU run has.
        self.bn = nnx.BatchNorm(
            cout, momentum=bn_momentum, epsilon=1e-3, axis_name=bn_axis_name, rngs=rngs
        )
        self.relu = relu

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = self.bn(self.conv(x), use_running_average=not train)
        return jnp.clip(x, 0.0, 6.0) if self.relu else x


class InvertedResidual(nnx.Module):
    """Expand (1x1) -> depthwise 3x3 -> linear projection (1x1), plus the skip if it fits."""

    def __init__(
        self, cin: int, cout: int, stride: int, expansion: int, *, rngs: nnx.Rngs, **bn: object
    ) -> None:
        hidden = cin * expansion
        self.expand = ConvBN(cin, hidden, 1, rngs=rngs, **bn) if expansion != 1 else None
        self.depthwise = ConvBN(hidden, hidden, 3, stride=stride, groups=hidden, rngs=rngs, **bn)
        self.project = ConvBN(hidden, cout, 1, relu=False, rngs=rngs, **bn)
        self.residual = stride == 1 and cin == cout

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        y = self.expand(x, train) if self.expand is not None else x
        y = self.project(self.depthwise(y, train), train)
        return x + y if self.residual else y


class MobileNetV2(nnx.Module):
    """MobileNetV2 classifier; inputs ``[batch, H, W, channels]`` floats, outputs logits.

    Args:
      num_classes: output logits (2 for cats vs dogs).
      width_multiplier: Keras' ``alpha``; 1.0 is the paper's network (3.5 M parameters
        with 1000 classes), 0.35 the smallest published one.
      in_channels: 3 for RGB.
      bn_axis_name: a mesh axis name for synchronised batch norm (see module docstring).
      stages: how many of the paper's 7 bottleneck stages (rows of ``BLOCKS``) to
        build; the default is the whole network. Fewer stages make a much smaller
        graph for quick smoke tests (XLA compile time grows with the layer count).
      rngs: initialisation randomness.
    """

    def __init__(
        self,
        num_classes: int = 2,
        width_multiplier: float = 1.0,
        *,
        rngs: nnx.Rngs,
        in_channels: int = 3,
        bn_axis_name: str | None = None,
        stages: int = len(BLOCKS),
    ) -> None:
        if width_multiplier <= 0:
            raise ValueError(
                f"width_multiplier must be > 0 (e.g. 0.35, 0.5, 1.0); received {width_multiplier}."
            )
        if not 1 <= stages <= len(BLOCKS):
            raise ValueError(f"stages must be in [1, {len(BLOCKS)}]; received {stages}.")
        bn = {"bn_axis_name": bn_axis_name}
        channels = make_divisible(32 * width_multiplier)
        self.stem = ConvBN(in_channels, channels, 3, stride=2, rngs=rngs, **bn)
        blocks = []
        for t, c, n, s in BLOCKS[:stages]:
            cout = make_divisible(c * width_multiplier)
            for i in range(n):
                blocks.append(
                    InvertedResidual(channels, cout, s if i == 0 else 1, t, rngs=rngs, **bn)
                )
                channels = cout
        self.blocks = nnx.List(blocks)
        last = make_divisible(1280 * max(1.0, width_multiplier))
        self.head = ConvBN(channels, last, 1, rngs=rngs, **bn)
        self.classifier = nnx.Linear(last, num_classes, kernel_init=_KERNEL_INIT, rngs=rngs)

    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        x = self.stem(x, train)
        for block in self.blocks:
            x = block(x, train)
        x = self.head(x, train)
        return self.classifier(jnp.mean(x, axis=(1, 2)))  # global average pooling
