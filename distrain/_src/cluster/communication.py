"""`CommunicationOptions`: which collectives library a multi-process job uses, and its timeouts.

TensorFlow names three implementations (`tf.distribute.experimental.
CommunicationImplementation`); in JAX they map to:

| implementation | CPU                          | GPU                            |
| -------------- | ---------------------------- | ------------------------------ |
| "auto"         | gloo (TCP) between processes | NCCL (JAX's only GPU choice)   |
| "ring"         | gloo (TCP) between processes | error: use "auto" or "nccl"    |
| "nccl"         | error: NCCL needs GPUs       | NCCL                           |

Within one process, devices always talk through XLA's own in-process
collectives; the choice only matters between processes.

Timeouts map to `jax.distributed.initialize`: `timeout_seconds` (TensorFlow's
name) bounds both how long start-up waits for every process to join
(`initialization_timeout`) and how long the survivors wait before giving up on
a peer that stopped sending heartbeats (`heartbeat_timeout_seconds`); the three
`*_timeout_seconds` fields override one each. None of them bounds a collective
waiting for a peer that is alive but stuck (that peer still sends heartbeats).

Example:
    >>> opts = CommunicationOptions("ring", timeout_seconds=30)
    >>> (opts.cpu_collectives, opts.initialization_timeout, opts.heartbeat_timeout)
    ('gloo', 30, 30)
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Mapping

# Environment variables read by `CommunicationOptions.from_env` (`distrain launch --timeout`
# sets the first; set DISTRAIN_COLLECTIVES yourself).
ENV_TIMEOUT_SECONDS = "DISTRAIN_TIMEOUT_SECONDS"
ENV_COLLECTIVES = "DISTRAIN_COLLECTIVES"

# Used when nothing is set. Start-up and shutdown keep jax.distributed.initialize's
# defaults (jax 0.10: 300 s each). The heartbeat timeout is shorter than JAX's 100 s:
# it is how long a process that is not in a collective with a dead peer (e.g. one
# that finished and waits in the shutdown barrier) lives on before the coordination
# service ends it. Heartbeats come from a C++ thread (a long compile or a busy
# Python thread does not delay them), so 20 s only misfires on a process frozen
# that long (stopped, swapping).
DEFAULT_INITIALIZATION_TIMEOUT = 300
DEFAULT_HEARTBEAT_TIMEOUT = 20
DEFAULT_SHUTDOWN_TIMEOUT = 300


class CommunicationImplementation(enum.StrEnum):
    """tf.distribute's collective implementations: AUTO, RING, NCCL."""

    AUTO = "auto"
    RING = "ring"
    NCCL = "nccl"


def _check_timeout(value: float | None, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(
            f"CommunicationOptions: {field} must be a positive number of seconds or None. "
            f"Received: {value!r}."
        )
    return value


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How processes of a `MultiWorkerMirroredStrategy` communicate.

    Args:
        implementation: "auto" (default), "ring" or "nccl", or a
            `CommunicationImplementation`; case-insensitive.
        timeout_seconds: bounds start-up and the detection of a dead peer; None
            keeps the defaults (300 s to start, 20 s heartbeat).
        initialization_timeout_seconds: overrides the start-up bound.
        heartbeat_timeout_seconds: overrides the dead-peer bound: a process
            that sent no heartbeat for this long is declared dead and the
            coordination service ends every other process (default 20 s).
        shutdown_timeout_seconds: how long a finishing process waits for the
            others at exit (JAX default 300 s).

    Raises:
        ValueError: an unknown implementation or a non-positive timeout.

    Example:
        >>> CommunicationOptions(implementation="NCCL").implementation
        <CommunicationImplementation.NCCL: 'nccl'>
    """

    implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO
    timeout_seconds: float | None = None
    initialization_timeout_seconds: float | None = None
    heartbeat_timeout_seconds: float | None = None
    shutdown_timeout_seconds: float | None = None

    def __post_init__(self) -> None:
        impl: CommunicationImplementation | str | None = self.implementation
        if isinstance(impl, str) and not isinstance(impl, CommunicationImplementation):
            try:
                impl = CommunicationImplementation(impl.strip().lower())
            except ValueError:
                impl = None
        if not isinstance(impl, CommunicationImplementation):
            choices = ", ".join(repr(c.value) for c in CommunicationImplementation)
            raise ValueError(
                f"CommunicationOptions: implementation must be one of {choices}. "
                f"Received: {self.implementation!r}."
            )
        object.__setattr__(self, "implementation", impl)
        for field in (
            "timeout_seconds",
            "initialization_timeout_seconds",
            "heartbeat_timeout_seconds",
            "shutdown_timeout_seconds",
        ):
            _check_timeout(getattr(self, field), field)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CommunicationOptions:
        """Options from DISTRAIN_COLLECTIVES and DISTRAIN_TIMEOUT_SECONDS (`distrain launch`).

        Raises:
            ValueError: a variable holds an invalid value (named in the message).

        Example:
            >>> CommunicationOptions.from_env({"DISTRAIN_TIMEOUT_SECONDS": "20"}).timeout_seconds
            20.0
        """
        env = os.environ if environ is None else environ
        timeout_text = env.get(ENV_TIMEOUT_SECONDS, "").strip()
        timeout = None
        if timeout_text:
            try:
                timeout = float(timeout_text)
            except ValueError:
                raise ValueError(
                    f"{ENV_TIMEOUT_SECONDS} must be a positive number of seconds. "
                    f"Received: {timeout_text!r}."
                ) from None
            if not timeout > 0:
                raise ValueError(
                    f"{ENV_TIMEOUT_SECONDS} must be a positive number of seconds. "
                    f"Received: {timeout_text!r}."
                )
        return cls(
            implementation=env.get(ENV_COLLECTIVES, "").strip() or "auto",
            timeout_seconds=timeout,
        )

    def _seconds(self, specific: float | None, default: int) -> int:
        value = specific if specific is not None else self.timeout_seconds
        # JAX takes whole seconds; round up so a short timeout never becomes 0.
        return default if value is None else max(1, math.ceil(value))

    @property
    def initialization_timeout(self) -> int:
        """Seconds `jax.distributed.initialize` waits for every process to join."""
        return self._seconds(self.initialization_timeout_seconds, DEFAULT_INITIALIZATION_TIMEOUT)

    @property
    def heartbeat_timeout(self) -> int:
        """Seconds without heartbeats after which a peer counts as dead."""
        return self._seconds(self.heartbeat_timeout_seconds, DEFAULT_HEARTBEAT_TIMEOUT)

    @property
    def shutdown_timeout(self) -> int:
        """Seconds a finishing process waits for the others at shutdown."""
        return self._seconds(self.shutdown_timeout_seconds, DEFAULT_SHUTDOWN_TIMEOUT)

    @property
    def cpu_collectives(self) -> str | None:
        """The value for `jax_cpu_collectives_implementation` ("gloo"), or None for NCCL."""
        return None if self.implementation is CommunicationImplementation.NCCL else "gloo"

    def check_platform(self, platform: str) -> None:
        """Raises if the implementation cannot run on `platform` ("cpu", "gpu", "tpu").

        Raises:
            ValueError: "nccl" on a machine without GPUs, or "ring" on GPUs.

        Example:
            >>> CommunicationOptions("ring").check_platform("cpu")
        """
        impl = self.implementation
        if impl is CommunicationImplementation.NCCL and platform != "gpu":
            raise ValueError(
                f"CommunicationOptions(implementation='nccl') needs GPU devices; this process's "
                f"devices are {platform!r}. Use implementation='auto' or 'ring' (gloo over TCP) "
                "on CPUs."
            )
        if impl is CommunicationImplementation.RING and platform == "gpu":
            raise ValueError(
                "CommunicationOptions(implementation='ring') is host (gloo) collectives; JAX "
                "talks between GPUs only through NCCL. Use implementation='auto' or 'nccl' on "
                "GPUs."
            )
