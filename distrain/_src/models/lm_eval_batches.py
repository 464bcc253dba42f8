"""lm-eval's requests as batches of a few compiled programs, run through a strategy.

:class:`Batches` takes token windows (``loglikelihood``, ``loglikelihood_rolling``) or
prompts (``generate_until``) from :class:`LMEvalModel` and runs them ``rows`` at a time:

* scoring: longest first, each batch padded on the right (a causal model never reads
  it) to a width of 16, 32, 64, ... or the context, so a task compiles a few programs
  whatever its lengths. Each replica runs the model on its rows (``strategy.run``, the
  parameters in the strategy's layout) and returns each position's log-probability of
  its target and whether the target is the argmax; the host sums each window's scored
  positions in float64.
* generation: ``dt.models.generate`` over the strategy's replicas, every batch filled to
  ``rows`` prompts (repeating one) so that only the prompt width (a multiple of 16,
  ``generate``'s rule) and ``max_gen_toks`` make new programs.

Example:
  >>> batches = Batches(strategy, graphdef, context=1024, batch_size=16)
  >>> batches.score(params, [([0, 5, 6], [5, 6, 7], 2)])   # [(log p(6, 7 | 0 5), greedy)]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from distrain._src.models.generate import generate

__all__ = ["MIN_WIDTH", "Batches", "width_for"]

#: The narrowest batch a forward pass runs; wider ones double up to the context.
MIN_WIDTH = 16

#: ``(inputs, targets, n)``: score the last ``n`` targets (targets = inputs shifted by one).
Window = tuple[Sequence[int], Sequence[int], int]


def width_for(n: int, context: int) -> int:
    """The padded width of a batch whose longest row is ``n`` tokens: the smallest of
    16, 32, 64, ... that holds it, at most ``context``."""
    return min(context, max(MIN_WIDTH, 1 << math.ceil(math.log2(max(n, 1)))))


@dataclasses.dataclass(frozen=True)
class _Program:
    """What shapes the scoring program (hashable: a constant of ``strategy.run``)."""

    graphdef: Any


def _score(params: Any, batch: dict[str, jax.Array], program: _Program) -> dict[str, Any]:
    """Per replica: each position's log-probability of its target, and whether the
    target is the argmax (lm-eval's ``is_greedy``)."""
    logits = nnx.merge(program.graphdef, params)(batch["tokens"]).astype(jnp.float32)
    targets = batch["targets"][..., None]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets, axis=-1)
    greedy = jnp.argmax(logits, axis=-1) == batch["targets"]
    return {"logp": logp[..., 0], "greedy": greedy}


class Batches:
    """Runs windows and prompts ``rows`` at a time on ``strategy``.

    Args:
      strategy: where the programs run.
      graphdef: the model's ``nnx`` graph (``nnx.merge(graphdef, params)`` is the model).
      context: the model's context (the widest window).
      batch_size: rows per batch, rounded up to a multiple of the strategy's devices
        (a replica's rows may split over its devices).
    """

    def __init__(self, strategy: Any, graphdef: Any, context: int, batch_size: int) -> None:
        self.strategy, self.context, self.batch_size = strategy, context, batch_size
        self._program = _Program(graphdef)

    @property
    def rows(self) -> int:
        n = len(self.strategy.devices)
        return -(-self.batch_size // n) * n

    def score(self, params: Any, windows: Sequence[Window]) -> list[tuple[float, bool]]:
        """``(sum of the log-probabilities of the last n targets, all of them greedy)``
        for each window."""
        answers: list[tuple[float, bool]] = [(0.0, True)] * len(windows)
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        b = self.rows
        for start in range(0, len(order), b):
            chunk = order[start : start + b]
            width = width_for(len(windows[chunk[0]][0]), self.context)
            tokens = np.zeros((b, width), np.int32)
            targets = np.zeros((b, width), np.int32)
            for r, i in enumerate(chunk):
                inputs, wanted, _ = windows[i]
                tokens[r, : len(inputs)], targets[r, : len(wanted)] = inputs, wanted
            batch = self.strategy.distribute_batch({"tokens": tokens, "targets": targets})
            out = self.strategy.run(_score, (params, batch, self._program))
            logp = _host(self.strategy.gather(out["logp"], axis=0))
            greedy = _host(self.strategy.gather(out["greedy"], axis=0))
            for r, i in enumerate(chunk):
                n, k = len(windows[i][0]), windows[i][2]
                scored = slice(n - k, n)
                answers[i] = (float(logp[r, scored].astype(np.float64).sum()),
                              bool(greedy[r, scored].all()))  # fmt: skip
        return answers

    def generate(self, model: Any, params: Any, prompts: Sequence[Sequence[int]], n: int,
                 **options: Any) -> list[list[int]]:  # fmt: skip
        """Up to ``n`` new tokens of each prompt (``dt.models.generate``'s ``options``:
        stop tokens, sampling), a row's stop token included."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        b = self.rows
        for start in range(0, len(order), b):
            chunk = order[start : start + b]
            batch = [list(prompts[i]) for i in chunk]
            batch += [batch[0]] * (b - len(batch))
            got = generate(model, params, batch, n, strategy=self.strategy, **options)
            tokens, lengths = _host(got.tokens), _host(got.lengths)
            for r, i in enumerate(chunk):
                out[i] = tokens[r, : lengths[r]].tolist()
        return out


def _host(x: Any) -> np.ndarray:
    """``x`` whole on every process (a collective where it spans processes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
