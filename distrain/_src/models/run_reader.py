"""A finished run's model and parameters, read from its config and checkpoint (for
``distrain lm-eval`` and ``dt.models.LMEvalModel.from_checkpoint``).

Example:
  >>> module, params, strategy = read_run("configs/lm_tiny.yaml", "runs/ckpt", None, [], None)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any


def read_run(config: str, checkpoint: str, step: int | None, overrides: Sequence[str],
             strategy: Any) -> tuple[Any, Any, Any]:  # fmt: skip
    """``(abstract module, parameters, strategy)`` of a run, as ``distrain export`` reads
    them: the config's ``model.fn`` built abstractly (nothing allocated), the ``params``
    of the newest (or ``step``) checkpoint read whole on the host, then placed by
    ``strategy`` (default: the one the config names).

    Raises:
      FileNotFoundError: no checkpoint directory, or no checkpoint in it.
      ValueError: a checkpoint without ``params``, or whose parameters are not the model's.
    """
    from flax import nnx

    from distrain._src.train.config import load_config
    from distrain._src.train.import_paths import resolve_callable
    from distrain._src.train.strategy_from_config import build_strategy

    cfg = load_config(config, list(overrides))
    model_fn = resolve_callable(cfg.model.fn, "model.fn")
    import jax

    module = nnx.eval_shape(lambda: model_fn(key=jax.random.key(0), **cfg.model.kwargs))
    _, params = read_params(checkpoint, step)
    _check_same(nnx.to_pure_dict(nnx.state(module)), params, cfg.model.fn)
    strategy = strategy if strategy is not None else build_strategy(cfg.strategy)
    return module, strategy.put_replicated({"params": params})["params"], strategy


def _check_same(want: Any, got: Any, fn: str) -> None:
    """Refuses parameters whose paths or shapes are not the model's, naming the first."""
    import jax
    import numpy as np

    def flat(tree: Any) -> dict[str, tuple[int, ...]]:
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(p, simple=True, separator="/"): np.shape(x)
                for p, x in leaves}  # fmt: skip

    a, b = flat(want), flat(got)
    for path in sorted(set(a) | set(b)):
        if a.get(path) != b.get(path):
            raise ValueError(
                f"The checkpoint's parameters are not those of model.fn {fn!r}: {path} is "
                f"{b.get(path, 'missing')} in the checkpoint, {a.get(path, 'missing')} in "
                "the model. Pass the run's own config (and overrides)."
            )


def read_params(checkpoint: str, step: int | None) -> tuple[int, Any]:
    """``(step, params)`` of the newest (or ``step``) checkpoint in ``checkpoint``, read
    whole on the host.

    Raises:
      FileNotFoundError: no checkpoint directory, or no checkpoint in it.
      ValueError: a checkpoint without ``params``.
    """
    from distrain._src.checkpoint.manager import CheckpointManager

    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"--checkpoint {checkpoint!r} is not a directory.")
    with CheckpointManager(checkpoint, async_save=False, read_only=True) as manager:
        restored = manager.restore(step)
    if restored is None:
        raise FileNotFoundError(f"--checkpoint {checkpoint!r} holds no checkpoint.")
    state = restored.state
    params = state.get("params") if isinstance(state, dict) else None
    if params is None:
        raise ValueError(
            f"The checkpoint at step {restored.step} in {checkpoint!r} has no 'params' "
            "(expected a dt.TrainState saved by distrain train or the Trainer)."
        )
    return restored.step, params
