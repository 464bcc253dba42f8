"""An island's talk with the run's coordinator, shared by the island's processes.

An island may be a ``jax.distributed`` world of several processes (``distrain launch
--islands N --nproc-per-island P``). Its process 0 alone calls the coordinator (join,
heartbeat, wait_round, lease, submit, donate, take_state, leave); every call is then
broadcast to the island's other processes with a JAX collective over the island's
devices (``multihost_utils.broadcast_one_to_all``), so that every process sees the same
round, global parameters, leased rows and healed optimizer state, in the same order.

Each call is one *exchange*: a header (a status code, a few numbers and a message),
then, when the call succeeded, its payload, whose shapes every process knows in advance
(the parameters' and the optimizer state's leaves, the rows padded to one round's). A
call that must be polled (``wait_round``, ``lease``, ``take_state``) sends a "pending"
header after each try, so that no collective waits longer than one try (about 2 s). An
error raised on process 0 (``RejoinRequired``, ``IslandsFailed``, ``ValueError``,
``TimeoutError``, anything else) is sent as a code and its message, and every process
raises the same kind: no process waits for an exchange that never comes, and no two
processes disagree.

With one process (:class:`Link` with ``processes=1``) nothing is broadcast.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from distrain._src.islands.healing import Healing
from distrain._src.islands.island_coordinator import IslandsFailed, RejoinRequired

_OK, _PENDING = 0, 1
# An error's kind, by code (the order is the protocol: every process must agree).
_ERRORS: tuple[type[BaseException], ...] = (
    RejoinRequired,
    IslandsFailed,
    ValueError,
    TimeoutError,
    RuntimeError,
)
_MESSAGE_BYTES = 2048


class IslandError(RuntimeError):
    """An error of process 0 other than the coordinator's own kinds, on another process."""


def rendezvous(processes: int) -> None:
    """A first collective of the island's processes, before process 0's slow start-up
    (Ray, the coordinator): JAX's CPU collectives (gloo) give a process 30 s to join a
    new communicator (a loaded machine's Ray start-up took longer), and no limit to a
    collective in an established one.

    Example:
      >>> rendezvous(1)  # one process: nothing to meet
    """
    if processes > 1:
        from jax.experimental.multihost_utils import broadcast_one_to_all

        broadcast_one_to_all(np.zeros(1, np.int32))


def _code_of(error: BaseException) -> int:
    for k, kind in enumerate(_ERRORS):
        if isinstance(error, kind):
            return 2 + k
    return 2 + len(_ERRORS)


def _error_of(code: int, message: str) -> BaseException:
    kind = _ERRORS[code - 2] if code - 2 < len(_ERRORS) else IslandError
    return kind(message)


class Link:
    """This process's end of the island's talk with the coordinator.

    Args:
      coord: the coordinator proxy (``remote.Coordinator``); used on process 0 only.
      island: this island's id.
      params: the global parameters' leaves as this process built them (their shapes
        and dtypes are those of every broadcast of the global parameters).
      opt_state: the inner optimizer state's leaves (the shapes of a healed state), or
        None without healing.
      lease_rows: the most rows one lease holds (``sync_every x batch_size``).
      processes, process: the island's processes and this one's index.
      broadcast: ``multihost_utils.broadcast_one_to_all`` (from process 0 to all).

    Example (in :func:`island.train`)::

        link = Link(coord, island, leaves, None, H * B, jax.process_count(),
                    jax.process_index())
        done = link.join(structure, None, False)
        r, params, finished, hang_s, donate = link.wait_round(after=-1, until=300)
    """

    def __init__(
        self,
        coord: Any,
        island: int,
        params: Sequence[np.ndarray],
        opt_state: Sequence[np.ndarray] | None,
        lease_rows: int,
        processes: int = 1,
        process: int = 0,
        broadcast: Callable[[Any], Any] | None = None,
    ) -> None:
        if broadcast is None and processes > 1:
            from jax.experimental.multihost_utils import broadcast_one_to_all as broadcast
        self.coord = coord
        self.island = island
        self.leader = process == 0
        self.shared = processes > 1
        self.broadcast = broadcast
        self.params = [np.zeros(np.shape(x), np.asarray(x).dtype) for x in params]
        self.opt_state = (
            None if opt_state is None else [np.zeros(np.shape(x), x.dtype) for x in opt_state]
        )
        self.lease_rows = lease_rows
        self.token: str | None = None  # process 0's live token
        self._beats: threading.Event | None = None

    # -------------------------------------------------------------- the exchange
    def _header(
        self, code: int, ints: Sequence[int] = (), floats: Sequence[float] = (), message: str = ""
    ) -> tuple[int, np.ndarray, np.ndarray, str]:
        """Process 0's header, received by every process: (code, ints, floats, message)."""
        if not self.shared:
            return code, np.asarray(ints, np.int32), np.asarray(floats, np.float32), message
        head = np.zeros(4, np.int32)
        head[0] = code
        head[1 : 1 + len(ints)] = ints
        nums = np.zeros(2, np.float32)
        nums[: len(floats)] = floats
        text = np.zeros(_MESSAGE_BYTES, np.uint8)
        raw = message.encode()[:_MESSAGE_BYTES]
        text[: len(raw)] = np.frombuffer(raw, np.uint8)
        assert self.broadcast is not None
        head, nums, text = self.broadcast((head, nums, text))
        message = bytes(np.asarray(text)).rstrip(b"\0").decode(errors="replace")
        return int(head[0]), np.asarray(head[1:]), np.asarray(nums), message

    def _payload(self, leaves: list[np.ndarray]) -> list[np.ndarray]:
        if not self.shared or not leaves:
            return leaves
        assert self.broadcast is not None
        return [np.asarray(x) for x in self.broadcast(leaves)]

    def _share(self, call: Callable[[], Any] | None, pack: Callable[[Any], tuple]) -> Any:
        """Process 0 runs ``call`` once (None if it should be tried again); every process
        gets ``(ints, floats, payload)`` as ``pack`` made them from its result, or
        ``None`` (pending), or raises process 0's error."""
        result: Any = None
        error: BaseException | None = None
        ints: Sequence[int] = ()
        floats: Sequence[float] = ()
        payload: list[np.ndarray] = []
        if self.leader:
            assert call is not None
            try:
                result = call()
                if result is not None:
                    ints, floats, payload = pack(result)
            except Exception as e:  # noqa: BLE001 - sent to the island, raised again below
                error = e
        code = _PENDING if result is None and error is None else _OK
        code = _code_of(error) if error is not None else code
        code, head, nums, message = self._header(code, ints, floats, str(error or ""))
        if error is not None:
            raise error
        if code >= 2:
            raise _error_of(code, message)
        if code == _PENDING:
            return None
        return head, nums, self._payload(payload if self.leader else pack(None)[2])

    def _poll(
        self, call: Callable[[], Any], pack: Callable[[Any], tuple], until: float, what: str
    ) -> Any:
        """``_share`` until process 0's call answers; TimeoutError after ``until`` s."""
        deadline = time.time() + until

        def once() -> Any:
            result = call()
            if result is None and time.time() > deadline:
                raise TimeoutError(f"{what}() of the islands' coordinator had no answer for "
                                   f"{until:g} s.")  # fmt: skip
            return result

        while True:
            shared = self._share(once if self.leader else None, pack)
            if shared is not None:
                return shared

    # ----------------------------------------------------------------- the calls
    def join(self, structure: str, optimizer: str | None, heal: bool) -> int:
        """Joins (a new incarnation of) the island; returns the inner steps its earlier
        incarnations' applied rounds kept."""
        coord, island = self.coord, self.island

        def call() -> tuple[str, int]:
            return coord.retry(lambda: coord("join", island, structure, optimizer, heal))

        def pack(joined: Any) -> tuple:
            if joined is not None:
                self.token = joined[0]
            return ((0,) if joined is None else (joined[1],)), (), []

        head, _, _ = self._share(call if self.leader else None, pack)
        return int(head[0])

    def wait_round(
        self, after: int, until: float
    ) -> tuple[int, list[np.ndarray], bool, float, bool]:
        """The round after ``after`` this island trains: ``(round, global parameters,
        finished, hang_s, donate)`` (``IslandCoordinator.wait_round``)."""

        def call() -> Any:
            return self.coord("wait_round", self.island, self.token, after)

        def pack(got: Any) -> tuple:
            if got is None:
                return (), (), self.params
            r, leaves, finished, hang_s, donate = got
            cast = [np.asarray(x, t.dtype) for x, t in zip(leaves, self.params, strict=True)]
            return (r, int(finished), int(donate)), (hang_s,), cast

        head, nums, leaves = self._poll(call, pack, until, "wait_round")
        return int(head[0]), leaves, bool(head[1]), float(nums[0]), bool(head[2])

    def take_state(self, r: int, until: float, check: Callable[[Healing], None]) -> Healing:
        """A live peer's inner optimizer state for round ``r`` (``check`` refuses one
        unlike this island's, on process 0, before it is broadcast)."""

        got: list[Healing] = []  # process 0's answer, whose reason it keeps

        def call() -> Any:
            healing = self.coord("take_state", self.island, self.token, r)
            if healing is not None:
                check(healing)
                got.append(healing)
            return healing

        def pack(healing: Any) -> tuple:
            template = list(self.opt_state or [])
            if healing is None or healing.donor is None:
                return (-1,), (), template
            return (healing.donor,), (), [np.asarray(x) for x in healing.leaves]

        head, _, leaves = self._poll(call, pack, until, "take_state")
        donor = None if int(head[0]) < 0 else int(head[0])
        why = got[-1].why if got else ""  # said by process 0 only
        return Healing(donor, None if donor is None else leaves, why)

    def donate(self, r: int, leaves: list[np.ndarray]) -> None:
        """Posts this island's inner optimizer state at the start of round ``r``."""
        self._share(lambda: self.coord("donate", self.island, self.token, r, leaves) or False,
                    lambda _: ((), (), []))  # fmt: skip

    def lease(self, r: int, until: float) -> np.ndarray:
        """The row indices this island trains in round ``r``."""

        def call() -> Any:
            return self.coord("lease", self.island, self.token, r)

        def pack(got: Any) -> tuple:
            padded = np.zeros(self.lease_rows, np.int32)
            if got is None:
                return (0,), (), [padded]
            rows = np.asarray(got[1])
            padded[: len(rows)] = rows
            return (len(rows),), (), [padded]

        head, _, (rows,) = self._poll(call, pack, until, "lease")
        return np.asarray(rows[: int(head[0])], np.int64)

    def submit(self, r: int, grads: list[np.ndarray] | None, metrics: dict[str, float]) -> bool:
        """Submits process 0's pseudo-gradient (the island's: its parameters are
        replicated over the island); returns whether it was applied."""

        def call() -> Any:
            return (self.coord("submit", self.island, self.token, r, grads, metrics),)

        head, _, _ = self._share(call if self.leader else None,
                                 lambda got: ((int(bool(got and got[0])),), (), []))  # fmt: skip
        return bool(head[0])

    def leave(self) -> None:
        """The island finished; the last island out ends the coordinator."""
        if self._beats is not None:
            self._beats.set()

        def call() -> Any:
            if self.coord("leave", self.island, self.token):
                self.coord.kill()
            return (0,)

        self._share(call if self.leader else None, lambda _: ((), (), []))

    # ------------------------------------------------------------- heartbeats
    def start_heartbeats(self, interval: float) -> threading.Event:
        """On process 0, a thread that sends this island's heartbeat every ``interval``
        s while it has a token; returns the event that stops it."""
        stop = self._beats = threading.Event()
        if not self.leader:
            return stop

        def beat() -> None:
            while not stop.wait(interval):
                if self.token is not None:
                    try:
                        self.coord("heartbeat", self.island, self.token)
                    except Exception:  # noqa: BLE001 - a rejoin or a restart: the loop's
                        pass

        threading.Thread(target=beat, daemon=True, name=f"island-{self.island}-heartbeat").start()
        return stop
