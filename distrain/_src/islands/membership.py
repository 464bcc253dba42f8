"""The islands' membership in the coordinator: tokens, joining, leaving, and healing.

Every call names the island's *token* (from :meth:`Membership.join`): a token the
coordinator does not know (a restarted coordinator, an island declared dead) raises
`RejoinRequired`, and the island joins again from the global state. A joiner that asks
to heal takes a live peer's inner optimizer state through the coordinator's relay
(:meth:`Membership.donate`, :meth:`Membership.take_state`; ``healing.py``).

Example (``coord``: an ``IslandCoordinator``)::

    token, steps = coord.join(0, structure, optimizer, heal=True)
    healing = coord.take_state(0, token, round_)  # None: call again
"""

from __future__ import annotations

import time
import uuid

import numpy as np

from distrain._src.islands.coordinator_state import CoordinatorState
from distrain._src.islands.healing import Healing, Posted, check_same_optimizer
from distrain._src.islands.islands_config import RejoinRequired


class Membership(CoordinatorState):
    """The coordinator's calls that change who is a member, and heal a joiner."""

    def join(
        self, island: int, structure: str, optimizer: str | None = None, heal: bool = False
    ) -> tuple[str, int]:
        """Registers (a new incarnation of) ``island``; returns its token and the inner
        steps of its earlier incarnations that applied rounds kept (its goodput ledger
        counts the rest as lost).

        It is enrolled in the open round if no island leased rows of it yet, else in the
        next one (always the next one if its earlier incarnation submitted in the open
        round); :meth:`wait_round` says when its round opens. It waits for a round's
        save under way. ``optimizer``: the structure of its inner optimizer state;
        ``heal``: it asks for a live peer's state (:meth:`take_state`, ``healing.py``).

        Raises:
          ValueError: another parameter structure, an island id out of range, or
            ``heal`` with an optimizer state unlike a live island's.
          IslandsFailed: the run failed.
        """
        if not 0 <= island < self.config.islands:
            raise ValueError(
                f"island {island} is not one of the {self.config.islands} islands of this run "
                f"(ids 0..{self.config.islands - 1})."
            )
        if structure != self.structure:
            raise ValueError(
                f"island {island} joined with another parameter structure than the "
                f"coordinator's; nothing was applied.\n  coordinator: {self.structure}\n"
                f"  island {island}: {structure}\nEvery island must build the same model "
                "(and a restarted run the model of its checkpoint)."
            )
        with self._cond:
            self._await_save()
            for peer, theirs in self._optimizers.items():  # refused: nothing changes
                if heal and peer != island and theirs is not None:
                    check_same_optimizer(island, peer, theirs, optimizer)
            if island in self._tokens:
                self._declare_dead(island, "it joined again (restarted)")
            self._check_error()
            self._optimizers[island] = optimizer
            if heal:
                self._relay.want(island, optimizer)
            token = uuid.uuid4().hex
            self._tokens[island] = token
            self._heartbeats[island] = self._joined_at[island] = time.time()
            self._dead.pop(island, None)
            short = len(self._members) < self.config.min_islands  # a round that waits
            busy = (self._leased or self._submissions) and not short
            # An earlier incarnation's submission counts in the open round: this one
            # trains the next (leasing the open round again would hold two leases).
            counted = island in self._submissions
            if (busy or counted) and self.config.mode == "sync":
                self._next.add(island)
            else:
                self._members.add(island)
            self._event("join", island=island, round=self.round + (island in self._next))
            self._cond.notify_all()
            return token, self._island_steps.get(island, 0)

    def donate(self, island: int, token: str, round_: int, leaves: list[np.ndarray]) -> bool:
        """``island``'s inner optimizer state at the start of ``round_``, posted because
        :meth:`wait_round` asked (``Round.donate``); False if no joiner waits for it."""
        with self._cond:
            self._check_token(island, token)
            structure = self._optimizers.get(island) or ""
            current = round_ == self.round or self.config.mode == "async"
            kept = current and self._relay.post(
                Posted(island, round_, structure, [np.asarray(x) for x in leaves])
            )
            self._event("donate", island=island, round=round_, kept=kept)
            self._cond.notify_all()
            return kept

    def take_state(
        self, island: int, token: str, round_: int, timeout: float = 2.0
    ) -> Healing | None:
        """A live peer's inner optimizer state for ``island``, which starts ``round_``
        (after ``join(..., heal=True)``). Returns :class:`Healing`: the donor and the
        leaves, or ``donor=None`` and why no live peer can give one (the island starts
        fresh); None if a donor may still post within ``timeout`` s (call again).

        Raises:
          ValueError: the donor's optimizer state is unlike the island's.
        """
        deadline = time.time() + timeout
        with self._cond:
            while True:
                self._check_token(island, token)
                self._check_error()
                synchronous = self.config.mode == "sync"  # async: any peer's boundary
                healing = self._relay.take(island, round_ if synchronous else None)
                if healing is not None:
                    self._event("healed", island=island, round=round_, donor=healing.donor)
                    return healing
                why = self._no_donor(island, round_)
                if why is not None:
                    self._relay.forget(island)
                    self._event("heal_fallback", island=island, round=round_, why=why)
                    return Healing(None, None, why)
                if not self._cond.wait(deadline - time.time()) and time.time() >= deadline:
                    return None

    def leave(self, island: int, token: str) -> None:
        """``island`` finished (every row committed): it stops counting as a member."""
        with self._cond:
            if self._tokens.get(island) == token:
                self._tokens.pop(island)
                self._heartbeats.pop(island, None)
                self._members.discard(island)
                self._next.discard(island)
                self._forget(island)
                self._event("leave", island=island)

    # ------------------------------------------------------------- internals
    def _no_donor(self, island: int, round_: int) -> str | None:
        """Why no live peer can post a state for ``island``'s ``round_``; None while one
        still may (one was asked, or one has not reached that round's boundary yet)."""
        if self._relay.asked in self._tokens:
            return None
        peers = [i for i in self._seasoned if i in self._tokens and i not in self._relay.waiting]
        if not peers:
            return "no live peer has trained a round since it (or the coordinator) started"
        if self.config.mode == "async":
            return None  # the next peer to pull the parameters is asked
        if round_ != self.round or all(self._pulled.get(i, -1) >= round_ for i in peers):
            return f"every live peer had started round {round_} before it could be asked"
        return None

    def _check_token(self, island: int, token: str) -> None:
        if self._tokens.get(island) != token:
            why = self._dead.get(island)
            cause = (
                f"it was declared dead: {why}"
                if why
                else ("it was declared dead, or the coordinator restarted from its checkpoint")
            )
            raise RejoinRequired(
                f"island {island} is not a live member of this coordinator ({cause}): join again."
            )

    def _forget(self, island: int) -> None:
        """``island``'s incarnation ended: it neither heals a joiner nor waits to heal."""
        self._relay.forget(island)
        self._seasoned.discard(island)
        self._optimizers.pop(island, None)
