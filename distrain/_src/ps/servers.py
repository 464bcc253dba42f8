"""All parameter servers of a strategy, seen as one: the client side.

`ServerGroup` is what the coordinator and the workers' host callbacks talk
to. It knows the layout (which pieces live where) and the staleness mode,
and turns one logical call (pull the params, push a gradient, admit a step)
into calls on the right servers. Backends only say how one call on a set of
servers is made (`_call`): directly on objects in this process
(`LocalServerGroup`), or as Ray actor calls (`distrain._src.ps.ray_backend`).
"""

from __future__ import annotations

import abc
import typing
from collections.abc import Sequence
from typing import Any

import numpy as np

from distrain._src.ps.server import ParameterServer
from distrain._src.ps.variable_layout import Layout


class ServerGroup(abc.ABC):
    """Logical operations on all parameter servers; subclasses implement `_call`.

    Args:
        layout: where each piece lives.
        max_staleness: None, 0 (synchronous rounds) or a positive bound.
    """

    # Whether a push returns only once the gradient is applied (true where
    # servers are other processes, whose push handler may call JAX).
    applies_on_push = False

    def __init__(self, layout: Layout, max_staleness: int | None):
        self.layout = layout
        self.max_staleness = max_staleness

    @property
    def num_ps(self) -> int:
        return self.layout.num_ps

    @abc.abstractmethod
    def _call(
        self, method: str, args: Sequence[tuple] | tuple = (), shards: Sequence[int] | None = None
    ) -> list[Any]:
        """Calls ``method`` on ``shards`` (all by default); one args tuple each, or shared."""

    # ------------------------------------------------------------ worker side
    def pull(self, seq: int) -> list[np.ndarray]:
        """The flattened params step ``seq`` computes on."""
        return self.layout.join(self._call("pull", (seq,)))

    def push(self, seq: int, leaves: Sequence[np.ndarray], after_first: Any = None) -> bool:
        """Sends each server its part of the gradient; True if any server took it.

        ``after_first`` (fault injection) is called after the first server took
        its part, so a test can kill a worker in the middle of a push.
        """
        parts = self.layout.split(leaves)
        apply = self.applies_on_push
        if after_first is None:
            return any(self._call("push", [(seq, p, apply) for p in parts]))
        first = self._call("push", [(seq, parts[0], apply)], shards=[0])
        after_first()
        rest = self._call(
            "push", [(seq, p, apply) for p in parts[1:]], shards=range(1, self.num_ps)
        )
        return any(first + rest)

    # ------------------------------------------------------- coordinator side
    def acquire(self, seq: int, timeout: float | None) -> bool:
        """Admits step ``seq`` (blocks up to ``timeout``); False if not yet."""
        if self.max_staleness is None:
            return True
        if self.max_staleness == 0:
            return all(self._call("acquire", (seq, timeout)))
        return self._call("acquire", (seq, timeout), shards=[0])[0]

    def finish(self, seq: int) -> None:
        """After a successful step: wait until its gradient is applied (then release it).

        Waiting bounds the queue of every server by the number of workers: a
        worker that pushed faster than the servers apply would otherwise run
        ever further ahead on ever staler params. Synchronous rounds need no
        wait (the next round's admission waits for this one).
        """
        if self.max_staleness == 0:
            return
        if not self.applies_on_push:
            self._call("wait_applied", (seq, None))
        if self.max_staleness is not None:
            self._call("release", (seq,), shards=[0])

    def release(self, seq: int) -> None:
        """Ends the admission of a step that failed and will be retried."""
        if self.max_staleness is not None and self.max_staleness > 0:
            self._call("release", (seq,), shards=[0])

    def abandon(self, seqs: Sequence[int]) -> None:
        """Steps that will never push: rounds and admissions stop waiting for them."""
        if seqs:
            self._call("abandon", (list(seqs),))

    def flush(self, next_seq: int) -> int:
        """Closes a partial synchronous round; returns the next step number to use."""
        return max(self._call("flush", (next_seq,)))

    def wait_idle(self) -> None:
        """Returns once every pushed gradient is applied on every server."""
        self._call("wait_idle", (None,))

    def start_session(self) -> None:
        self._call("start_session")

    def ping(self) -> None:
        """Raises `ParameterServerUnavailableError` if any server is gone."""
        self._call("ping")

    def read(self) -> list[np.ndarray]:
        """The current flattened params, assembled from all servers."""
        return self.layout.join(self._call("read"))

    def stats(self) -> list[dict[str, Any]]:
        return self._call("stats")

    def get_state(self) -> list[dict[str, Any]]:
        return self._call("get_state")

    def set_state(self, states: Sequence[dict[str, Any]]) -> None:
        self._call("set_state", [(s,) for s in states])

    @abc.abstractmethod
    def fail(self, index: int) -> None:
        """Fault injection: makes server ``index`` unavailable."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stops every server."""


@typing.final
class LocalServerGroup(ServerGroup):
    """Parameter servers as objects in this process (the in-process backend)."""

    def __init__(self, servers: Sequence[ParameterServer], layout: Layout, max_staleness):
        super().__init__(layout, max_staleness)
        self.servers = list(servers)

    def _call(self, method, args=(), shards=None):
        indices = range(self.num_ps) if shards is None else shards
        per_shard = args if isinstance(args, list) else [args] * len(indices)
        return [
            getattr(self.servers[i], method)(*a) for i, a in zip(indices, per_shard, strict=True)
        ]

    def fail(self, index: int) -> None:
        self.servers[index].fail()

    def shutdown(self) -> None:
        for server in self.servers:
            server.shutdown()


def check_index(index: int, count: int, what: str) -> None:
    if not isinstance(index, int) or not 0 <= index < count:
        raise ValueError(f"{what} index must be in [0, {count}). Received: {index!r}.")
