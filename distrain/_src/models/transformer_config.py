"""The decoder's configuration: :class:`LMConfig`, its shapes and options, checked.

What ``transformer.py`` builds is fixed by one frozen dataclass: the shapes (vocabulary,
sequence, width, depth, heads), the positions, the compute dtype, what each block keeps
for its backward pass (:data:`REMAT_POLICIES`), and the options that change how the
blocks run (pipelined, scanned, mixture of experts). ``__post_init__`` refuses a
configuration the model cannot build, each error naming the fix.

Example:
  >>> cfg = LMConfig(d_model=128, n_layers=4, n_heads=4, seq_len=128)
  >>> cfg.head_dim, cfg.ff
  (32, 512)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from distrain._src.models.moe_block import check_moe_config

__all__ = ["DTYPES", "REMAT_POLICIES", "LMConfig"]

# The compute dtypes by name (parameters stay float32).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# What a block keeps for its backward pass (jax.checkpoint_policies): "none" keeps
# everything (no remat); "offload_dots" keeps matmul outputs in host memory.
REMAT_POLICIES: dict[str, Callable[[], Any] | None] = {
    "none": None,
    "dots_saveable": lambda: jax.checkpoint_policies.dots_saveable,
    "nothing_saveable": lambda: jax.checkpoint_policies.nothing_saveable,
    "offload_dots": lambda: jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"
    ),
}


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """The model's shapes.

    Attributes:
      vocab_size: number of token ids (256 for bytes; 50304 for GPT-2's shapes).
      seq_len: tokens per sequence (the attention span).
      d_model: width of the residual stream.
      n_layers: transformer blocks.
      n_heads: attention heads (``d_model`` must divide by it).
      d_ff: hidden width of the MLP (default ``4 * d_model``).
      positions: ``"rope"`` (rotary, no parameters) or ``"learned"`` (GPT-2's table).
      dtype: compute dtype, ``"float32"`` or ``"bfloat16"`` (parameters stay float32).
      norm_eps: the LayerNorms' epsilon (flax's default 1e-6; GPT-2's checkpoints 1e-5).
      remat: a key of :data:`REMAT_POLICIES`: what each block saves for the backward pass.
      attention: ``dt.nn.dot_product_attention``'s implementation over a split sequence,
        ``"ring"`` or ``"all_gather"`` (``None``: ring); no effect on a whole sequence.
      pipeline_microbatches: ``None``: the blocks are a list; an int ``M``: they are
        stacked and run by ``dt.nn.pipeline`` with ``M`` microbatches.
      pipeline_repeats: ``dt.nn.pipeline``'s ``repeats`` (the circular schedule).
      scan_layers: stack the blocks and run them by one ``jax.lax.scan``: the program
        holds one block, and under ``remat`` its backward pass keeps only each block's
        input whatever the compiler's schedule (unrolled, XLA:CPU keeps every block's
        recomputed temporaries alive: no saving). Layout rules see a leading layer
        dimension (``blocks/...``).
      moe_experts: ``None``: dense MLPs; an int ``E``: mixture-of-experts MLPs of ``E``
        experts of width ``d_ff`` (``dt.nn.moe``).
      moe_top_k: experts per token.
      moe_capacity_factor: ``None``: dropless; a number: ``dt.nn.moe``'s capacity factor.
      moe_capacity_group: ``dt.nn.moe``'s ``capacity_group``: ``"call"`` (the replica's
        tokens) or ``"device"`` (each device's: bounded exchange buffers).
      moe_shared_expert: add a dense expert of width ``d_ff`` every token goes through.
      moe_balance_weight, moe_z_weight: the weights of the load-balancing loss and the
        router z-loss in ``moe_loss`` (Switch Transformer's 0.01; ST-MoE's 0.001).
      moe_balance: ``"loss"`` (the load-balancing loss) or ``"bias"`` (DeepSeek-V3: a
        per-block selection bias, moved by ``moe_bias_rate`` after each step by
        ``update_expert_bias``; no load-balancing loss). See ``moe_block.py``.
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int | None = None
    positions: Literal["rope", "learned"] = "rope"
    dtype: Literal["float32", "bfloat16"] = "float32"
    norm_eps: float = 1e-6
    remat: str = "none"
    attention: Literal["ring", "all_gather"] | None = None
    pipeline_microbatches: int | None = None
    pipeline_repeats: int = 1
    moe_experts: int | None = None
    moe_top_k: int = 2
    moe_capacity_factor: float | None = None
    moe_capacity_group: Literal["call", "device"] = "call"
    moe_shared_expert: bool = False
    moe_balance_weight: float = 0.01
    moe_z_weight: float = 0.001
    moe_balance: Literal["loss", "bias"] = "loss"
    moe_bias_rate: float = 1e-3
    scan_layers: bool = False

    def __post_init__(self) -> None:
        names = ["vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "pipeline_repeats"]
        if self.pipeline_microbatches is not None:
            names.append("pipeline_microbatches")
        for name in names:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LMConfig.{name} must be a positive int. Received: {v!r}.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"LMConfig.d_model ({self.d_model}) must be a multiple of n_heads "
                f"({self.n_heads}); choose n_heads among its divisors."
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(
                f"Rotary positions need an even head size; d_model / n_heads = {self.head_dim}. "
                "Change d_model or n_heads, or use positions='learned'."
            )
        if self.positions not in ("rope", "learned"):
            raise ValueError(
                f"LMConfig.positions must be 'rope' or 'learned'. Received: {self.positions!r}."
            )
        if isinstance(self.norm_eps, bool) or not (
            isinstance(self.norm_eps, int | float) and self.norm_eps > 0
        ):
            raise ValueError(
                f"LMConfig.norm_eps must be a number > 0. Received: {self.norm_eps!r}."
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"LMConfig.remat must be one of {list(REMAT_POLICIES)}. Received: {self.remat!r}."
            )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"LMConfig.dtype must be one of {sorted(DTYPES)}. Received: {self.dtype!r}."
            )
        if self.moe_experts is not None:
            check_moe_config(self)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ff(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model
