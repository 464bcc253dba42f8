"""The LM's mixture-of-experts block: its experts, its statistics, its balancing.

``LMConfig(moe_experts=E)`` replaces each block's MLP by :class:`MoE`: ``E`` GELU experts
through ``dt.nn.moe``. The experts are balanced one of two ways (``moe_balance``):

* ``"loss"`` (Switch Transformer): the step adds ``moe_loss``, the weighted
  load-balancing loss and router z-loss (:func:`moe_aux`), to the training loss;
* ``"bias"`` (DeepSeek-V3, no auxiliary loss): each block holds a per-expert
  ``selection_bias`` ``[E]`` added to the router's scores *to choose* the experts only
  (a chosen expert's output and weight are unchanged); ``moe_loss`` is then the router
  z-loss alone (``moe_balance_weight`` is not used). The bias is state, not a trained
  parameter (its gradient is zero): after each step :func:`update_expert_bias` moves it
  by ``moe_bias_rate`` towards balance from the step's load, averaged over the
  replicas, so every replica keeps the same bias. It lives in ``params``, so it is
  checkpointed, restored and laid out with them.

Example (a train step)::

    (loss, aux), grads = ...                          # apply_fn(..., return_aux=True)
    state = state.apply_gradients(grads=grads)
    state = update_expert_bias(state, aux)            # a no-op unless moe_balance="bias"
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from distrain._src import context
from distrain._src.nn.moe import moe
from distrain._src.nn.moe_routing import update_selection_bias

if TYPE_CHECKING:
    from distrain._src.models.transformer_config import LMConfig

__all__ = ["MoE", "check_moe_config", "moe_aux", "update_expert_bias"]

BALANCES = ("loss", "bias")


class MoE(nnx.Module):
    """``moe_experts`` GELU experts (``d_model -> d_ff -> d_model``), ``moe_top_k`` per
    token, through ``dt.nn.moe``; returns ``(y, statistics)``. ``shared`` builds the
    optional dense expert every token goes through (after the experts: the parameters'
    initialisation order is the same with and without it)."""

    def __init__(
        self,
        cfg: LMConfig,
        *,
        rngs: nnx.Rngs,
        shared: Callable[[], nnx.Module] | None = None,
    ) -> None:
        e, d, f = cfg.moe_experts or 1, cfg.d_model, cfg.ff
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layers))
        self.cfg = cfg
        self.router = nnx.Param(init(rngs.params(), (d, e)))
        self.w_in = nnx.Param(init(rngs.params(), (e, d, f)))
        self.w_out = nnx.Param(out_init(rngs.params(), (e, f, d)))
        self.shared = shared() if shared is not None else None
        if cfg.moe_balance == "bias":  # state, moved by update_expert_bias: starts neutral
            self.selection_bias = nnx.Param(jnp.zeros((e,), jnp.float32))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        cfg = self.cfg
        params = {"router": self.router[...], "w_in": self.w_in[...], "w_out": self.w_out[...]}
        if cfg.moe_balance == "bias":
            params["selection_bias"] = self.selection_bias[...]
        y, stats = moe(
            x,
            params,
            top_k=cfg.moe_top_k,
            capacity_factor=cfg.moe_capacity_factor,
            capacity_group=cfg.moe_capacity_group,
        )
        if self.shared is not None:
            y = y + self.shared(x)
        if cfg.moe_balance == "bias":  # the bias this step chose with: the update's start
            stats = {**stats, "selection_bias": jax.lax.stop_gradient(params["selection_bias"])}
        return y, stats


def moe_aux(cfg: LMConfig, stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The blocks' routing statistics (``stats``: each ``[n_layers, ...]``) averaged over
    the blocks, and ``moe_loss`` (empty: a dense model). With ``moe_balance="bias"`` also
    ``expert_load_by_block`` and ``selection_bias_by_block`` ``[n_layers, E]`` (the bias
    the step chose with) and ``moe_bias_rate``: what :func:`update_expert_bias` needs."""
    if not stats:
        return {}
    aux = {k: jnp.mean(v, axis=0) for k, v in stats.items() if k != "selection_bias"}
    aux["moe_loss"] = cfg.moe_z_weight * aux["router_z_loss"]
    if cfg.moe_balance == "loss":
        aux["moe_loss"] = aux["moe_loss"] + cfg.moe_balance_weight * aux["load_balancing_loss"]
    else:  # the bias balances: no auxiliary loss (the z-loss only keeps logits small)
        aux["expert_load_by_block"] = jax.lax.stop_gradient(stats["expert_load"])
        aux["selection_bias_by_block"] = stats["selection_bias"]
        aux["moe_bias_rate"] = jnp.float32(cfg.moe_bias_rate)
    return aux


def update_expert_bias(state: Any, aux: dict[str, Any]) -> Any:
    """``state`` with each block's ``selection_bias`` set to the bias the step chose
    with, moved by DeepSeek-V3's rule (``dt.nn.update_selection_bias``) from the step's
    expert load averaged over the replicas (what the optimizer did to it, e.g. weight
    decay, is discarded: it is not a trained parameter); ``state`` itself when ``aux``
    has no load (``moe_balance="loss"``, a dense model).

    Args:
      state: a ``dt.TrainState`` (or anything with ``params`` and ``replace``) whose
        ``params["blocks"][i]["mlp"]["selection_bias"]`` is block ``i``'s bias (with
        ``scan_layers``, ``params["blocks"]["mlp"]["selection_bias"]`` row ``i``).
      aux: the model's auxiliary outputs of this step (``return_aux=True``).

    Raises:
      ValueError: a load for a number of blocks the parameters do not have.

    Example:
      >>> state = state.apply_gradients(grads=grads)
      >>> state = update_expert_bias(state, aux)
    """
    if "expert_load_by_block" not in aux:
        return state
    load = aux["expert_load_by_block"]
    ctx = context.get_replica_context()
    if ctx is not None:  # one load for all replicas: their biases stay equal
        load = ctx.all_reduce("mean", load)
    blocks = state.params["blocks"]
    rate, chosen = aux["moe_bias_rate"], aux["selection_bias_by_block"]
    if "mlp" in blocks:  # stacked blocks (scan_layers): one [n_layers, E] leaf
        keys: list[Any] = []
        count = blocks["mlp"]["selection_bias"].shape[0]
    else:
        keys = sorted(blocks, key=int)
        count = len(keys)
    if count != load.shape[0]:
        raise ValueError(
            f"update_expert_bias: the step's load is for {load.shape[0]} blocks but "
            f"params['blocks'] has {count}; pass the aux of the same model's apply_fn."
        )
    if not keys:
        mlp = {**blocks["mlp"], "selection_bias": update_selection_bias(chosen, load, rate)}
        return state.replace(params={**state.params, "blocks": {**blocks, "mlp": mlp}})
    new_blocks = dict(blocks)
    for i, key in enumerate(keys):
        bias = update_selection_bias(chosen[i], load[i], rate)
        new_blocks[key] = {**blocks[key], "mlp": {**blocks[key]["mlp"], "selection_bias": bias}}
    return state.replace(params={**state.params, "blocks": new_blocks})


def check_moe_config(cfg: LMConfig) -> None:
    """``LMConfig``'s mixture-of-experts fields, each error naming the fix."""
    e, k = cfg.moe_experts, cfg.moe_top_k
    if isinstance(e, bool) or not isinstance(e, int) or e < 1:
        raise ValueError(f"LMConfig.moe_experts must be a positive int. Received: {e!r}.")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e:
        raise ValueError(
            f"LMConfig.moe_top_k must be an int from 1 to moe_experts ({e}). Received: {k!r}."
        )
    c = cfg.moe_capacity_factor
    if c is not None and not c > 0:
        raise ValueError(
            f"LMConfig.moe_capacity_factor must be > 0 (or None: dropless). Received: {c!r}."
        )
    if cfg.moe_capacity_group not in ("call", "device"):
        raise ValueError(
            "LMConfig.moe_capacity_group must be 'call' or 'device'. "
            f"Received: {cfg.moe_capacity_group!r}."
        )
    if cfg.moe_balance not in BALANCES:
        raise ValueError(
            f"LMConfig.moe_balance must be 'loss' (Switch's auxiliary loss) or 'bias' "
            f"(DeepSeek-V3's selection bias). Received: {cfg.moe_balance!r}."
        )
    rate = cfg.moe_bias_rate
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
        raise ValueError(
            f"LMConfig.moe_bias_rate must be a number > 0 (DeepSeek-V3: 0.001). Received: {rate!r}."
        )
    if cfg.pipeline_microbatches is not None:
        raise ValueError(
            "LMConfig: mixture-of-experts blocks (moe_experts) cannot be pipelined yet "
            "(their statistics would have to leave dt.nn.pipeline's schedule). Use "
            "pipeline_microbatches=None, or a dense model."
        )
