"""The two contracts a parameter-server backend fulfils: `ServerBackend` and `Worker`.

A backend says where the servers and the workers live: `InProcessBackend`
(``inprocess.py``: objects and threads in this process) or `RayBackend`
(``ray_backend.py``: Ray actors). The strategy owns one `ServerBackend`; the
coordinator talks to the `Worker` objects it creates, one driver thread each,
and to the servers through the `ServerGroup` (``servers.py``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import optax

from distrain._src.ps.servers import ServerGroup
from distrain._src.ps.step import StepProgram
from distrain._src.ps.variable_layout import Layout


class Worker(abc.ABC):
    """One worker, as the coordinator's driver thread sees it.

    Attributes:
        index: the worker's number, in ``[0, num_workers)``.
    """

    index: int

    @abc.abstractmethod
    def run(
        self,
        program: StepProgram,
        seq: int,
        args: tuple,
        kwargs: dict,
        dataset_fns: Mapping[int, Callable[..., Any]],
    ) -> Any:
        """Runs scheduled step ``seq``; returns its outputs.

        Raises:
            WorkerFailure: the worker died during the step (the step is retried elsewhere).
            Exception: what the step raised (reported by the coordinator).
        """

    @abc.abstractmethod
    def arm(self, at: str) -> None:
        """Fault injection: the worker fails at point ``at`` of its next step (one shot)."""


class ServerBackend(abc.ABC):
    """Makes the parameter servers and the workers of one strategy.

    Attributes:
        name: the ``backend`` argument that selects it.
    """

    name: str

    @abc.abstractmethod
    def default_num_workers(self) -> int:
        """Workers to start when the strategy is given none."""

    @abc.abstractmethod
    def create_group(
        self,
        layout: Layout,
        pieces: Sequence[Sequence[np.ndarray]],
        tx: optax.GradientTransformation,
        round_size: int,
        max_staleness: int | None,
    ) -> ServerGroup:
        """Starts one server per entry of ``pieces`` (its pieces of the params)."""

    @abc.abstractmethod
    def create_workers(self, group: ServerGroup, num_workers: int) -> list[Worker]:
        """Starts ``num_workers`` workers that talk to ``group``."""

    @abc.abstractmethod
    def close_workers(self, workers: Sequence[Worker]) -> None:
        """Stops ``workers`` (a driver waiting on one returns at once)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Releases what the backend itself holds."""
