"""Asynchronous SGD on the 8x8 digits with ``ParameterServerStrategy``.

The quickstart's model and optimizer (MLP 64-256-256-10, Adam 1e-3, see
``configs/quickstart.yaml``), trained by ``num_workers`` workers that pull the
parameters from ``num_ps`` parameter servers, compute a gradient on their own
batch and push it back, without waiting for each other (``max_staleness=None``).
Each worker reads its own shard of the training set, reshuffled every epoch,
through ``coordinator.create_per_worker_dataset``.

Example:
    >>> result = train_and_evaluate(Config(steps=900))
    >>> result["test_accuracy"] >= 0.95
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import distrain as dt
from distrain.data import load_digits
from distrain.experimental import ParameterServerStrategy
from distrain.experimental.coordinator import ClusterCoordinator
from distrain.experimental.partitioners import FixedShardsPartitioner
from examples.classification import mlp, nnx_apply_fn


@dataclasses.dataclass(frozen=True)
class Config:
    """Run settings; every field is a ``main.py`` flag of the same name."""

    backend: str = "inprocess"  # or "ray"
    ray_address: str | None = None  # None: start Ray locally (backend="ray" only)
    num_workers: int = 4
    num_ps: int = 2
    max_staleness: int | None = None  # None: asynchronous; 0: synchronous rounds
    steps: int = 900  # worker steps: 900 x 32 examples = 20 epochs of 1,438 images
    batch_size: int = 32  # examples per worker step
    learning_rate: float = 1e-3
    hidden: tuple[int, ...] = (256, 256)
    seed: int = 0
    eval_every: int = 300  # worker steps between test evaluations
    checkpoint_dir: str | None = None  # save the servers there after training


def worker_shards(train: dict[str, np.ndarray], batch_size: int, seed: int) -> Callable:
    """``dataset_fn(ctx)``: worker ``ctx.input_pipeline_id`` reads every n-th image."""

    def dataset_fn(ctx: dt.InputContext) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        rows = np.arange(ctx.input_pipeline_id, len(train["label"]), ctx.num_input_pipelines)
        rng = np.random.default_rng([seed, ctx.input_pipeline_id])
        for _ in itertools.count():  # repeats: a finite dataset would run out
            order = rng.permutation(rows)
            for start in range(0, len(order) - batch_size + 1, batch_size):
                idx = order[start : start + batch_size]
                yield train["image"][idx], train["label"][idx]

    return dataset_fn


def make_step(apply_fn: Callable) -> Callable:
    """The per-worker step: ``(params, batch) -> (grads, metrics)``."""

    def step_fn(params: Any, batch: tuple[jax.Array, jax.Array]) -> tuple[Any, Any]:
        images, labels = batch

        def loss_fn(p: Any) -> jax.Array:
            logits = apply_fn(p, images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return grads, {"loss": loss}

    return step_fn


def accuracy(apply_fn: Callable, params: Any, data: dict[str, np.ndarray]) -> float:
    logits = jax.jit(apply_fn)(params, data["image"])
    return float(np.mean(np.argmax(logits, -1) == data["label"]))


def train_and_evaluate(config: Config, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Trains, evaluates every ``eval_every`` steps; returns the final figures."""
    train, test = load_digits("train", seed=config.seed), load_digits("test", seed=config.seed)
    model = mlp(key=jax.random.key(config.seed), input_shape=(8, 8, 1), hidden=config.hidden)
    graphdef, params = nnx.split(model)
    apply_fn, params = nnx_apply_fn(graphdef), nnx.to_pure_dict(params)
    strategy = ParameterServerStrategy(
        num_workers=config.num_workers,
        num_ps=config.num_ps,
        variable_partitioner=FixedShardsPartitioner(config.num_ps),
        backend=config.backend,
        ray_address=config.ray_address,
        max_staleness=config.max_staleness,
    )
    try:
        variables = strategy.create_variables(params, optax.adam(config.learning_rate))
        step = strategy.worker_step(make_step(apply_fn))
        coordinator = ClusterCoordinator(strategy)
        iterator = iter(
            coordinator.create_per_worker_dataset(
                worker_shards(train, config.batch_size, config.seed)
            )
        )
        start, done, history = time.perf_counter(), 0, []
        while done < config.steps:
            chunk = min(config.eval_every, config.steps - done)
            last = [coordinator.schedule(step, args=(iterator,)) for _ in range(chunk)][-1]
            coordinator.join()
            done += chunk
            acc = accuracy(apply_fn, variables.read(), test)
            history.append(
                {"step": done, "loss": float(last.fetch()["loss"]), "test_accuracy": acc}
            )
            log(f"step {done:5d}  loss {history[-1]['loss']:.4f}  test accuracy {acc:.4f}")
        seconds = time.perf_counter() - start
        if config.checkpoint_dir:
            log(f"saved step {coordinator.save(config.checkpoint_dir)} to {config.checkpoint_dir}")
        stats = strategy.stats()
        return {
            "test_accuracy": history[-1]["test_accuracy"],
            "history": history,
            "seconds": seconds,
            "worker_steps_per_s": config.steps / seconds,
            "servers": stats,
            "coordinator": coordinator.stats(),
        }
    finally:
        strategy.shutdown()
