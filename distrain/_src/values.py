"""Distributed values: one component per replica, held as global ``jax.Array``s."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, final

import jax


class PerReplica:
    """A value with one component per replica (``tf.distribute``'s ``PerReplica``).

    ``value`` is a pytree of global arrays whose leading axis is split evenly over the
    replicas, in replica order: replica ``i`` owns rows ``[i*k, (i+1)*k)`` of every leaf.
    Batches from a distributed dataset are such values; so are the per-replica results of
    ``strategy.run``, which add a leading axis of length ``num_replicas_in_sync``
    (``stacked=True``: each replica's component is one row, without that axis).

    Passed to ``strategy.run``, each replica receives its own component.

    As in TensorFlow, a per-replica tuple or list unpacks into per-replica elements
    (``x, y = next(iterator)``) and a per-replica dict or sequence indexes into one
    (``batch["x"]``, ``batch[0]``).

    Example:
      >>> losses = strategy.run(step, args=(state, batch))[1]   # a PerReplica
      >>> strategy.experimental_local_results(losses)           # tuple, one per replica
    """

    __slots__ = ("value", "stacked", "num_replicas")

    def __init__(self, value: Any, num_replicas: int, *, stacked: bool = False) -> None:
        self.value = value
        self.num_replicas = num_replicas
        self.stacked = stacked

    def _part(self, value: Any) -> PerReplica:
        return PerReplica(value, self.num_replicas, stacked=self.stacked)

    def _sequence(self) -> tuple[Any, ...] | list[Any]:
        if not isinstance(self.value, tuple | list):
            raise TypeError(
                "Only a per-replica tuple or list unpacks into per-replica elements "
                f"(x, y = batch). This one holds a {type(self.value).__name__}: "
                + (
                    "index it by key (batch['x'])."
                    if isinstance(self.value, Mapping)
                    else "pass it to strategy.run whole."
                )
            )
        return self.value

    def __iter__(self) -> Iterator[PerReplica]:
        return (self._part(v) for v in self._sequence())

    def __len__(self) -> int:
        return len(self._sequence())

    def __getitem__(self, key: Any) -> PerReplica:
        if not isinstance(self.value, tuple | list | Mapping):
            raise TypeError(
                "Only a per-replica tuple, list or dict can be indexed (batch['x'], "
                f"batch[0]). This one holds a {type(self.value).__name__}: pass it to "
                "strategy.run whole, or see its components with "
                "strategy.experimental_local_results."
            )
        return self._part(self.value[key])

    def __repr__(self) -> str:
        shapes = jax.tree.map(lambda x: tuple(x.shape), self.value)
        kind = "stacked" if self.stacked else "split"
        return f"PerReplica({kind}, num_replicas={self.num_replicas}, shapes={shapes})"


def _flatten(pr: PerReplica) -> tuple[tuple[Any], tuple[int, bool]]:
    return (pr.value,), (pr.num_replicas, pr.stacked)


def _unflatten(aux: tuple[int, bool], children: tuple[Any]) -> PerReplica:
    return PerReplica(children[0], aux[0], stacked=aux[1])


jax.tree_util.register_pytree_node(PerReplica, _flatten, _unflatten)


@final
class PerGroup:
    """A value with one component per group of replicas (DiLoCo's islands): every leaf
    has a leading axis of length ``num_groups``, one row per group.

    Framework-internal: a strategy with replica groups wraps its group-varying state in
    it for ``strategy.run`` (each replica of group ``g`` receives row ``g``, without the
    axis) and a replica function returns it around results identical on the replicas of
    a group (stacked back, one row per group). Users see plain arrays.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"PerGroup({jax.tree.map(lambda x: tuple(getattr(x, 'shape', ())), self.value)})"


jax.tree_util.register_pytree_with_keys(
    PerGroup,
    lambda g: (((jax.tree_util.GetAttrKey("value"), g.value),), None),
    lambda _, children: PerGroup(next(iter(children))),
    lambda g: ((g.value,), None),
)
