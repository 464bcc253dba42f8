"""The in-process backend: servers are objects, workers are threads on local devices.

Parameter servers are `ParameterServer` objects in this process (each with
its applier thread). Worker ``i`` is a coordinator thread that runs compiled
steps on local device ``i % len(jax.local_devices())``; its host callbacks
call the servers directly. A worker "dies" when an injected fault fires in
its thread; the thread then stops taking functions.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence

import jax
import numpy as np
import optax

from distrain._src.ps.backend import ServerBackend, Worker
from distrain._src.ps.server import ParameterServer
from distrain._src.ps.servers import LocalServerGroup, ServerGroup
from distrain._src.ps.variable_layout import Layout
from distrain._src.ps.worker import StepRuntime, WorkerCore


@typing.final
class InProcessBackend(ServerBackend):
    """Creates in-process servers and workers."""

    name = "inprocess"

    def __init__(self) -> None:
        self.devices = jax.local_devices()

    def default_num_workers(self) -> int:
        return len(self.devices)

    def create_group(
        self,
        layout: Layout,
        pieces: Sequence[Sequence[np.ndarray]],
        tx: optax.GradientTransformation,
        round_size: int,
        max_staleness: int | None,
    ) -> LocalServerGroup:
        servers = [
            ParameterServer(i, p, tx, round_size=round_size, max_staleness=max_staleness)
            for i, p in enumerate(pieces)
        ]
        return LocalServerGroup(servers, layout, max_staleness)

    def create_workers(self, group: ServerGroup, num_workers: int) -> list[Worker]:
        runtime = StepRuntime(group)
        return [
            WorkerCore(i, num_workers, self.devices[i % len(self.devices)], runtime)
            for i in range(num_workers)
        ]

    def close_workers(self, workers: Sequence[Worker]) -> None:
        pass  # a thread-run worker stops when its driver thread takes no more steps

    def shutdown(self) -> None:
        pass  # the servers are the group's, shut down with it
