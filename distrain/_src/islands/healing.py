"""Healing a joining island from a live peer: the coordinator's relay of one inner
optimizer state.

torchft heals a recovering replica group from a live one (parameters and optimizer
state). Here the parameters a joiner starts from are already the global ones (a live
island holds them too at a round boundary); what a live peer adds is its inner
optimizer state: its moments instead of fresh zeros.

How the state moves, without the coordinator keeping every island's state and without
stalling a live island:

1. a joiner that asks to heal (``join(..., heal=True)``) waits in :attr:`StateRelay.waiting`;
2. the next *seasoned* live island (one whose incarnation has submitted a round, so its
   state is a trained one) to reach a round boundary in which a waiting joiner trains is
   asked (``Round.donate``) and posts the state it starts that round with
   (``IslandCoordinator.donate``): one call, then it trains on;
3. the joiner takes it (``IslandCoordinator.take_state``) before its first step; the
   relay drops it once no joiner of that round waits for it (and when the round closes).

The relay holds at most one island's state at a time. A joiner that no live peer can
serve (none is seasoned, or every one has already started the joiner's round) is told
so at once and starts as without healing (fresh moments, counts continued).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


class Posted(NamedTuple):
    """A live island's inner optimizer state, posted for the joiners of ``round``."""

    donor: int
    round: int
    structure: str  # the donor's optimizer structure (`structure_of`)
    leaves: list[np.ndarray]


class Healing(NamedTuple):
    """What :meth:`IslandCoordinator.take_state` returns: the donor and its state's
    leaves, or ``donor=None`` and why no peer can heal the joiner (it starts fresh)."""

    donor: int | None
    leaves: list[np.ndarray] | None
    why: str


def check_same_optimizer(island: int, peer: int, expected: str, received: str | None) -> None:
    """Refuses healing ``island`` from ``peer`` when their optimizer states differ.

    Raises:
      ValueError: the structures differ (e.g. Adam on one island, SGD on the other).

    Example:
      >>> check_same_optimizer(1, 0, "(EmptyState(),) / ", "(EmptyState(),) / ")
    """
    if received is not None and received != expected:
        raise ValueError(
            f"island {island} cannot heal from island {peer}: their inner optimizer states "
            f"differ. Expected island {peer}'s: {expected}; received island {island}'s: "
            f"{received}. Give every island the same optimizer, or pass heal_from_peer=False."
        )


@dataclasses.dataclass
class StateRelay:
    """The joiners waiting for a peer's state, the donor asked, and the one state posted.

    Every method is called under the coordinator's lock.

    Example:
      >>> relay = StateRelay()
      >>> relay.want(1, "s")
      >>> relay.ask(0, joiners=[1])
      True
      >>> relay.post(Posted(0, 4, "s", [np.zeros(2)]))
      True
      >>> relay.take(1, 4).donor
      0
      >>> relay.posted is None  # taken by the last joiner that waited for it
      True
    """

    waiting: dict[int, str | None] = dataclasses.field(default_factory=dict)
    asked: int | None = None
    posted: Posted | None = None

    def want(self, island: int, structure: str | None) -> None:
        """``island`` joined asking for a peer's state (its own optimizer ``structure``)."""
        self.waiting[island] = structure

    def forget(self, island: int) -> None:
        """``island`` died, left or joined again: it neither waits nor is asked."""
        self.waiting.pop(island, None)
        if self.asked == island:
            self.asked = None
        if not self.waiting:
            self.posted = None  # nobody left to take it

    def ask(self, island: int, joiners: list[int]) -> bool:
        """Whether ``island``, at the boundary of a round the waiting ``joiners`` train,
        is to post its state: yes if none is posted or asked for already."""
        if not joiners or island in self.waiting or self.asked is not None:
            return False
        if self.posted is not None:
            return False
        self.asked = island
        return True

    def post(self, posted: Posted) -> bool:
        """Keeps the state the asked donor posted; False if nobody waits for it any more."""
        if self.asked != posted.donor:
            return False
        self.asked = None
        if not self.waiting:
            return False
        self.posted = posted
        return True

    def take(self, island: int, round_: int | None) -> Healing | None:
        """The posted state for ``island``, which starts ``round_`` (None: any round, in
        the asynchronous mode); None if none is."""
        posted = self.posted
        if posted is None or (round_ is not None and posted.round != round_):
            return None
        check_same_optimizer(island, posted.donor, posted.structure, self.waiting.get(island))
        self.waiting.pop(island, None)
        if not self.waiting:
            self.posted = None  # one island's state at a time, and only while needed
        return Healing(posted.donor, posted.leaves, f"healed from island {posted.donor}")

    def drop_before(self, round_: int) -> None:
        """A round closed: a state posted for an earlier one serves nobody."""
        if self.posted is not None and self.posted.round < round_:
            self.posted = None

    def held_bytes(self) -> int:
        """The bytes of the state held (for ``status``)."""
        return 0 if self.posted is None else sum(int(x.nbytes) for x in self.posted.leaves)
