"""Mixed precision (``dt.mixed_precision``) in Keras' vocabulary.

A policy (``"float32"``, ``"mixed_bfloat16"``, ``"mixed_float16"``) is set once, on the
state (``dt.TrainState.create(..., policy="mixed_bfloat16")``), and a step takes
gradients through ``state.value_and_grad``; float16 adds a dynamic loss scale that
lives in the state. How it works and what it measured: docs/scaling.md.
"""

from distrain._src.mixed_precision import DynamicLossScale as DynamicLossScale
from distrain._src.mixed_precision import Policy as Policy

__all__ = ["DynamicLossScale", "Policy"]
