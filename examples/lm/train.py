"""The LM example's steps, sampling and run: one per-replica ``train_step`` everywhere.

``train_step`` / ``eval_step`` have the signature ``distrain train`` binds
(``step(state, batch, *, apply_fn)``), so the same functions run from
``configs/lm_*.yaml`` on the command line, from :func:`train_and_evaluate` (the example,
through ``Trainer.fit``) and from ``benchmarks/lm.py`` (``strategy.run`` and a bare
``jax.jit`` loop).

The loss is the mean over *tokens*: ``dt.compute_average_loss`` of per-token losses
``[B, T]``, divided by the tokens of the global batch (or, on padded evaluation
batches and packed rows, by the real tokens over all replicas, via the ``mask`` column
and the segment ids), so summing gradients over replicas gives the global mean's
gradient on any number of devices.

Two batch formats: ``{"tokens": uint8[B, T + 1]}`` (a window of the byte stream:
inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``) and packed rows
``{"inputs", "targets", "segment_ids", "positions"}`` of ``[B, T]``
(``examples/lm/data.py:pack_documents``; padding has segment id 0 and weight 0). A
mean over tokens does not depend on their order, so rows reordered by
``dt.nn.load_balance`` give the same loss.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import distrain as dt
from distrain.models import (
    LMConfig,
    Transformer,
    count_params,
    flops_per_token,
    make_apply_fn,
    update_expert_bias,
)

ApplyFn = Callable[..., jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Perplexity(dt.metrics.WeightedMean):
    """``exp`` of the mean per-token loss, accumulated as (total, count) like ``Mean``."""

    def compute(self) -> Any:
        mean = self.mean()
        return math.exp(mean) if np.ndim(mean) == 0 and math.isfinite(mean) else np.exp(mean)


def _token_losses(
    params: Any, batch: dict[str, jax.Array], apply_fn: ApplyFn, mask_key: str
) -> tuple[jax.Array, jax.Array | None, dict[str, jax.Array]]:
    """Per-token cross-entropy ``[B, T]``, the token weights (``None``: all count) and
    the model's auxiliary outputs (a mixture of experts' routing statistics; ``{}``)."""
    weights = None
    if "inputs" in batch:  # packed rows: documents kept apart, padding weighs 0
        seg = batch["segment_ids"].astype(jnp.int32)
        logits, aux = apply_fn(
            params,
            batch["inputs"].astype(jnp.int32),
            seg,
            batch["positions"].astype(jnp.int32),
            return_aux=True,
        )
        targets = batch["targets"].astype(jnp.int32)
        weights = (seg > 0).astype(jnp.float32)
    else:
        tokens = batch["tokens"].astype(jnp.int32)  # uint8 rows of seq_len + 1 bytes
        logits, aux = apply_fn(params, tokens[:, :-1], return_aux=True)
        targets = tokens[:, 1:]
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    mask = batch.get(mask_key) if mask_key else None
    if mask is not None:  # padded rows of a partial batch: [B] -> every token of the row
        rows = jnp.broadcast_to(mask.astype(per_token.dtype)[:, None], per_token.shape)
        weights = rows if weights is None else weights * rows
    return per_token, weights, aux


def train_step(
    state: dt.TrainState,
    batch: dict[str, jax.Array],
    *,
    apply_fn: ApplyFn,
    mask_key: str = "mask",
) -> tuple[dt.TrainState, dict[str, Any]]:
    """One per-replica step of next-byte prediction; metrics: ``loss`` (mean per token)
    and, for a mixture of experts, ``moe_balance`` (the load-balancing loss),
    ``moe_dropped`` (the share of choices a capacity dropped) and ``moe_load_cv`` (the
    coefficient of variation of the experts' load), means over the blocks."""

    def loss_fn(params: Any) -> tuple[jax.Array, Any]:
        per_token, weights, aux = _token_losses(params, batch, apply_fn, mask_key)
        if weights is None:
            # Every row has seq_len tokens: the mean of the rows' means is the mean per
            # token, divided by the global batch's rows (no collective; under gradient
            # accumulation by the whole update's rows).
            loss = dt.compute_average_loss(per_token.mean(-1))
        else:  # divide by the real tokens over all replicas (one scalar all-reduce)
            loss = dt.compute_average_loss(per_token, mask=weights)
        if aux:  # each replica's own routing statistics, averaged over the replicas
            loss = loss + dt.scale_regularization_loss(aux["moe_loss"])
        return loss, (per_token, weights, aux)

    grads, (per_token, weights, aux) = jax.grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads)  # gradients summed over replicas
    state = update_expert_bias(state, aux)  # moe_balance="bias": the experts' bias moves
    metrics: dict[str, Any] = {"loss": dt.metrics.Mean.from_values(per_token, mask=weights)}
    if aux:
        load = aux["expert_load"]
        metrics["moe_balance"] = dt.metrics.Mean.from_values(aux["load_balancing_loss"])
        metrics["moe_dropped"] = dt.metrics.Mean.from_values(aux["dropped_fraction"])
        metrics["moe_load_cv"] = dt.metrics.Mean.from_values(jnp.std(load) / jnp.mean(load))
    return state, metrics


def eval_step(
    state: dt.TrainState,
    batch: dict[str, jax.Array],
    *,
    apply_fn: ApplyFn,
    mask_key: str = "mask",
) -> dict[str, Any]:
    """Held-out ``loss`` (mean per token) and ``perplexity``; padded rows do not count."""
    per_token, weights, _ = _token_losses(state.params, batch, apply_fn, mask_key)
    return {
        "loss": dt.metrics.Mean.from_values(per_token, mask=weights),
        "perplexity": Perplexity.from_values(per_token, mask=weights),
    }


# ---------------------------------------------------------------- sampling


def generate(
    model: LMConfig,
    params: Any,
    prompt: bytes,
    *,
    num_bytes: int,
    temperature: float = 0.0,
    key: jax.Array | None = None,
) -> bytes:
    """``prompt`` continued by ``num_bytes`` sampled bytes (``temperature=0``: greedy),
    through ``dt.models.generate``: the prompt once, then one byte per step from a KV
    cache, in one compiled loop. Stops at a document separator (byte 0).

    Raises:
      ValueError: an empty prompt, or prompt + ``num_bytes`` longer than ``seq_len``.
    """
    if not prompt or len(prompt) + num_bytes > model.seq_len:
        raise ValueError(
            f"generate needs 1 <= len(prompt) and len(prompt) + num_bytes <= seq_len "
            f"({model.seq_len}). Received: len(prompt)={len(prompt)}, num_bytes={num_bytes}."
        )
    out = dt.models.generate(
        model,
        params,
        [list(prompt)],
        num_bytes,
        temperature=temperature,
        rng=jax.random.key(0) if key is None else key,
        stop_tokens=(0,),
    )
    new = np.asarray(out.tokens)[0, : int(out.lengths[0])].astype(np.uint8).tobytes()
    return prompt + new.split(b"\x00")[0]


# ---------------------------------------------------------------- the run

# The samples' prompts, in the style of the corpus: the stdlib's Python by default, a
# play's speakers for TinyShakespeare (whose first line is "First Citizen:").
PYTHON_PROMPTS = ("def ", "import ", "class ")
SHAKESPEARE_PROMPTS = ("First Citizen:\n", "ROMEO:\n", "JULIET:\n")


@dataclasses.dataclass
class Settings:
    """The example's run (from a ``configs/lm_*.yaml`` and the command line)."""

    model: LMConfig
    data_fn: str = "examples.lm.data:stdlib_splits"
    data_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    global_batch_size: int = 32
    eval_batch_size: int | None = None
    optimizer: str = "adamw"
    learning_rate: float | None = 3e-3  # None with a schedule
    optimizer_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    schedule: dict[str, Any] | None = None  # the config's optimizer.schedule: {name, kwargs}
    clip_global_norm: float | None = None
    weight_decay_mask: str | None = None  # "ndim >= 2"
    steps: int = 300
    eval_every: int = 50
    log_every: int = 10
    steps_per_execution: int | str = 1
    seed: int = 0
    devices: int | None = None  # None: all local devices
    shard_state: bool = False
    # > 1 (or "process"): a replica spans devices, state FSDP-split over them
    devices_per_replica: Any = 1  # an int, "process" or {axis: size}
    layout: Any = None  # layout rules for a replica mesh (dt.MirroredStrategy's layout)
    # batch_layout of the strategy (a sequence split over "context":
    # {"inputs|targets|segment_ids|positions": P(None, "context")})
    batch_layout: Any = None
    peak_flops: float | None = None  # per device; None: the table's (none on CPU)
    profile: tuple[int, int] | None = None
    prompts: tuple[str, ...] = PYTHON_PROMPTS
    sample_bytes: int = 48
    temperature: float = 0.0


def settings_from_config(path: str, overrides: list[str] | tuple[str, ...] = ()) -> Settings:
    """Reads a ``distrain train`` config (``configs/lm_*.yaml``) into :class:`Settings`."""
    cfg = dt.config.load_config(path, list(overrides))
    if cfg.train.steps is None:
        raise ValueError(
            f"{path}: the LM example counts training in steps; train.steps is null "
            f"(train.epochs={cfg.train.epochs}). Set train.steps (e.g. train.steps=300)."
        )
    return Settings(
        model=LMConfig(**cfg.model.kwargs),
        data_fn=cfg.data.fn,
        data_kwargs=dict(cfg.data.kwargs),
        global_batch_size=cfg.data.global_batch_size,
        eval_batch_size=cfg.data.eval_batch_size,
        optimizer=cfg.optimizer.name,
        learning_rate=None if cfg.optimizer.schedule else cfg.optimizer.learning_rate,
        optimizer_kwargs=dict(cfg.optimizer.kwargs),
        schedule=cfg.optimizer.schedule.model_dump() if cfg.optimizer.schedule else None,
        clip_global_norm=cfg.optimizer.clip_global_norm,
        weight_decay_mask=cfg.optimizer.weight_decay_mask,
        steps=cfg.train.steps,
        log_every=cfg.train.log_every,
        steps_per_execution=cfg.train.steps_per_execution,
        seed=cfg.seed,
        shard_state=cfg.strategy.shard_state,
        devices_per_replica=cfg.strategy.devices_per_replica,
        layout=_layout(cfg.strategy.layout_kwargs()["layout"]),
        batch_layout=cfg.strategy.layout_kwargs()["batch_layout"],
        prompts=SHAKESPEARE_PROMPTS if "tinyshakespeare" in cfg.data.fn else PYTHON_PROMPTS,
    )


def _layout(value: Any) -> Any:
    """Layout rules from a config: specs, or the import path of rules kept in code."""
    if isinstance(value, str):
        module, _, name = value.partition(":")
        return getattr(importlib.import_module(module), name)
    return value


def make_optimizer(s: Settings) -> optax.GradientTransformation:
    """The optimizer as ``distrain train`` builds it from the same config section
    (``dt.config.build_optimizer``: a schedule, gradient clipping, a weight-decay mask).

    Raises:
      ValueError: both ``learning_rate`` and ``schedule`` set, or neither.
    """
    if (s.learning_rate is None) == (s.schedule is None):
        raise ValueError(
            "Settings needs exactly one of learning_rate and schedule. Received: "
            f"learning_rate={s.learning_rate!r}, schedule={s.schedule!r}."
        )
    section: dict[str, Any] = {
        "name": s.optimizer,
        "kwargs": s.optimizer_kwargs,
        "clip_global_norm": s.clip_global_norm,
        "weight_decay_mask": s.weight_decay_mask,
    }
    if s.schedule is not None:
        section["schedule"] = s.schedule
    else:
        section["learning_rate"] = s.learning_rate
    cfg = dt.config.OptimizerConfig.model_validate(section)
    return dt.config.build_optimizer(cfg, run_steps=s.steps)[0]


def init_state(s: Settings) -> tuple[ApplyFn, dt.TrainState]:
    """``(apply_fn, state)``: the model split once, its params a pure dict in the state."""
    graphdef, params = nnx.split(Transformer(s.model, rngs=nnx.Rngs(s.seed)))
    state = dt.TrainState.create(params=nnx.to_pure_dict(params), tx=make_optimizer(s))
    return make_apply_fn(graphdef), state


def load_splits(s: Settings) -> dict[str, dict[str, np.ndarray]]:
    kwargs = dict(s.data_kwargs)
    if kwargs.setdefault("seq_len", s.model.seq_len) != s.model.seq_len:
        raise ValueError(
            f"data seq_len ({kwargs['seq_len']}) differs from the model's seq_len "
            f"({s.model.seq_len}); the rows must hold seq_len + 1 tokens of the model. Set both "
            "to the same value."
        )
    return dt.config.resolve_callable(s.data_fn, "data.fn")(**kwargs)


def make_strategy(s: Settings) -> dt.Strategy:
    devices = jax.devices() if s.devices is None else jax.devices()[: s.devices]
    if s.devices is not None and len(devices) < s.devices:
        raise ValueError(
            f"devices={s.devices} asks for more devices than JAX has "
            f"({jax.device_count()}); use {jax.device_count()} or fewer."
        )
    return dt.MirroredStrategy(
        devices,
        shard_state=s.shard_state,
        devices_per_replica=s.devices_per_replica,
        layout=s.layout,
        batch_layout=s.batch_layout,
    )


def evaluation_interval(s: Settings) -> int:
    """Steps between held-out evaluations (one Trainer epoch each): ``eval_every``, at
    most the run's steps, so that a short run's progress bar counts to its own end
    (``--steps 20`` showed ``20/50``)."""
    return min(s.eval_every, s.steps)


def train_and_evaluate(
    s: Settings,
    *,
    workdir: str | os.PathLike[str] | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    splits: dict[str, dict[str, np.ndarray]] | None = None,
    strategy: dt.Strategy | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Trains with ``Trainer.fit``; evaluates, samples and (with ``out_dir``) plots.

    Every ``eval_every`` steps is one Trainer "epoch": the held-out split is evaluated
    after it (the learning curve). With ``workdir``, ``BackupAndRestore`` backs up
    every ``eval_every`` steps into ``workdir/backup`` (run the same command again
    after a crash: it resumes exactly) and ``ModelCheckpoint`` keeps the last model in
    ``workdir/checkpoints``.

    Returns a JSON-ready dict: history, initial and final held-out loss, throughput,
    samples, hardware and time.
    """
    strategy = strategy or make_strategy(s)
    n = strategy.num_replicas_in_sync
    every = evaluation_interval(s)
    splits = splits if splits is not None else load_splits(s)
    apply_fn, state = init_state(s)
    cfg = s.model
    n_params = count_params(cfg)
    fpt = flops_per_token(cfg)
    rows = {k: len(next(iter(v.values()))) for k, v in splits.items()}
    log(
        f"model: {n_params['total']:,} parameters, {fpt / 1e6:.2f} MFLOPs/token; "
        f"{n} replica{'s' * (n > 1)} "
        f"on {jax.devices()[0].device_kind}; train {rows['train']:,} x {cfg.seq_len} tokens, "
        f"held-out {rows['test']:,} sequences"
    )
    train = dt.data.ArrayPipeline(
        splits["train"], global_batch_size=s.global_batch_size, seed=s.seed, num_epochs=None
    )
    test = dt.data.ArrayPipeline(
        splits["test"],
        global_batch_size=s.eval_batch_size or s.global_batch_size,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        mask_key="mask",
    )
    throughput = dt.callbacks.Throughput(
        s.global_batch_size,
        tokens_per_example=cfg.seq_len,
        flops_per_token=fpt,
        peak_flops_per_device=s.peak_flops if s.peak_flops is not None else "auto",
    )
    callbacks: list[dt.callbacks.Callback] = [throughput]
    if progress:
        callbacks.append(dt.callbacks.ProgressBar())
    if workdir is not None:
        callbacks += [
            dt.callbacks.BackupAndRestore(os.path.join(workdir, "backup"), save_freq=every),
            dt.callbacks.ModelCheckpoint(os.path.join(workdir, "checkpoints"), max_to_keep=1),
        ]
    if s.profile is not None:
        logdir = os.path.join(workdir or out_dir or ".", "profile")
        callbacks.append(dt.callbacks.ProfilerWindow(*s.profile, logdir))
    bound = functools.partial(train_step, apply_fn=apply_fn)
    trainer = dt.Trainer(
        strategy,
        bound,
        functools.partial(eval_step, apply_fn=apply_fn),
        callbacks=callbacks,
        log_every=s.log_every,
        steps_per_execution=s.steps_per_execution,
    )
    initial = trainer.evaluate(state, test)
    log(f"step 0: held-out loss {initial['loss']:.4f} (perplexity {initial['perplexity']:.1f})")
    start = time.perf_counter()
    state, history = trainer.fit(
        state,
        train,
        epochs=math.ceil(s.steps / every),
        steps=s.steps,
        steps_per_epoch=every,
        validation_data=test,
    )
    seconds = time.perf_counter() - start
    h = history.history
    steps_at = [min((e + 1) * every, s.steps) for e in range(len(h["loss"]))]
    for step, tl, vl in zip(steps_at, h["loss"], h["val_loss"], strict=True):
        log(f"step {step}: train loss {tl:.4f}  held-out loss {vl:.4f}")
    tp = throughput.summary()
    if tp is not None:
        tokens = f"{s.global_batch_size} x {cfg.seq_len} tokens/step"
        log(f"throughput: {dt.callbacks.format_throughput(tp)} ({tokens})")

    params = jax.device_get(state.params)  # one host copy; sampling runs on one device
    samples = {
        p: generate(
            cfg,
            params,
            p.encode(),
            num_bytes=s.sample_bytes,
            temperature=s.temperature,
            key=jax.random.key(s.seed),
        ).decode("utf-8", errors="replace")
        for p in s.prompts
        if len(p) + s.sample_bytes <= cfg.seq_len
    }
    for text in samples.values():
        log(f"sample: {text!r}")
    result = {
        "model": dataclasses.asdict(cfg),
        "parameters": n_params["total"],
        "flops_per_token": fpt,
        "replicas": n,
        "device": jax.devices()[0].device_kind,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "global_batch_size": s.global_batch_size,
        "steps": trainer.loop.global_step,
        "tokens_seen": trainer.loop.global_step * s.global_batch_size * cfg.seq_len,
        "seconds": seconds,
        "initial_val_loss": initial["loss"],
        "final_val_loss": h["val_loss"][-1],
        "final_val_perplexity": h["val_perplexity"][-1],
        "curve": {"step": steps_at, "loss": h["loss"], "val_loss": h["val_loss"]},
        "throughput": tp,
        "samples": samples,
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        plot_curve(result, out / "learning_curve.png")
    result["state"] = state
    return result


def plot_curve(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Train and held-out loss (nats per byte) against steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result["curve"]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot([0, *c["step"]], [result["initial_val_loss"], *c["val_loss"]], "o-", label="held-out")
    ax.plot(c["step"], c["loss"], "s--", label="train (mean over the interval)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    m = result["model"]
    ax.set_title(
        f"{result['parameters'] / 1e6:.2f}M-param byte LM, {m['n_layers']} layers, "
        f"seq {m['seq_len']}, {result['replicas']} replica(s)",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
