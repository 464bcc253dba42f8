"""The row ledger of fault-isolated islands: which rows each island trains, exactly once.

The rows of ``epochs`` passes over a random-access dataset of ``num_rows`` rows form one
stream of *positions* ``0 .. epochs * num_rows - 1``: position ``p`` is row
``permutation(epoch)[p % num_rows]`` of epoch ``p // num_rows`` (a seeded permutation
per epoch, or the identity). An island *leases* positions for a round; when it submits
its pseudo-gradient they become *pending*; when the round is applied they are
*committed*. A lease whose island dies before submitting goes back to the front of the
queue and a later lease trains it. So every position ends in exactly one applied round.

The ledger is plain data (:meth:`state_dict`), saved in the same checkpoint step as the
global parameters: a restored coordinator hands out exactly the positions that the
restored parameters have not seen.

Example:
  >>> ledger = RowLedger(num_rows=10, epochs=1, seed=None)
  >>> ledger.lease(0, 4).tolist(), ledger.lease(1, 4).tolist()
  ([0, 1, 2, 3], [4, 5, 6, 7])
  >>> ledger.give_back(1)           # island 1 died: its 4 rows are trained later
  4
  >>> ledger.submitted(0)            # island 0 submitted its 4 rows ...
  4
  >>> ledger.commit([0]).tolist()    # ... and its round was applied
  [0, 1, 2, 3]
  >>> ledger.lease(0, 4).tolist()   # returned rows first
  [4, 5, 6, 7]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


class RowLedger:
    """Leases, pending submissions and the committed count of a stream of positions.

    Args:
      num_rows: rows of one epoch (the dataset's length).
      epochs: passes over the dataset.
      seed: seeds one permutation per epoch; ``None`` keeps the dataset's order.

    Raises:
      ValueError: ``num_rows`` or ``epochs`` below 1.
    """

    def __init__(self, num_rows: int, epochs: int, seed: int | None) -> None:
        if num_rows < 1 or epochs < 1:
            raise ValueError(
                f"RowLedger needs num_rows >= 1 and epochs >= 1. Received: num_rows={num_rows}, "
                f"epochs={epochs}."
            )
        self.num_rows, self.epochs, self.seed = int(num_rows), int(epochs), seed
        self.total = self.num_rows * self.epochs
        self.next = 0  # the first position never leased
        self.returned: list[int] = []  # given back by dead islands, leased first
        self.outstanding: dict[int, np.ndarray] = {}  # leased, not yet submitted
        self.pending: dict[int, np.ndarray] = {}  # submitted in the open round
        self.committed = 0
        self._perm: tuple[int, np.ndarray] | None = None

    # ------------------------------------------------------------------ leases
    def lease(self, island: int, max_rows: int) -> np.ndarray:
        """Up to ``max_rows`` positions for ``island`` (returned ones first); empty at the
        end of the stream.

        Raises:
          RuntimeError: ``island`` already holds a lease or a pending submission.
        """
        if island in self.outstanding or island in self.pending:
            raise RuntimeError(
                f"island {island} asked for rows while it still holds a lease of this round."
            )
        take = self.returned[:max_rows]
        self.returned = self.returned[len(take) :]
        fresh = min(max_rows - len(take), self.total - self.next)
        positions = np.concatenate(
            [np.asarray(take, np.int64), np.arange(self.next, self.next + fresh, dtype=np.int64)]
        )
        self.next += fresh
        self.outstanding[island] = positions
        return positions

    def submitted(self, island: int) -> int:
        """``island`` submitted its round: its lease becomes pending. Returns its rows."""
        positions = self.outstanding.pop(island)
        self.pending[island] = positions
        return len(positions)

    def give_back(self, island: int) -> int:
        """``island`` died before submitting: its lease returns to the queue's front.
        Returns the rows returned (0 if it held none)."""
        positions = self.outstanding.pop(island, None)
        if positions is None:
            return 0
        self.returned = [int(p) for p in positions] + self.returned
        return len(positions)

    def retry(self, islands: Iterable[int]) -> int:
        """The open round was not applied (a shard holder lost a pseudo-gradient): these
        islands' pending positions return to the queue's front, in island order, to be
        trained again. Returns the rows returned."""
        back = [int(p) for i in sorted(islands) for p in self.pending.pop(i)]
        self.returned = back + self.returned
        return len(back)

    def pending_of(self, islands: Iterable[int]) -> np.ndarray:
        """The positions these islands submitted in the open round, in island order."""
        done = [self.pending[i] for i in sorted(islands)]
        return np.concatenate(done) if done else np.zeros(0, np.int64)

    def commit(self, islands: Iterable[int]) -> np.ndarray:
        """The open round was applied with these islands' submissions: their positions
        are committed (returned, in island order)."""
        positions = self.pending_of(islands)
        for i in islands:
            del self.pending[i]
        self.committed += len(positions)
        return positions

    @property
    def exhausted(self) -> bool:
        """Every position was leased and nothing is outstanding, pending or returned."""
        return (
            self.next == self.total
            and not self.returned
            and not self.outstanding
            and not self.pending
        )

    # -------------------------------------------------------------------- rows
    def rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, row index) of each position."""
        positions = np.asarray(positions, np.int64)
        epochs = positions // self.num_rows
        rows = np.empty_like(positions)
        for e in np.unique(epochs):
            mask = epochs == e
            rows[mask] = self._permutation(int(e))[positions[mask] % self.num_rows]
        return epochs, rows

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            if self.seed is None:
                perm = np.arange(self.num_rows, dtype=np.int64)
            else:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            self._perm = (epoch, perm)
        return self._perm[1]

    # ------------------------------------------------------------- checkpoint
    def state_dict(self, committing: Iterable[int] = ()) -> dict[str, Any]:
        """The committed state, as it is once ``committing``'s submissions are committed
        (a round's checkpoint is written before the round is committed in memory).
        Leases still open (asynchronous islands save while others train) are saved as
        returned: a coordinator restored from it hands them out again, since the
        parameters saved with it never saw them."""
        committing = set(committing)
        pending = [lease for i, lease in self.pending.items() if i not in committing]
        open_leases = [*self.outstanding.values(), *pending]
        returned = [int(p) for lease in open_leases for p in lease] + self.returned
        return {
            "num_rows": self.num_rows,
            "epochs": self.epochs,
            "seed": self.seed,
            "next": self.next,
            "returned": returned,
            "committed": self.committed + len(self.pending_of(committing)),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RowLedger:
        ledger = cls(state["num_rows"], state["epochs"], state["seed"])
        ledger.next = int(state["next"])
        ledger.returned = [int(p) for p in state["returned"]]
        ledger.committed = int(state["committed"])
        return ledger
