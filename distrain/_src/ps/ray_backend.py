"""The Ray backend: parameter servers and workers as Ray actors.

Each parameter server is a threaded Ray actor running `ParameterServer`
(threaded because admission and "wait until applied" calls block while
pushes must go on). Each worker is a Ray actor holding a `WorkerCore`; its
compiled steps' host callbacks call the server actors (``ray.get`` inside the
callback). The coordinator stays in the driver process and calls the worker
actors; a worker actor that dies (``ray.kill``, a crash, an injected fault,
which exits the process) raises ``RayActorError`` there and the function is
rescheduled; a server actor that dies surfaces as
`ParameterServerUnavailableError`.

Connecting: if Ray is already initialised it is used as is. Otherwise
``ray_address=None`` starts a local instance with 2 CPUs, no dashboard, and
every Ray server bound to 127.0.0.1; an address is checked with a plain TCP
connection first (3 s), so an unreachable cluster is reported at once and by
name instead of after Ray's own long retries.
"""

from __future__ import annotations

import itertools
import os
import socket
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import optax

from distrain._src import verbosity
from distrain._src.ps.backend import ServerBackend, Worker
from distrain._src.ps.errors import ParameterServerUnavailableError, WorkerFailure
from distrain._src.ps.per_worker_datasets import IteratorRef
from distrain._src.ps.server import ParameterServer
from distrain._src.ps.servers import ServerGroup
from distrain._src.ps.step import StepProgram
from distrain._src.ps.variable_layout import Layout
from distrain._src.ps.worker import StepRuntime, WorkerCore

LOCAL_NUM_CPUS = 2
CONNECT_TIMEOUT_S = 3.0
ACTOR_START_TIMEOUT_S = 120.0
# Ray resolves 127.0.0.1 to the machine's public address on Linux unless this
# is off (ray._private.ray_constants.ENABLE_RAY_CLUSTER); a local training run
# has no reason to listen on the network.
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "ParameterServerStrategy(backend='ray') needs Ray. Install the extra: "
            "`pip install 'distrain[ray]'`."
        ) from e
    return ray


def _host_port(address: str) -> tuple[str, int]:
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            "ray_address must be None (start Ray locally), 'auto', 'host:port' or "
            f"'ray://host:port'. Received: ray_address={address!r}."
        )
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raises ConnectionError naming ``address`` if nothing listens there."""
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise ConnectionError(
            f"Cannot reach the Ray cluster at ray_address={address!r} ({e}). Expected a running "
            "Ray head node there (`ray start --head`); or pass ray_address=None to start Ray "
            "locally."
        ) from None


def connect(address: str | None) -> bool:
    """Initialises Ray unless it already is; returns True if this call started it."""
    ray = _import_ray()
    verbosity.quiet_ray()  # "Connecting to existing Ray cluster" at each start: quiet
    remote = address not in (None, "local", "auto")
    if remote:
        check_reachable(cast(str, address))  # cast: `remote` excludes None
    if ray.is_initialized():
        return False
    if not remote and address != "auto":
        from ray._private import ray_constants

        saved_env = os.environ.get(_LOOPBACK_ENV)
        saved_flag = ray_constants.ENABLE_RAY_CLUSTER
        os.environ[_LOOPBACK_ENV] = "0"  # read by the Ray processes started now
        ray_constants.ENABLE_RAY_CLUSTER = False  # read by this process
        try:
            ray.init(address="local", num_cpus=LOCAL_NUM_CPUS, include_dashboard=False)
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = saved_flag
            if saved_env is None:
                os.environ.pop(_LOOPBACK_ENV, None)
            else:
                os.environ[_LOOPBACK_ENV] = saved_env
        return True
    try:
        ray.init(address=address)
    except ConnectionError as e:
        raise ConnectionError(f"Cannot connect to the Ray cluster at {address!r}: {e}") from e
    return True


@typing.final
class RayServerGroup(ServerGroup):
    """Parameter servers as Ray actors. Picklable: workers receive it."""

    applies_on_push = True

    def __init__(self, handles: Sequence[Any], layout: Layout, max_staleness: int | None):
        super().__init__(layout, max_staleness)
        self.handles = list(handles)

    def _call(self, method, args=(), shards=None):
        ray = _import_ray()
        indices = list(range(self.num_ps) if shards is None else shards)
        per_shard = args if isinstance(args, list) else [args] * len(indices)
        refs = [
            getattr(self.handles[i], method).remote(*a)
            for i, a in zip(indices, per_shard, strict=True)
        ]
        results = []
        for i, ref in zip(indices, refs, strict=True):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayActorError as e:
                raise ParameterServerUnavailableError(
                    f"parameter server {i} is unavailable (its Ray actor died: "
                    f"{type(e).__name__}); its variables are lost. Build a new strategy and "
                    "coordinator, then call coordinator.restore(checkpoint_dir) to resume from "
                    "the latest checkpoint."
                ) from None
            except ray.exceptions.RayTaskError as e:
                raise e.cause from None
        return results

    def fail(self, index: int) -> None:
        _import_ray().kill(self.handles[index])

    def shutdown(self) -> None:
        ray = _import_ray()
        for handle in self.handles:
            ray.kill(handle)


def _exit_process(worker: int, at: str) -> None:
    os._exit(17)  # a real crash: the actor's process disappears mid-step


class _WorkerActor:
    """Body of a worker actor: a `WorkerCore` on the actor's first local device."""

    def __init__(self, index: int, num_workers: int, group: RayServerGroup):
        import jax

        runtime = StepRuntime(group, fault=_exit_process)
        self.core = WorkerCore(index, num_workers, jax.local_devices()[0], runtime)
        self.programs: dict[int, StepProgram] = {}
        self.dataset_fns: dict[int, Callable[..., Any]] = {}

    def ready(self) -> bool:
        return True

    def add_program(self, key: int, program: StepProgram) -> None:
        self.programs[key] = program

    def add_dataset(self, dataset_id: int, dataset_fn: Callable[..., Any]) -> None:
        self.dataset_fns[dataset_id] = dataset_fn

    def arm(self, at: str) -> None:
        self.core.arm(at)

    def run(self, key: int, seq: int, args: tuple, kwargs: dict) -> Any:
        import jax

        outputs = self.core.run(self.programs[key], seq, args, kwargs, self.dataset_fns)
        return jax.device_get(outputs)


_keys = itertools.count()


@typing.final
class RayWorker(Worker):
    """Coordinator-side proxy of a worker actor."""

    def __init__(self, index: int, actor: Any):
        self.index = index
        self.actor = actor
        self._programs: dict[int, int] = {}  # id(program) -> key on the actor
        self._program_refs: list[StepProgram] = []  # keeps ids unique
        self._datasets: set[int] = set()

    def run(
        self,
        program: StepProgram,
        seq: int,
        args: tuple,
        kwargs: dict,
        dataset_fns: Mapping[int, Callable[..., Any]],
    ) -> Any:
        ray = _import_ray()
        key = self._programs.get(id(program))
        if key is None:
            key = self._programs[id(program)] = next(_keys)
            self._program_refs.append(program)
            self.actor.add_program.remote(key, program)
        import jax

        for leaf in jax.tree.leaves((args, kwargs)):
            if isinstance(leaf, IteratorRef) and leaf.dataset_id not in self._datasets:
                self.actor.add_dataset.remote(leaf.dataset_id, dataset_fns[leaf.dataset_id])
                self._datasets.add(leaf.dataset_id)
        try:
            return ray.get(self.actor.run.remote(key, seq, args, kwargs))
        except ray.exceptions.RayActorError as e:
            raise WorkerFailure(
                f"worker {self.index} (a Ray actor) died: {type(e).__name__}"
            ) from e
        except ray.exceptions.RayTaskError as e:
            raise e.cause from None

    def arm(self, at: str) -> None:
        _import_ray().get(self.actor.arm.remote(at))


@typing.final
class RayBackend(ServerBackend):
    """Creates parameter-server and worker actors on a Ray cluster."""

    name = "ray"

    def __init__(self, address: str | None):
        self.started_ray = connect(address)

    def default_num_workers(self) -> int:
        return max(1, int(_import_ray().cluster_resources().get("CPU", 1)))

    def create_group(
        self,
        layout: Layout,
        pieces: Sequence[Sequence[np.ndarray]],
        tx: optax.GradientTransformation,
        round_size: int,
        max_staleness: int | None,
    ) -> RayServerGroup:
        ray = _import_ray()
        actor_cls = ray.remote(num_cpus=0, max_concurrency=64, max_restarts=0)(ParameterServer)
        handles = [
            actor_cls.remote(i, list(p), tx, round_size=round_size, max_staleness=max_staleness)
            for i, p in enumerate(pieces)
        ]
        group = RayServerGroup(handles, layout, max_staleness)
        ray.get([h.ping.remote() for h in handles], timeout=ACTOR_START_TIMEOUT_S)
        return group

    def create_workers(self, group: ServerGroup, num_workers: int) -> list[Worker]:
        ray = _import_ray()
        # One method at a time per worker: calls run in the order they were sent.
        actor_cls = ray.remote(num_cpus=0, max_concurrency=1, max_restarts=0)(_WorkerActor)
        actors = [actor_cls.remote(i, num_workers, group) for i in range(num_workers)]
        ray.get([a.ready.remote() for a in actors], timeout=ACTOR_START_TIMEOUT_S)
        return [RayWorker(i, a) for i, a in enumerate(actors)]

    def close_workers(self, workers: Sequence[Worker]) -> None:
        ray = _import_ray()
        for worker in workers:
            ray.kill(typing.cast(RayWorker, worker).actor)  # cast: this backend made them

    def shutdown(self) -> None:
        pass  # Ray stays initialised: later strategies of this process reuse it
