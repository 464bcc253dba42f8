"""How the decoder's parameters and hidden states are laid out on a replica's mesh.

Rules for ``layout=`` (``dt.MirroredStrategy(..., layout=...)``): Megatron-style tensor
parallelism (:data:`TENSOR_PARALLEL_LAYOUT`), experts over an ``"expert"`` axis
(:data:`EXPERT_LAYOUT`), the stacked blocks of a pipelined model over ``"stage"``
(:func:`pipeline_layout`); and :func:`constrain_hidden`, the hidden states' layout
between blocks, which ``transformer.py``, ``llama.py`` and ``mixtral.py`` apply.

Example:
  >>> strategy = dt.MirroredStrategy(devices_per_replica={"fsdp": 2, "tensor": 2},
  ...                                layout=TENSOR_PARALLEL_LAYOUT)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
from jax.sharding import PartitionSpec as P

__all__ = ["EXPERT_LAYOUT", "TENSOR_PARALLEL_LAYOUT", "constrain_hidden", "pipeline_layout"]


def constrain_hidden(x: jax.Array) -> jax.Array:
    """Hidden states ``[B, T, D]`` laid out as Megatron does when the step runs on a
    replica mesh with an ``"fsdp"`` axis: rows split over it (and over ``"expert"``, a
    data axis for all but the experts, when the rows divide), whole over ``"tensor"``
    (every tensor-parallel device needs the whole hidden state of its rows), the
    sequence split over ``"context"`` if the replica has it. A no-op elsewhere (one
    device, data parallelism, plain ``jax.jit``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "fsdp" not in mesh.axis_names or x.shape[0] % mesh.shape["fsdp"]:
        return x
    rows = tuple(a for a in mesh.axis_names if a in ("fsdp", "expert"))  # the batch's order
    if x.shape[0] % math.prod(mesh.shape[a] for a in rows):
        rows = ("fsdp",)
    seq = "context" if "context" in mesh.axis_names else None
    return jax.lax.with_sharding_constraint(x, P(rows, seq, None))


# Megatron-style tensor parallelism for a replica mesh {"fsdp": F, "tensor": T}: the
# first matmul of each pair split by columns over "tensor", the second by rows, so the
# activations between them stay split and one all-reduce per pair joins them; every
# kernel's other dimension, and the token table, split over "fsdp" (FSDP).
TENSOR_PARALLEL_LAYOUT = {
    "attn/qkv/kernel": P("fsdp", "tensor"),
    "attn/qkv/bias": P("tensor"),
    "attn/out/kernel": P("tensor", "fsdp"),
    "mlp/fc/kernel": P("fsdp", "tensor"),
    "mlp/fc/bias": P("tensor"),
    "mlp/proj/kernel": P("tensor", "fsdp"),
    "embed/embedding": P("tensor", "fsdp"),
}


# The experts of a mixture-of-experts model split over the replica's "expert" axis
# (each device holds moe_experts / X of them); the router and everything else as usual.
EXPERT_LAYOUT = {"mlp/w_in|mlp/w_out": P("expert")}


def pipeline_layout(devices_per_replica: Mapping[str, int]) -> list[tuple[str, P]]:
    """Layout rules for the stacked blocks of a pipelined model (``pipeline_microbatches``)
    on a replica mesh with a ``"stage"`` axis: the layer dimension split over
    ``"stage"`` (each stage holds its own layers) and, where the mesh has ``"fsdp"``,
    each kernel's input dimension over it inside the stage; everything else (embedding,
    final norm) FSDP by default.

    Example:
      >>> dt.MirroredStrategy(devices_per_replica={"stage": 2, "fsdp": 2},
      ...                     layout=pipeline_layout({"stage": 2, "fsdp": 2}))
    """
    kernel = P("stage", "fsdp") if "fsdp" in devices_per_replica else P("stage")
    return [("blocks/.*/kernel", kernel), ("blocks/", P("stage"))]
