"""``dt.ReplicaLayout``: where a strategy's values live, as one immutable object.

A strategy is two things: *where* values live (this module) and *what runs* (the
tf.distribute surface of ``base.py``, compiled by ``_compiler.py``). The layout owns the
mesh ``(*group axes, "replica", *inner axes)``, the state's shardings (replicated, split
over a replica's devices by ``layout.py``'s rules, split over the replicas with
``shard_state``, or on one device: central storage), the batches' shardings (rows over
the replicas and a replica's devices, ``batch_layout.py``'s rules beyond the rows), and
placing concrete, abstract and dataset values there. It is built once from the layout
keywords every strategy takes; ``data/``, ``train/`` and ``distrain plan`` use its
public methods.

Example:
  >>> layout = dt.ReplicaLayout(jax.devices(), devices_per_replica={"fsdp": 4})
  >>> layout.num_replicas, layout.mesh.axis_names                   # 8 devices
  (2, ('replica', 'fsdp'))
  >>> layout.state_sharding((1024, 512), "dense/kernel").spec
  PartitionSpec('fsdp',)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, final

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distrain._src.data.batches import batch_size
from distrain._src.data.options import per_replica_size
from distrain._src.strategy import layout as _layout
from distrain._src.strategy import replica_mesh, sharded
from distrain._src.strategy import rules as _rules
from distrain._src.strategy.batch_layout import BatchLayout

REPLICA_AXIS = "replica"


def is_abstract(tree: Any) -> bool:
    """Whether ``tree`` has leaves and all are ``jax.ShapeDtypeStruct`` (nothing allocated)."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def _unaliased(x: Any, sharding: jax.sharding.Sharding) -> Any:
    """``x``, copied where it is if placing it with ``sharding`` would reuse its buffers.

    ``jax.device_put`` keeps a JAX array's buffer on every target device that holds
    one (``may_alias=False`` does not prevent it when the array is replicated to more
    devices, jax 0.10-0.12), so donating the placed array would delete the caller's.
    """
    if isinstance(x, jax.Array) and not x.sharding.device_set.isdisjoint(sharding.device_set):
        return jnp.copy(x)
    return x


@final
class ReplicaLayout:
    """The mesh of a strategy's replicas and where its state and batches live.

    Args:
      devices: the devices, in replica order.
      devices_per_replica: the devices of one replica: an int ``k`` (one inner axis
        ``"model"``), ``"process"``, or named inner axes such as
        ``{"fsdp": 4, "tensor": 2}`` (``replica_mesh.py``). 1: a replica per device.
      layout: with inner axes, rules ``{path pattern: PartitionSpec}`` or a pytree of
        specs (``layout.py``); other leaves are split FSDP-style.
      logical_axis_rules: ``{logical name: inner axis or None}``.
      batch_layout: with inner axes, ``{batch leaf pattern: PartitionSpec}``.
      min_shard_bytes: leaves below this size stay replicated.
      shard_state: split large state leaves over the replicas between steps (``True``)
        or over each process's devices (``"process"``; ``sharded.py``).
      replica_groups: ``(axis name, g)``: ``g`` equal groups of replicas on an outer
        mesh axis (DiLoCo's islands).
      state_device: state lives whole on this device instead (central storage).

    Raises:
      ValueError: layout keywords without inner axes, ``shard_state`` with inner axes,
        and the errors of ``devices_per_replica``, the rules and ``min_shard_bytes``.
    """

    def __init__(
        self,
        devices: Sequence[jax.Device],
        *,
        devices_per_replica: replica_mesh.DevicesPerReplica = 1,
        layout: _rules.LayoutRules | None = None,
        logical_axis_rules: _rules.LogicalAxisRules | None = None,
        batch_layout: _rules.LayoutRules | None = None,
        min_shard_bytes: int = sharded.DEFAULT_MIN_SHARD_BYTES,
        shard_state: bool | Literal["process"] = False,
        replica_groups: tuple[str, int] | None = None,
        state_device: jax.Device | None = None,
    ) -> None:
        self._devices = tuple(devices)
        axis = REPLICA_AXIS
        inner = replica_mesh.resolve_inner_axes(devices_per_replica, self._devices, axis)
        given = [
            name
            for name, v in (
                ("layout", layout),
                ("logical_axis_rules", logical_axis_rules),
                ("batch_layout", batch_layout),
            )
            if v is not None
        ]
        if given and not inner:
            raise ValueError(
                f"`{given[0]}` lays values out over the devices of a replica, so it needs "
                "devices_per_replica > 1 or named inner axes. Received: "
                f"{given[0]} with devices_per_replica=1."
            )
        min_shard_bytes = sharded.check_min_shard_bytes(min_shard_bytes)
        sharded.check_shard_state(shard_state)
        k = math.prod(inner.values())
        if shard_state and inner:
            raise ValueError(
                "shard_state splits the state over replicas between steps; with "
                f"devices_per_replica={k} each replica already keeps it split over its "
                "devices, inside every step too. Use one of them "
                f"(Received: shard_state={shard_state!r})."
            )
        self._inner = inner
        self._per_replica = k
        # The axes a replica's index runs over: the replica axis, after the group axis
        # when there are groups. Batches and per-replica results split over all of them.
        self._group_axes: tuple[str, ...] = () if replica_groups is None else (replica_groups[0],)
        self._replica_axes = (*self._group_axes, axis)
        rep: str | tuple[str, ...] = self._replica_axes if self._group_axes else axis
        self._mesh = replica_mesh.replica_mesh(self._devices, inner, axis, replica_groups)
        self._spans_processes = replica_mesh.spans_processes(self._devices, k)
        self._replicated = NamedSharding(self._mesh, P())
        # Stacked per-replica results: one row per replica, whole on each of its devices.
        self._stacked = NamedSharding(self._mesh, P(rep))
        self._state_device = state_device
        # Where state lives: whole on every device (None), or a Layout over the inner
        # axes, or over the replicas (shard_state).
        self._rules: _layout.Layout | None = None
        # One table of names for the state's and the batches' specs: a logical name
        # either uses counts as used.
        names = _rules.Names(tuple(inner), logical_axis_rules) if inner else None
        if inner:
            fsdp = _layout.FSDP_AXIS if _layout.FSDP_AXIS in inner else next(iter(inner))
            self._rules = _layout.Layout(self._mesh, fsdp, layout, min_shard_bytes, names=names)
        elif shard_state:
            mesh = (
                sharded.within_processes(self._devices, axis)
                if shard_state == "process"
                else self._mesh
            )
            self._rules = _layout.Layout(mesh, axis, None, min_shard_bytes)
        # Global batches: replica i's rows, split over replica i's devices (in mesh
        # order, so each process's devices hold a contiguous block of rows), whole over
        # the model axes of its layout ("tensor": replica_mesh.row_axes).
        model_axes = self._rules.model_axes if inner and self._rules else frozenset()
        self._row_axes = replica_mesh.row_axes(self._mesh, self._replica_axes, model_axes)
        self._split = NamedSharding(
            self._mesh, P((*self._replica_axes, *self._row_axes) if inner else rep)
        )
        self._batch_layout = (
            None
            if batch_layout is None
            else BatchLayout(
                self._mesh, self._replica_axes, batch_layout, row_axes=self._row_axes, names=names
            )
        )

    # ------------------------------------------------------------------ the mesh
    @property
    def mesh(self) -> Mesh:
        """``("replica", *inner axes)``, after the group axis when there are groups."""
        return self._mesh

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self._devices

    @property
    def inner_axes(self) -> dict[str, int]:
        """A replica's named mesh, ``{axis: size}`` (empty: one replica per device)."""
        return dict(self._inner)

    @property
    def devices_per_replica(self) -> int:
        return self._per_replica

    @property
    def num_replicas(self) -> int:
        return len(self._devices) // self._per_replica

    @property
    def group_axes(self) -> tuple[str, ...]:
        """The outer axis of replica groups (DiLoCo's ``("island",)``), or ``()``."""
        return self._group_axes

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The axes a replica's index runs over: ``(*group_axes, "replica")``."""
        return self._replica_axes

    @property
    def replicated(self) -> NamedSharding:
        """Whole on every device of the mesh."""
        return self._replicated

    @property
    def stacked(self) -> NamedSharding:
        """One row per replica, whole on each of its devices (per-replica results)."""
        return self._stacked

    @property
    def spans_processes(self) -> bool:
        """Whether a replica's devices belong to several processes."""
        return self._spans_processes

    @property
    def rules(self) -> _layout.Layout | None:
        """The state's layout over a replica's devices (or over the replicas with
        ``shard_state``), None when state is whole on every device."""
        return self._rules

    def replica_devices(self, replica_id: int) -> tuple[jax.Device, ...]:
        """The devices of replica ``replica_id`` (neighbours, in mesh order)."""
        k = self._per_replica
        return self._devices[replica_id * k : (replica_id + 1) * k]

    def local_replicas(self) -> list[tuple[int, tuple[jax.Device, ...]]]:
        """``(replica id, its devices here)`` for the replicas with a device in this
        process (a replica that spans processes is local to each of them)."""
        here = jax.process_index()
        out = []
        for i in range(self.num_replicas):
            local = tuple(d for d in self.replica_devices(i) if d.process_index == here)
            if local:
                out.append((i, local))
        return out

    def mesh_context(self) -> AbstractContextManager[Any]:
        """Where a replica function is traced: its named mesh is the context mesh, so
        ``with_sharding_constraint`` with inner axis names lays out activations and
        framework ops (``dt.nn``) find their axes. The replica axes are manual there,
        except for a single replica, whose program is plain GSPMD."""
        if not self._inner:
            return contextlib.nullcontext()
        abstract = self._mesh.abstract_mesh
        if self.num_replicas > 1:
            abstract = abstract.update_axis_types({a: AxisType.Manual for a in self._replica_axes})
        return jax.sharding.use_abstract_mesh(abstract)

    # ------------------------------------------------------------------- state
    def state_sharding(self, shape: tuple[int, ...], path: str = "") -> jax.sharding.Sharding:
        """Where a state leaf of ``shape`` and key path ``path`` lives: whole on every
        device, laid out over a replica's devices, one slice per replica
        (``shard_state``), or on the state device."""
        if self._state_device is not None:
            return jax.sharding.SingleDeviceSharding(self._state_device)
        return self._replicated if self._rules is None else self._rules.sharding(shape, path)

    def state_shardings(self, tree: Any) -> Any:
        """:meth:`state_sharding` for each leaf of ``tree`` (by shape and key path)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: self.state_sharding(np.shape(x), _layout.path_str(path)), tree
        )

    def check_rules_used(self, tree: Any) -> None:
        """Raises when a layout rule matches no leaf of ``tree`` (a typo lays out nothing).

        Raises:
          ValueError: naming the rules that match nothing.
        """
        if self._rules is not None and self._rules.has_rules:
            paths = [_layout.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
            self._rules.check_all_used(paths)

    def place_state(self, tree: Any) -> Any:
        """``tree`` placed where state lives, sharing no buffer with ``tree`` (a step
        may donate it)."""
        shardings = self.state_shardings(tree)
        return jax.device_put(jax.tree.map(_unaliased, tree, shardings), shardings)

    def place_dataset(self, tree: Any) -> Any:
        """A dataset kept on the devices: whole on every device of the mesh, where state
        lives whole (replicas of one device), else replicated. Split like state (FSDP
        over a replica's devices), every step's row gather would all-gather the whole
        dataset: Trainer.fit ran at 0.42x strategy.run at devices_per_replica=8 that
        way."""
        if not self._inner:
            return self.place_state(tree)
        shardings = jax.tree.map(lambda _: self._replicated, tree)
        return jax.device_put(jax.tree.map(_unaliased, tree, shardings), shardings)

    def place_abstract(self, tree: Any) -> Any:
        """``tree`` with each ``jax.ShapeDtypeStruct`` that has no sharding given the
        one :meth:`place_state` would give it (nothing is allocated)."""

        def place(path: Any, x: Any) -> Any:
            if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
                sharding = self.state_sharding(tuple(x.shape), _layout.path_str(path))
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            return x

        return jax.tree_util.tree_map_with_path(place, tree)

    def group_sharding(self, shape: tuple[int, ...], path: str = "") -> NamedSharding:
        """Where a leaf with a row per replica group lives (``shape``: the group axis
        first; DiLoCo's islands' state): split over the group axis, each row laid out as
        :meth:`state_sharding` lays out a state leaf of its shape."""
        inner = self.state_sharding(tuple(shape[1:]), path)
        spec = inner.spec if isinstance(inner, NamedSharding) else P()
        return NamedSharding(self._mesh, P(*self._group_axes, *spec))

    def is_mirrored(self, x: Any) -> bool:
        """Whether ``x`` is an array held identically by every replica (where state
        lives)."""
        if not isinstance(x, jax.Array):
            return False
        if self._inner:  # any layout inside the replicas, none across them
            s = x.sharding
            return (
                isinstance(s, NamedSharding)
                and s.mesh == self._mesh
                and not set(self._replica_axes) & set(jax.tree.leaves(tuple(s.spec)))
            )
        return x.sharding.is_equivalent_to(self.state_sharding(x.shape), x.ndim)

    # ----------------------------------------------------------------- batches
    def batch_sharding(self, rows: int) -> NamedSharding:
        """Where a global batch of ``rows`` rows lives: replica ``i``'s rows on replica
        ``i``, split over its devices when they divide evenly (else whole on each); whole
        over a model axis of the layout (``"tensor"``, ``"stage"``).

        Raises:
          ValueError: a replica spans processes and its rows do not divide over its
            devices (each process feeds only its own devices' rows).
        """
        k = math.prod(self._mesh.shape[a] for a in self._row_axes)
        n = self.num_replicas
        if k == 1 or (rows // n) % k == 0:
            return self._split
        if self._spans_processes:
            raise ValueError(
                f"A replica spans several processes, so its rows split {k} ways over its "
                f"devices (axes {list(self._row_axes)}): the rows per replica "
                f"({rows} // {n} = {rows // n}) must be divisible by {k}. Use a global "
                f"batch size divisible by {k * n}."
            )
        return self._stacked

    def batch_shardings(
        self, leaves: Sequence[Any], treedef: Any, rows: int, layout: bool = True
    ) -> list[Any]:
        """One sharding per leaf of a global batch of ``rows`` rows (:meth:`batch_sharding`,
        or with ``layout`` the leaf's ``batch_layout`` rule)."""
        base = self.batch_sharding(rows)
        if self._batch_layout is None or not layout:
            return [base] * len(leaves)
        paths = [
            _layout.path_str(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(treedef.unflatten(leaves))[0]
        ]
        shapes = [tuple(np.shape(x)) for x in leaves]
        return self._batch_layout.shardings(paths, shapes, rows, base)

    def abstract_batch(self, batch: Any) -> Any | None:
        """A global batch of ``jax.ShapeDtypeStruct`` leaves with the shardings a real
        one gets (for ``memory_analysis``: nothing allocated); None for a real batch.

        Raises:
          ValueError: leaves whose rows differ, or rows that do not split over the replicas.
        """
        if not is_abstract(batch):
            return None
        leaves, treedef = jax.tree.flatten(batch)
        rows = batch_size(leaves, treedef)
        per_replica_size(rows, self.num_replicas)
        shardings = self.batch_shardings(leaves, treedef, rows)
        return jax.tree.unflatten(
            treedef,
            [
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                for x, s in zip(leaves, shardings, strict=True)
            ],
        )

    def constrain_batch(self, batch: Any) -> Any:
        """Inside a replica's step: its batch laid out by ``batch_layout`` (for batches
        gathered inside the step from a dataset kept on the devices)."""
        if self._batch_layout is None:
            return batch
        rules = self._batch_layout

        def one(path: Any, x: Any) -> Any:
            spec = rules.spec_inside(_layout.path_str(path), tuple(x.shape))
            return x if spec is None else jax.lax.with_sharding_constraint(x, spec)

        return jax.tree_util.tree_map_with_path(one, batch)

    def __repr__(self) -> str:
        return f"ReplicaLayout(mesh={dict(self._mesh.shape)})"
