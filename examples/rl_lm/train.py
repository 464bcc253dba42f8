"""GRPO on a small language model, as a custom loop under one strategy.

Two stages, both written per replica for ``strategy.run``:

1. **Pretraining** (:func:`pretrain`): a ``dt.models.Transformer`` learns the task's
   format from scratch on text whose answers are wrong (``task.pretrain_rows``).
2. **GRPO** (:func:`grpo_step`, one ``train_step`` written once): each replica takes its
   prompts, samples ``group_size`` completions of each with ``dt.models.generate``,
   scores them (``task.reward``), turns the scores into group-relative advantages,
   and takes ``inner_updates`` steps of a clipped policy gradient with a KL penalty to
   the frozen reference. Losses go through ``dt.compute_average_loss`` with the
   *global* batch, and ``state.apply_gradients`` sums the gradients over replicas.

The reference lives in the same ``dt.TrainState`` as the policy, frozen
(``TrainState.create(trainable="^policy/")``): it has no optimizer state, takes no
gradient all-reduce and is checkpointed with the rest. A checkpoint holds policy,
reference, optimizer, rng and the prompt iterator's position, so a run killed at any
point resumes to the bits of a run never interrupted.

Example:
    >>> import distrain as dt
    >>> result = train(Config(rl_steps=10), dt.MirroredStrategy(), "/tmp/grpo")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import distrain as dt

from . import task

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of both stages (defaults: the committed runs of README.md)."""

    seed: int = 0
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    pretrain_steps: int = 1500
    """Pretraining steps (0: RL from the random initialisation)."""
    pretrain_batch: int = 64
    pretrain_lr: float = 3e-3
    rl_steps: int = 80
    prompts_per_step: int = 32
    """Prompts per RL step, over all replicas; split evenly between them."""
    group_size: int = 8
    """Completions sampled per prompt; advantages are relative to the group's mean."""
    learning_rate: float = 1e-3
    inner_updates: int = 2
    """Gradient steps per sampled batch; from the second on, the ratio is clipped."""
    clip_eps: float = 0.2
    kl_coef: float = 0.02
    temperature: float = 1.0
    eval_every: int = 10
    """Steps between held-out evaluations (greedy, every held-out prompt)."""
    save_every: int = 5
    """Steps between checkpoints (also one after pretraining, and at the end)."""

    def validate(self, num_replicas: int) -> None:
        """Raises ValueError for settings the run cannot use on ``num_replicas`` replicas."""
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (advantages compare completions of one prompt); "
                f"received {self.group_size}."
            )
        if self.prompts_per_step % num_replicas:
            raise ValueError(
                f"prompts_per_step ({self.prompts_per_step}) must be divisible by the number "
                f"of replicas ({num_replicas}); choose a multiple of {num_replicas}."
            )
        if self.pretrain_steps and self.pretrain_batch % num_replicas:
            raise ValueError(
                f"pretrain_batch ({self.pretrain_batch}) must be divisible by the number of "
                f"replicas ({num_replicas}); choose a multiple of {num_replicas}."
            )
        for name in ("rl_steps", "inner_updates", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; received {getattr(self, name)}.")

    @property
    def lm(self) -> dt.models.LMConfig:
        """The model: a rotary decoder over the task's 10 tokens and 12 positions."""
        return dt.models.LMConfig(
            vocab_size=task.VOCAB,
            seq_len=task.SEQ_WIDTH,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
        )


TOY = Config(
    d_model=32, n_heads=2, pretrain_steps=60, pretrain_lr=1e-2, rl_steps=4,
    prompts_per_step=16, eval_every=4, save_every=2,
)  # fmt: skip
"""Seconds-long settings (``main --toy``, ``tests/test_example_rl_lm.py``)."""


def init_params(cfg: Config) -> tuple[nnx.GraphDef, PyTree]:
    """A fresh model: its graphdef and parameters (a pure dict)."""
    graphdef, params = nnx.split(dt.models.Transformer(cfg.lm, rngs=nnx.Rngs(cfg.seed)))
    return graphdef, nnx.to_pure_dict(params)


def token_logprobs(
    graphdef: nnx.GraphDef, params: PyTree, seq: jax.Array, temperature: float = 1.0
) -> jax.Array:
    """``log p(seq[:, t + 1] | seq[:, :t + 1])`` for every ``t``: ``[B, T - 1]``."""
    logits = nnx.merge(graphdef, params)(seq[:, :-1]) / temperature
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, seq[:, 1:, None], axis=-1)[..., 0]


# ------------------------------------------------------------------ stage 1: pretraining


def pretrain_step(graphdef: nnx.GraphDef, state: dt.TrainState, batch: dict[str, jax.Array]):
    """One next-token step on the answers of a replica's rows (the prompt is context)."""
    rows, length = batch["rows"], batch["length"]
    t = jnp.arange(rows.shape[1] - 1)[None]
    # Predictions of the answer and its stop token: rows[t + 1] for L < t + 1 <= 2L + 1.
    mask = ((t + 1 > length[:, None]) & (t + 1 <= 2 * length[:, None] + 1)).astype(jnp.float32)

    def loss_fn(params: PyTree) -> jax.Array:
        nll = -token_logprobs(graphdef, params, rows)
        per_example = jnp.sum(nll * mask, axis=1) / jnp.sum(mask, axis=1)
        return dt.compute_average_loss(per_example)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def pretrain(
    cfg: Config, strategy: dt.Strategy, split: task.Split, log: Callable[[str], None] = print
) -> tuple[nnx.GraphDef, PyTree, list[float]]:
    """Stage 1: trains a fresh model for ``cfg.pretrain_steps`` steps on wrong answers.

    Returns:
        ``(graphdef, params, losses)``: the pretrained parameters (replicated) and the
        loss every 50 steps.
    """
    graphdef, params = init_params(cfg)
    epochs = -(-cfg.pretrain_steps * cfg.pretrain_batch // len(split.train["length"]))
    # A new wrong answer for every prompt in every epoch: the model cannot learn one.
    rows = np.concatenate(
        [task.pretrain_rows(split.train, cfg.seed * 1000 + e) for e in range(max(epochs, 1))]
    )
    lengths = np.tile(split.train["length"], max(epochs, 1))
    pipe = dt.data.ArrayPipeline(
        {"rows": rows, "length": lengths}, global_batch_size=cfg.pretrain_batch, seed=cfg.seed
    )
    tx = optax.adamw(optax.cosine_decay_schedule(cfg.pretrain_lr, max(cfg.pretrain_steps, 1)))
    step_fn = _pretrain_step_fn(graphdef)
    losses: list[float] = []
    with strategy.scope():
        state = strategy.put_replicated(dt.TrainState.create(params=params, tx=tx))
        batches = iter(strategy.experimental_distribute_dataset(pipe))
        for i in range(cfg.pretrain_steps):
            state, loss = strategy.run(step_fn, args=(state, next(batches)))
            if (i + 1) % 50 == 0 or i + 1 == cfg.pretrain_steps:
                losses.append(float(strategy.reduce("sum", loss, axis=None)))
                log(f"pretrain {i + 1}/{cfg.pretrain_steps}: loss {losses[-1]:.3f}")
        params = state.params
    return graphdef, params, losses


@functools.cache
def _pretrain_step_fn(graphdef: nnx.GraphDef) -> Callable[..., Any]:
    return functools.partial(pretrain_step, graphdef)


# ------------------------------------------------------------------ stage 2: GRPO


def init_rl_state(cfg: Config, policy: PyTree) -> dt.TrainState:
    """The RL state: ``{"policy", "reference"}`` (a frozen copy of ``policy``), Adam on
    the policy only, and the sampling key."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(cfg.learning_rate))
    params = {"policy": policy, "reference": jax.tree.map(jnp.copy, policy)}
    return dt.TrainState.create(
        params=params, tx=tx, rng=jax.random.key(cfg.seed + 1), trainable="^policy/"
    )


def sequences(prompt: jax.Array, length: jax.Array, completion: jax.Array) -> jax.Array:
    """Prompt then completion in one row each, ``[B, SEQ_WIDTH]`` (STOP padding after)."""
    rows = jnp.pad(prompt, ((0, 0), (0, task.SEQ_WIDTH - prompt.shape[1])))

    def place(row: jax.Array, new: jax.Array, at: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(row, new, (at,))

    return jax.vmap(place)(rows, completion, length + 1)


def group_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """``(r - mean) / (std + 1e-6)`` within each group of ``group_size`` consecutive rows
    (0 for a group whose completions all scored the same)."""
    r = rewards.reshape(-1, group_size)
    adv = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)
    return adv.reshape(-1)


class Rollout(NamedTuple):
    """``group_size`` completions of each prompt, scored (rows prompt-major)."""

    tokens: jax.Array  # [B * G, ANSWER_WIDTH]: generate's new tokens
    reward: jax.Array  # [B * G]
    seq: jax.Array  # [B * G, SEQ_WIDTH]: prompt then completion
    mask: jax.Array  # [B * G, SEQ_WIDTH - 1]: 1 where a log-prob scores a completion token


def rollout(cfg: Config, policy: PyTree, batch: dict[str, jax.Array], key: jax.Array) -> Rollout:
    """Samples ``cfg.group_size`` completions of every prompt of ``batch`` and scores them.

    In a replica (``strategy.run``), ``batch`` is its prompts; row ``r`` of the global
    batch draws the same completion whatever the number of replicas.
    """
    g = cfg.group_size
    prompt, length, target = (
        jnp.repeat(batch[k], g, axis=0) for k in ("prompt", "length", "target")
    )
    out = dt.models.generate(
        cfg.lm, policy, prompt, task.ANSWER_WIDTH, lengths=length + 1,
        temperature=cfg.temperature, stop_tokens=(task.STOP,), pad_token=task.STOP, rng=key,
    )  # fmt: skip
    t = jnp.arange(task.SEQ_WIDTH - 1)[None] + 1  # the position each log-prob predicts
    first = length[:, None] + 1
    mask = ((t >= first) & (t < first + out.lengths[:, None])).astype(jnp.float32)
    return Rollout(
        tokens=out.tokens,
        reward=task.reward(out.tokens, out.lengths, target, length),
        seq=sequences(prompt, length, out.tokens),
        mask=mask,
    )


def grpo_step(
    state: dt.TrainState, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef, cfg: Config
) -> tuple[dt.TrainState, dict[str, jax.Array]]:
    """One GRPO step for one replica's prompts (run it with ``strategy.run``).

    Args:
        state: the replicated RL state (:func:`init_rl_state`).
        batch: this replica's prompts: ``prompt``, ``length``, ``target`` (``task.Split``).
        graphdef: the model's structure.
        cfg: the settings.

    Returns:
        ``(state, metrics)``: the new state (the same on every replica) and this
        replica's sums (``strategy.reduce("sum", ...)`` adds the replicas'): ``reward``,
        ``correct``, ``kl``, ``count`` and ``loss`` (a share of the global mean).
    """
    ctx = dt.get_replica_context()
    # One key for the step, the same on every replica: generate numbers each row by its
    # place in the *global* batch (replica_id * local rows + row) and folds that into
    # the key, so row r draws the same completion on 1 replica as on 8.
    sample_key, next_key = jax.random.split(state.rng)
    roll = rollout(cfg, state.params["policy"], batch, sample_key)
    adv = group_advantages(roll.reward, cfg.group_size)[:, None]
    seq, mask = roll.seq, roll.mask
    logp_of = functools.partial(token_logprobs, graphdef, temperature=cfg.temperature)
    old = jax.lax.stop_gradient(logp_of(state.params["policy"], seq))
    ref = logp_of(state.params["reference"], seq)
    global_batch = seq.shape[0] * ctx.num_replicas_in_sync

    def loss_fn(params: PyTree) -> tuple[jax.Array, jax.Array]:
        logp = logp_of(params["policy"], seq)
        ratio = jnp.exp(logp - old)
        clipped = jnp.clip(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
        policy_loss = -jnp.minimum(ratio * adv, clipped * adv)
        kl = jnp.exp(ref - logp) - (ref - logp) - 1  # k3: an unbiased, positive KL estimate
        per_token = (policy_loss + cfg.kl_coef * kl) * mask
        per_example = per_token.sum(1) / mask.sum(1)
        loss = dt.compute_average_loss(per_example, global_batch_size=global_batch)
        return loss, (kl * mask).sum(1) / mask.sum(1)

    def update(state: dt.TrainState, _: Any) -> tuple[dt.TrainState, tuple[Any, Any]]:
        (loss, kl), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), (loss, kl)  # grads summed over replicas

    state, (losses, kls) = jax.lax.scan(update, state, length=cfg.inner_updates)
    metrics = {
        "reward": roll.reward.sum(),
        "correct": (roll.reward == 1.0).sum().astype(jnp.float32),
        "kl": kls[0].sum(),  # before this step's updates
        "loss": losses[0],
        "count": jnp.float32(seq.shape[0]),
    }
    return state.replace(rng=next_key), metrics


@functools.cache
def make_step(graphdef: nnx.GraphDef, cfg: Config) -> Callable[..., Any]:
    """The per-replica step for ``strategy.run``; one object per (model, settings), so
    that runs with the same settings reuse the strategy's compiled step."""
    return functools.partial(grpo_step, graphdef=graphdef, cfg=cfg)


def held_out_accuracy(
    cfg: Config, strategy: dt.Strategy, policy: PyTree, data: dict[str, np.ndarray]
) -> tuple[float, float]:
    """Greedy completions of every prompt of ``data``: ``(accuracy, mean reward)``.

    The prompts are split over the strategy's replicas (padded with copies of the
    first to a multiple of their number; the copies are not counted).
    """
    n, k = len(data["length"]), strategy.num_replicas_in_sync
    pad = (-n) % k
    take = np.concatenate([np.arange(n), np.zeros(pad, np.int64)])
    out = dt.models.generate(
        cfg.lm, policy, data["prompt"][take], task.ANSWER_WIDTH, lengths=data["length"][take] + 1,
        stop_tokens=(task.STOP,), pad_token=task.STOP, strategy=strategy,
    )  # fmt: skip
    r = np.asarray(
        task.reward(out.tokens, out.lengths, data["target"][take], data["length"][take])
    )[:n]
    return float((r == 1.0).mean()), float(r.mean())


# ------------------------------------------------------------------ the loop


@dataclasses.dataclass
class Result:
    """What :func:`train` measured; ``history`` has one row per RL step."""

    replicas: int
    accuracy_before: float
    accuracy_after: float
    history: list[dict[str, float]]
    wall_s: float
    """The RL stage only (compiles and evaluations included), summed over resumed runs."""
    pretrain_wall_s: float
    pretrain_losses: list[float]
    resumed_from: int | None
    state: dt.TrainState | None = None


def _rl_setup(
    cfg: Config, strategy: dt.Strategy, split: task.Split
) -> tuple[nnx.GraphDef, dt.TrainState, Any]:
    """The restore target (a fresh RL state, placed) and the distributed prompt iterator."""
    graphdef, params = init_params(cfg)
    fresh = strategy.put_replicated(init_rl_state(cfg, params))
    prompts = {k: split.train[k] for k in ("prompt", "length", "target")}
    pipe = dt.data.ArrayPipeline(prompts, global_batch_size=cfg.prompts_per_step, seed=cfg.seed)
    return graphdef, fresh, iter(strategy.experimental_distribute_dataset(pipe))


def train(
    cfg: Config,
    strategy: dt.Strategy,
    workdir: str,
    *,
    log: Callable[[str], None] = print,
) -> Result:
    """Pretrains (unless ``workdir`` holds a checkpoint), then runs GRPO to ``cfg.rl_steps``.

    Checkpoints go to ``workdir``: one after pretraining (step 0), then every
    ``cfg.save_every`` RL steps and at the end. Run the same call again after an
    interruption and it resumes from the newest one.
    """
    n = strategy.num_replicas_in_sync
    cfg.validate(n)
    split = task.make_split(cfg.seed)
    # Synchronous saves (a few MB): a step's checkpoint is on disk when its line is
    # logged, so a kill after that line resumes from it.
    with (
        strategy.scope(),
        dt.checkpoint.CheckpointManager(
            workdir, max_to_keep=2, save_interval_steps=cfg.save_every, async_save=False
        ) as mgr,
    ):
        graphdef, fresh, batches = _rl_setup(cfg, strategy, split)
        restored = mgr.restore(target=fresh)
        if restored is None:
            start = time.perf_counter()
            graphdef, policy, losses = pretrain(cfg, strategy, split, log)
            meta: dict[str, Any] = {
                "pretrain_wall_s": time.perf_counter() - start,
                "pretrain_losses": losses,
                "accuracy_before": held_out_accuracy(cfg, strategy, policy, split.held_out)[0],
                "history": [],
                "wall_s": 0.0,
            }
            state, step = strategy.put_replicated(init_rl_state(cfg, policy)), 0
            mgr.save(0, state, data_state=batches.get_state(), metadata=meta, force=True)
            log(f"pretrained: held-out accuracy {meta['accuracy_before']:.3f}")
        else:
            state, step, meta = restored.state, restored.step, restored.metadata
            batches.set_state(restored.data_state)
            log(f"resumed from RL step {step}")
        step_fn = make_step(graphdef, cfg)
        start, wall_before = time.perf_counter(), meta["wall_s"]
        while step < cfg.rl_steps:
            state, metrics = strategy.run(step_fn, args=(state, next(batches)))
            totals = jax.device_get(strategy.reduce("sum", metrics, axis=None))
            step += 1
            row = {"step": step, "loss": float(totals["loss"])}
            for name in ("reward", "correct", "kl"):
                row[name] = float(totals[name] / totals["count"])
            if step % cfg.eval_every == 0 or step == cfg.rl_steps:
                row["held_out_accuracy"] = held_out_accuracy(
                    cfg, strategy, state.params["policy"], split.held_out
                )[0]
            meta["history"].append(row)
            meta["wall_s"] = wall_before + time.perf_counter() - start
            mgr.save(step, state, data_state=batches.get_state(), metadata=meta,
                     force=step == cfg.rl_steps)  # fmt: skip
            log(
                f"rl {step}/{cfg.rl_steps}: reward {row['reward']:.3f} correct "
                f"{row['correct']:.3f} kl {row['kl']:.4f}"
                + (
                    f" held-out {row['held_out_accuracy']:.3f}"
                    if "held_out_accuracy" in row
                    else ""
                )
            )
    history = meta["history"]
    return Result(
        replicas=n,
        accuracy_before=meta["accuracy_before"],
        accuracy_after=history[-1]["held_out_accuracy"] if history else meta["accuracy_before"],
        history=history,
        wall_s=meta["wall_s"],
        pretrain_wall_s=meta["pretrain_wall_s"],
        pretrain_losses=meta["pretrain_losses"],
        resumed_from=restored.step if restored is not None else None,
        state=state,
    )
