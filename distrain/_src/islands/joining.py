"""An island (re)joining the run: the state it trains from, healed from a live peer or
fresh, with its optimizer's counts continued.

A joining island (a restarted process, or one the coordinator declared dead) starts its
round from the global parameters. Its inner optimizer state is, with
``heal_from_peer=True``, a live island's (torchft's healing; how it moves is in
``healing.py``), else the initial one; either way the step and every count optax keeps
go on at ``round x sync_every`` (:func:`joined_state`), so that learning-rate schedules
continue where its peers are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from distrain._src.islands.healing import Healing
from distrain._src.islands.islands_config import structure_of


class Joiner:
    """This island's side of joining: the optimizer structure it declares, the state it
    starts each incarnation from, and the state it gives a joiner when asked.

    Args:
      state: the initial train state (its ``opt_state``, if any, is what heals).
      heal: ask the coordinator for a live peer's inner optimizer state at each join.
      sync_every: H (the counts go on at ``round x H``).
      log: the island's timeline (``log(event, **fields)``).

    Example (in :func:`island.train`)::

        joiner = Joiner(state, heal=True, sync_every=H, log=log)
        token, done = coord("join", island, structure, joiner.structure, joiner.heal)
        start = joiner.start(coord, island, token, r, params)
    """

    def __init__(self, state: Any, heal: bool, sync_every: int, log: Callable[..., None]) -> None:
        opt_state = getattr(state, "opt_state", None)
        self.initial = state
        self.sync_every = sync_every
        self.log = log
        self.heal = bool(heal) and opt_state is not None
        self.structure: str | None = None
        self.leaves: list[np.ndarray] | None = None  # the initial state's, on the host
        if opt_state is not None:
            leaves, self.treedef = jax.tree.flatten(opt_state)
            self.leaves = [np.asarray(x) for x in leaves]
            self.structure = structure_of(self.leaves, str(self.treedef))

    def start(self, coord: Any, island: int, token: str, r: int, params: Any, until: float) -> Any:
        """The state this incarnation trains round ``r`` from (see :func:`joined_state`):
        with healing, a live peer's optimizer state (polled from ``coord``), else (no
        peer can give one: said in one line) the initial one.

        Raises:
          ValueError: the peer's optimizer state is unlike this island's.
        """
        t0 = time.time()
        healing = coord.poll("take_state", island, token, r, until=until) if self.heal else None
        return self.begin(healing, island, r, params, time.time() - t0)

    def begin(
        self, healing: Healing | None, island: int, r: int, params: Any, wait_s: float = 0.0
    ) -> Any:
        """:meth:`start` with the coordinator's answer to ``take_state`` already in hand
        (``healing``; None without healing): an island of several processes receives it
        from its process 0 (``island_link.Link.take_state``).

        Raises:
          ValueError: the peer's optimizer state is unlike this island's.
        """
        step, opt_state, donor = r * self.sync_every, None, None
        if healing is not None:
            # Round 0: every island starts fresh. No reason: another process of the island
            # (its process 0 says it).
            if healing.donor is None and r and healing.why:
                print(
                    f"island {island}: no live peer to heal from ({healing.why}); round {r} "
                    "starts with fresh optimizer moments, counts continued",
                    flush=True,
                )
            elif healing.donor is not None:
                opt_state = self._unflatten(healing.leaves, island, healing.donor)
                donor = healing.donor
            self.log("heal", round=r, donor=donor, why=healing.why, wait_s=wait_s)
        joined = joined_state(self.initial, params, step, opt_state)
        counts = optimizer_counts(getattr(joined, "opt_state", None))
        self.log("joined_state", round=r, step=step, counts=counts, healed_from=donor)
        return joined

    def check(self, healing: Healing, island: int) -> None:
        """Refuses a peer's optimizer state unlike this island's (the tree, and each
        leaf's shape and dtype): before the island takes it, or broadcasts it.

        Raises:
          ValueError: the structures differ.
        """
        if healing.donor is not None and healing.leaves is not None:
            self._unflatten(healing.leaves, island, healing.donor)

    def _unflatten(self, leaves: Any, island: int, donor: int) -> Any:
        received = structure_of(leaves, str(self.treedef))
        if received != self.structure:  # the tree, and each leaf's shape and dtype
            raise ValueError(
                f"island {island} cannot heal from island {donor}: their inner optimizer "
                f"states differ. Expected this island's: {self.structure}; received island "
                f"{donor}'s leaves: {received}. Give every island the same optimizer, or "
                "pass heal_from_peer=False."
            )
        return jax.tree.unflatten(self.treedef, leaves)

    @staticmethod
    def donation(
        placed: Any, host: Callable[[Any], list[np.ndarray]] | None = None
    ) -> list[np.ndarray]:
        """The inner optimizer state of ``placed`` (the island's state on its devices),
        on the host: what a live island posts for a joiner. ``host`` copies it there
        (``island_loop.host_leaves``: a collective when the island has several
        processes); default ``jax.device_get``."""
        opt_state = getattr(placed, "opt_state", None)
        if host is not None:
            return host(opt_state)
        return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(opt_state))]


def joined_state(initial: Any, params: Any, step: int, opt_state: Any = None) -> Any:
    """The state an island trains from after it (re)joins in the round that starts at
    inner step ``step``: the global ``params``; ``step`` as its step; and the optimizer
    state ``opt_state`` (a live peer's, when it heals) or else the *initial* state's (a
    new process has no other), with every count optax keeps set to ``step``.

    optax reads a schedule's step from the optimizer state (``ScaleByScheduleState``,
    ``inject_hyperparams``' states), not from ``state.step``, and Adam's bias correction
    from its own count: each is continued, so the island's first update uses the
    learning rate of step ``step``, as its live peers do. The moments are the peer's,
    or the initial ones. Every leaf named ``count`` in a NamedTuple or dataclass of the
    optimizer state is set, however nested (chains, ``masked``, ``inject_hyperparams``);
    a custom transformation's state field named ``count`` is taken for a step count too.

    Raises:
      ValueError: an ``optax.MultiSteps`` state, whose counts are of updates (one per
        k steps), which this state cannot tell.

    Example:
      >>> state = dt.TrainState.create(params={"w": jnp.zeros(2)}, tx=optax.adam(1e-3))
      >>> optimizer_counts(joined_state(state, {"w": jnp.ones(2)}, 40).opt_state)
      [40]
    """
    joined = initial.replace(params=params)
    if opt_state is not None:
        joined = joined.replace(opt_state=opt_state)
    if hasattr(joined, "step"):
        joined = joined.replace(step=np.asarray(step, np.int32))
    if hasattr(joined, "opt_state"):
        leaves = jax.tree_util.tree_leaves_with_path(joined.opt_state)
        if any(_field(path, "gradient_step") for path, _ in leaves):
            raise ValueError(
                f"an island joining at step {step} continues its optimizer's counts, but "
                "optax.MultiSteps counts updates of k steps each, and its state does not "
                "hold k. Expected an optimizer that updates at every step; received a state "
                "with optax.MultiSteps' gradient_step. Accumulate with dt.accumulate_gradients."
            )
        joined = joined.replace(opt_state=_with_counts(joined.opt_state, step))
    return joined


def _field(path: tuple[Any, ...], name: str) -> bool:
    """A leaf that is the field ``name`` of a NamedTuple or a dataclass."""
    return bool(path) and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == name


def _with_counts(opt_state: Any, step: int) -> Any:
    """``opt_state`` with every ``count`` field (a NamedTuple's or a dataclass's) at ``step``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (
            np.full(np.shape(x), step, np.dtype(x.dtype)) if _field(path, "count") else x
        ),
        opt_state,
    )


def optimizer_counts(opt_state: Any) -> list[int]:
    """Every ``count`` in an optimizer state, in pytree order (logged when an island
    joins: the benchmark checks them against ``round x sync_every``)."""
    return [
        int(x)
        for path, x in jax.tree_util.tree_leaves_with_path(opt_state)
        if _field(path, "count")
    ]
